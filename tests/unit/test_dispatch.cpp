// Dispatch heuristics on tabulated devices, and the shared-memory check at load time.
#include <catch2/catch.hpp>

#include <algorithm>
#include <limits>
#include <tuple>

#include "dispatch.hpp"
#include "families/sm90_fwd.hpp"
#include "flashjit/dispatch.hpp"
#include "flashjit/codegen/render.hpp"
#include "flashjit/error.hpp"
#include "flashjit/tuning.hpp"
#include "module_cache.hpp"
#include "problem.hpp"

using namespace flashjit;

namespace {

DeviceProperties device(const char* name, int major, int minor, int sms, int smem_optin) {
  DeviceProperties d;
  d.name = name;
  d.cc_major = major;
  d.cc_minor = minor;
  d.sm_count = sms;
  d.max_smem_per_block_optin = smem_optin;
  return d;
}

// A backward known by its forward part, on the fa2_bwd path (backend fa2 unless another is set).
KernelSpec fa2_backward(detail::ForwardProblem p, const DeviceProperties& d, const TuningSources* tuning = nullptr) {
  if (p.backend == Backend::automatic) p.backend = Backend::fa2;
  return detail::select_kernel(detail::PassProblem{detail::Pass::backward, p}, d, tuning);
}

const DeviceProperties kA100 = device("NVIDIA A100-SXM4-80GB", 8, 0, 108, 166912);
const DeviceProperties kRtx4090 = device("NVIDIA GeForce RTX 4090", 8, 9, 128, 101376);
const DeviceProperties kH200 = device("NVIDIA H200", 9, 0, 132, 232448);
const DeviceProperties kV100 = device("Tesla V100-SXM2-32GB", 7, 0, 80, 98304);

alignas(16) unsigned char arena[1 << 16];

detail::ForwardProblem problem(int head_dim, bool causal = false, ScalarType dtype = ScalarType::bfloat16) {
  auto q = TensorView::contiguous(arena, dtype, {2, 64, 4, head_dim});
  auto k = TensorView::contiguous(arena, dtype, {2, 64, 4, head_dim});
  AttentionOptions options;
  options.causal = causal;
  return detail::make_forward_problem(q, k, k, q, nullptr, nullptr, options);
}

}  // namespace

TEST_CASE("dispatch targets the device's arch", "[dispatch]") {
  CHECK(kA100.arch().name() == "sm_80");
  CHECK(kRtx4090.arch().name() == "sm_89");
  CHECK(kH200.arch().name() == "sm_90a");
  for (const auto* d : {&kA100, &kRtx4090, &kH200}) {
    const KernelSpec spec = detail::select_forward_kernel(problem(128), *d);
    CHECK(spec.arch == d->arch());
    CHECK_FALSE(spec.validate().has_value());
  }
  CHECK_THROWS_WITH(detail::select_forward_kernel(problem(128), kV100),
                    Catch::Contains("needs sm_80 or newer"));
}

TEST_CASE("dispatch rounds head dims up and carries mask and dtype", "[dispatch]") {
  // fa2_fwd has kernels every 32 dims; sm90_fwd at 64, 96, 128, 192 and 256.
  const std::tuple<int, int, int> rounding[] = {{8, 32, 64},     {32, 32, 64},    {40, 64, 64},
                                                {72, 96, 96},    {128, 128, 128}, {136, 160, 192},
                                                {200, 224, 256}, {248, 256, 256}, {256, 256, 256}};
  for (auto [given, fa2, sm90] : rounding) {
    INFO("head_dim " << given);
    CHECK(detail::select_forward_kernel(problem(given), kA100).head_dim == fa2);
    const KernelSpec hopper = detail::select_forward_kernel(problem(given), kH200);
    CHECK(hopper.family == Family::sm90_fwd);
    CHECK(hopper.head_dim == sm90);
  }
  const KernelSpec causal = detail::select_forward_kernel(problem(64, true, ScalarType::float16), kA100);
  CHECK(causal.mask == MaskKind::causal);
  CHECK(causal.dtype == DType::fp16);
}

TEST_CASE("sm_90 picks sm90_fwd unless TMA cannot read the tensors", "[dispatch]") {
  CHECK(detail::select_forward_kernel(problem(128), kH200).family == Family::sm90_fwd);
  CHECK(detail::select_forward_kernel(problem(128), kA100).family == Family::fa2_fwd);
  // What flashjit-warm's presets compile ahead of time is what dispatch runs.
  CHECK(heuristic_forward_spec(kH200.arch(), DType::bf16, 128, MaskKind::causal) ==
        detail::select_forward_kernel(problem(128, true), kH200));
  // The problem checks already demand the 16-byte alignment TMA needs, so these layouts are made by
  // hand: the fallback and the error guard whatever the checks accept in future.
  detail::ForwardProblem odd_stride = problem(64);
  odd_stride.params.q_row_stride = 12;
  CHECK(detail::select_forward_kernel(odd_stride, kH200).family == Family::fa2_fwd);
  detail::ForwardProblem odd_base = problem(64);
  odd_base.params.k = arena + 8;
  CHECK(detail::select_forward_kernel(odd_base, kH200).family == Family::fa2_fwd);
  // No keys (O = 0, LSE = +inf): a TMA map cannot have an empty dim, so fa2_fwd writes that.
  auto q = TensorView::contiguous(arena, ScalarType::bfloat16, {2, 64, 4, 64});
  auto no_keys = TensorView::contiguous(arena, ScalarType::bfloat16, {2, 0, 4, 64});
  const detail::ForwardProblem keyless = detail::make_forward_problem(q, no_keys, no_keys, q, nullptr, nullptr, {});
  CHECK(detail::select_forward_kernel(keyless, kH200).family == Family::fa2_fwd);
  // Forcing the Hopper backend on them names the tensor and the reason.
  odd_stride.backend = Backend::sm90;
  CHECK_THROWS_WITH(detail::select_forward_kernel(odd_stride, kH200),
                    Catch::Contains("q: a stride of 12 elements is not a multiple of 16 bytes"));
  odd_base.backend = Backend::sm90;
  CHECK_THROWS_WITH(detail::select_forward_kernel(odd_base, kH200), Catch::Contains("16-byte aligned"));
  detail::ForwardProblem on_a100 = problem(128);
  on_a100.backend = Backend::sm90;
  CHECK_THROWS_WITH(detail::select_forward_kernel(on_a100, kA100), Catch::Contains("needs an sm_90 device"));
}

TEST_CASE("sm_margin must not be negative", "[dispatch]") {
  auto q = TensorView::contiguous(arena, ScalarType::bfloat16, {1, 16, 2, 64});
  AttentionOptions o;
  o.sm_margin = -1;
  CHECK_THROWS_WITH(detail::make_forward_problem(q, q, q, q, nullptr, nullptr, o), Catch::Contains("sm_margin must be >= 0"));
  o.sm_margin = 0;
  o.num_splits = -1;
  CHECK_THROWS_WITH(detail::make_forward_problem(q, q, q, q, nullptr, nullptr, o),
                    Catch::Contains("num_splits must be >= 0 (0: chosen, 1: no split), got -1"));
  o.num_splits = 3;
  CHECK(detail::make_forward_problem(q, q, q, q, nullptr, nullptr, o).num_splits == 3);
}

TEST_CASE("tail splits spread the last round of whole tiles over the CTAs", "[dispatch]") {
  using detail::choose_tail_split;
  auto split = [](long long tiles, int ctas, int key_blocks, int requested = 0) {
    const detail::TailSplit s = choose_tail_split(tiles, ctas, key_blocks, requested);
    return std::pair<long long, int>{s.tiles, s.splits};
  };
  // H200, block_m 192: at head dim 128 and 8k (block_n 80: 1376 tiles, 56 in the last round), halves
  // of 103 key blocks; at head dim 64 and 4k (block_n 128: 2816 tiles, 44 left), thirds of 32.
  CHECK(split(1376, 132, 103) == std::pair<long long, int>{56, 2});
  CHECK(split(2816, 132, 32) == std::pair<long long, int>{44, 3});
  // At 2k (1408 tiles, 88 left) thirds would fill two rounds of items, but items of 9 key blocks
  // cost too much of their own; so would any share of 12 blocks, even where 16 tiles leave most CTAs
  // idle.
  CHECK(split(1408, 132, 26) == std::pair<long long, int>{0, 1});
  CHECK(split(16, 132, 12) == std::pair<long long, int>{0, 1});
  // Whole rounds, or a last round nearly full, or too few key blocks: nothing to gain.
  CHECK(split(1320, 132, 103) == std::pair<long long, int>{0, 1});
  CHECK(split(1316, 132, 103) == std::pair<long long, int>{0, 1});
  CHECK(split(1376, 132, 7) == std::pair<long long, int>{0, 1});
  // Fewer tiles than CTAs, and long: all of them are the last round, in quarters.
  CHECK(split(16, 132, 40) == std::pair<long long, int>{16, 4});
  // Asked for: 1 never splits, n > 1 splits the last round n ways, at most one item per key block.
  CHECK(split(1408, 132, 26, 1) == std::pair<long long, int>{0, 1});
  CHECK(split(1408, 132, 26, 5) == std::pair<long long, int>{88, 5});
  CHECK(split(16, 132, 3, 8) == std::pair<long long, int>{16, 3});
  CHECK(split(16, 132, 1, 8) == std::pair<long long, int>{0, 1});
  CHECK(split(1320, 132, 26, 4) == std::pair<long long, int>{0, 1});
}

TEST_CASE("a masked forward that asks for tail splits gets a spec that has them", "[dispatch]") {
  auto hopper_problem = [](bool causal, int num_splits) {
    auto q = TensorView::contiguous(arena, ScalarType::bfloat16, {2, 64, 4, 128});
    AttentionOptions options;
    options.causal = causal;
    options.num_splits = num_splits;
    return detail::make_forward_problem(q, q, q, q, nullptr, nullptr, options);
  };
  // Unmasked specs have them; masked ones only where asked (num_splits > 1), being smaller without.
  CHECK(detail::select_forward_kernel(hopper_problem(false, 0), kH200).tail_splits);
  CHECK_FALSE(detail::select_forward_kernel(hopper_problem(true, 0), kH200).tail_splits);
  CHECK_FALSE(detail::select_forward_kernel(hopper_problem(true, 1), kH200).tail_splits);
  const KernelSpec split = detail::select_forward_kernel(hopper_problem(true, 3), kH200);
  CHECK(split.tail_splits);
  CHECK(split.mask == MaskKind::causal);
  CHECK_FALSE(detail::select_forward_kernel(hopper_problem(true, 3), kA100).tail_splits);  // (fa2_fwd has none)
  // A tuned causal entry serves the call with its tiles and the splits added.
  DeviceProperties h200 = kH200;
  h200.ordinal = 8;  // (the device stamp cache is by ordinal: apart from the other tests' H200)
  TunedEntry entry;
  entry.device = DeviceStamp::of(h200);
  entry.problem = detail::problem_key(hopper_problem(true, 0), Family::sm90_fwd);
  entry.spec = detail::select_forward_kernel(hopper_problem(true, 0), h200);
  entry.spec.block_n = 112;
  REQUIRE_FALSE(entry.spec.validate());
  entry.median_ms = 1;
  entry.tuned_at = "2026-12-04T00:00:00Z";
  TuningSources sources;
  sources.add_in_memory(entry);
  CHECK(detail::select_forward_kernel(hopper_problem(true, 0), h200, &sources) == entry.spec);
  KernelSpec tuned_split = entry.spec;
  tuned_split.tail_splits = true;
  CHECK(detail::select_forward_kernel(hopper_problem(true, 3), h200, &sources) == tuned_split);
  // A forced spec without them is refused for such a call, naming why.
  detail::ForwardProblem forced = hopper_problem(true, 3);
  forced.forced_kernel = entry.spec;
  CHECK_THROWS_WITH(detail::select_forward_kernel(forced, h200),
                    Catch::Contains("options.num_splits is 3 and it has no tail splits"));
  forced.forced_kernel = tuned_split;
  CHECK(detail::select_forward_kernel(forced, h200) == tuned_split);
  // The tuner's and flashjit-bench --sweep's candidates for such a call have them too.
  const detail::ForwardProblem asks = hopper_problem(true, 3);
  const auto plan = detail::tuning_plan(detail::PassProblem{detail::Pass::forward, asks}, kH200.arch());
  REQUIRE_FALSE(plan.candidates.empty());
  for (const KernelSpec& s : plan.candidates) CHECK(s.tail_splits);
}

TEST_CASE("options become mask kinds and kernel arguments", "[dispatch]") {
  auto q = TensorView::contiguous(arena, ScalarType::bfloat16, {1, 10, 2, 64});
  auto k = TensorView::contiguous(arena, ScalarType::bfloat16, {1, 20, 2, 64});
  auto make = [&](AttentionOptions o) { return detail::make_forward_problem(q, k, k, q, nullptr, nullptr, o); };
  AttentionOptions o;
  CHECK(make(o).mask == MaskKind::none);
  CHECK(make(o).params.softmax_scale == Approx(0.125f));
  o.causal = true;
  auto p = make(o);
  CHECK(p.mask == MaskKind::causal);
  CHECK(p.params.window_left == -1);
  CHECK(p.params.window_right == 0);
  o.window_left = 5;
  p = make(o);
  CHECK(p.mask == MaskKind::window);
  CHECK(p.params.window_left == 5);
  CHECK(p.params.window_right == 0);
  o = {};
  o.window_right = 3;
  CHECK(make(o).mask == MaskKind::window);
  // A side past both sequences (10 + 20 rows) bounds nothing: INT_MAX is "no window", not an
  // overflow in the kernels; one within them stays.
  constexpr int kHuge = std::numeric_limits<int>::max();
  o = {};
  o.window_right = kHuge;
  p = make(o);
  CHECK(p.mask == MaskKind::none);
  CHECK(p.params.window_right == -1);
  o.window_left = kHuge;
  CHECK(make(o).mask == MaskKind::none);
  o = {};
  o.causal = true;
  o.window_left = 31;
  p = make(o);
  CHECK(p.mask == MaskKind::causal);
  CHECK(p.params.window_left == -1);
  o.window_left = 30;
  CHECK(make(o).mask == MaskKind::window);
  o = {};
  o.window_left = 7;
  o.window_right = kHuge;
  p = make(o);
  CHECK(p.mask == MaskKind::window);
  CHECK(p.params.window_left == 7);
  CHECK(p.params.window_right == -1);
  o = {};
  o.softcap = 30.f;
  o.softmax_scale = 0.5f;
  p = make(o);
  CHECK(p.has_softcap);
  CHECK(p.params.softcap == 30.f);
  CHECK(p.params.softmax_scale == 0.5f);
  CHECK(p.params.q_row_stride == 128);
  CHECK(p.params.q_head_stride == 64);
  CHECK(p.params.k_batch_stride == 20 * 128);
  for (float bad_scale : {-0.5f, 0.f, std::numeric_limits<float>::infinity()}) {
    o.softmax_scale = bad_scale;
    CHECK_THROWS_WITH(make(o), Catch::Contains("softmax_scale must be positive and finite"));
  }
}

TEST_CASE("a kernel needing more shared memory than the device has is refused", "[dispatch]") {
  CompiledKernel kernel;
  kernel.spec = default_spec(Family::reference_fwd, Arch::parse("sm_80"), DType::bf16, 256);
  EntryStats stats;
  stats.name = "flashjit_reference_fwd_forward";
  stats.static_smem_bytes = 4096;
  kernel.entries = {stats};
  KernelLayout layout;
  layout.entries = {KernelEntry{"forward", stats.name, 40 * 1024}};
  const DeviceProperties small = device("Tiny GPU", 8, 0, 1, 48 * 1024);
  CHECK_NOTHROW(detail::check_shared_memory(kernel, layout, small));
  layout.entries[0].dynamic_smem_bytes = 48 * 1024;
  try {
    detail::check_shared_memory(kernel, layout, small);
    FAIL("accepted 52 KB on a 48 KB device");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::out_of_resources);
    CHECK_THAT(e.what(), Catch::Contains("(entry forward) needs 53248 bytes of shared memory per block (4096 static + "
                                         "49152 dynamic)") && Catch::Contains("allows 49152"));
  }
  // Entries are launched alone: one's static bytes and another's dynamic bytes do not add up (the
  // FP8 forward's V transpose holds a static tile, the forward itself only dynamic memory).
  EntryStats transpose;
  transpose.name = "flashjit_reference_fwd_transpose";
  transpose.static_smem_bytes = 17 * 1024;
  stats.static_smem_bytes = 0;
  kernel.entries = {stats, transpose};
  layout.entries = {KernelEntry{"forward", stats.name, 40 * 1024}, KernelEntry{"transpose", transpose.name, 0}};
  CHECK_NOTHROW(detail::check_shared_memory(kernel, layout, small));
}

TEST_CASE("backward dispatch: fa2_bwd defaults fit every arch, forced specs are checked", "[dispatch]") {
  for (const auto* d : {&kA100, &kRtx4090, &kH200})
    for (int head_dim : {32, 64, 96, 128, 160, 192, 224, 256})
      for (bool causal : {false, true}) {
        INFO(d->name << " head_dim " << head_dim << (causal ? " causal" : ""));
        const KernelSpec spec = fa2_backward(problem(head_dim, causal), *d);
        CHECK(spec.family == Family::fa2_bwd);
        CHECK(spec.arch == d->arch());
        CHECK(spec.head_dim == head_dim);
        CHECK(spec.mask == (causal ? MaskKind::causal : MaskKind::none));
        CHECK_FALSE(spec.validate().has_value());
        CHECK(dynamic_smem_bytes(spec) <= d->max_smem_per_block_optin);
      }
  // A forward spec forced on the backward (and the reverse) is refused by name.
  detail::ForwardProblem p = problem(128);
  p.forced_kernel = default_spec(Family::fa2_fwd, kH200.arch(), DType::bf16, 128);
  CHECK_THROWS_WITH(fa2_backward(p, kH200),
                    Catch::Contains("backward") && Catch::Contains("family fa2_fwd is not a backward family"));
  p.forced_kernel = default_spec(Family::fa2_bwd, kH200.arch(), DType::bf16, 128);
  CHECK_THROWS_WITH(detail::select_forward_kernel(p, kH200),
                    Catch::Contains("family fa2_bwd is not a forward family"));
  CHECK(fa2_backward(p, kH200) == *p.forced_kernel);
  p.forced_kernel = default_spec(Family::fa2_bwd, kH200.arch(), DType::bf16, 128, MaskKind::causal);
  CHECK_THROWS_WITH(fa2_backward(p, kH200), Catch::Contains("mask causal but the options ask for none"));
  p.forced_kernel.reset();
  p.backend = Backend::reference;
  CHECK_THROWS_WITH(fa2_backward(p, kH200), Catch::Contains("no reference backward kernel"));
}

TEST_CASE("backward workspace: the dQ accumulator starts aligned after the row statistics", "[dispatch]") {
  for (auto [batch, seqlen, heads] : {std::tuple{1, 37, 1}, {3, 113, 5}, {2, 64, 4}}) {
    auto q = TensorView::contiguous(arena, ScalarType::bfloat16, {batch, seqlen, heads, 64});
    auto lse = TensorView::contiguous(arena, ScalarType::float32, {batch, heads, seqlen});
    const auto p = detail::make_backward_problem(q, q, q, q, q, &lse, q, q, q, nullptr, AttentionOptions{});
    INFO("batch " << batch << " seqlen " << seqlen << " heads " << heads);
    CHECK(p.params.workspace_rows == batch * seqlen);
    CHECK(p.delta_bytes() == size_t(heads) * batch * seqlen * 4);
    CHECK(p.dq_accum_offset() >= p.delta_bytes());
    CHECK(p.dq_accum_offset() % 256 == 0);  // float4 and red.v2 accesses
    CHECK(p.dq_accum_bytes() == p.delta_bytes() * 64);
  }
}

TEST_CASE("backward dispatch: sm90_bwd at every head dim on sm_90 (deterministic: 64, 96 and above 128), "
          "fa2_bwd elsewhere", "[dispatch]") {
  auto backward = [](int head_dim, AttentionOptions options = {}, bool deterministic = false) {
    auto q = TensorView::contiguous(arena, ScalarType::bfloat16, {2, 64, 4, head_dim});
    auto lse = TensorView::contiguous(arena, ScalarType::float32, {2, 4, 64});
    options.deterministic = deterministic;
    return detail::make_backward_problem(q, q, q, q, q, &lse, q, q, q, nullptr, options);
  };
  const KernelSpec hopper = detail::select_backward_kernel(backward(128), kH200);
  CHECK(hopper.family == Family::sm90_bwd);
  CHECK_FALSE(hopper.validate().has_value());
  CHECK(dynamic_smem_bytes(hopper) <= kH200.max_smem_per_block_optin);
  CHECK(detail::select_backward_kernel(backward(112), kH200).family == Family::sm90_bwd);  // rounded up, as fa2_bwd
  CHECK(detail::select_backward_kernel(backward(64), kH200).family == Family::sm90_bwd);
  CHECK(detail::select_backward_kernel(backward(40), kH200).family == Family::sm90_bwd);
  const KernelSpec wide = detail::select_backward_kernel(backward(256), kH200);
  CHECK(wide.family == Family::sm90_bwd);
  CHECK(wide.head_dim == 256);
  CHECK(wide.block_n == 64);  // the consumers share 64 keys and split the head dim
  CHECK_FALSE(wide.validate().has_value());
  CHECK(dynamic_smem_bytes(wide) <= kH200.max_smem_per_block_optin);
  // What flashjit-warm's presets compile ahead of time is what dispatch runs.
  AttentionOptions causal;
  causal.causal = true;
  for (const auto* d : {&kA100, &kH200})
    for (int head_dim : {64, 128, 256})
      for (bool deterministic : {false, true})  // (--passes bwd and bwd-deterministic)
        CHECK(heuristic_backward_spec(d->arch(), DType::bf16, head_dim, MaskKind::causal, false, deterministic) ==
              detail::select_backward_kernel(backward(head_dim, causal, deterministic), *d));
  // sm90_bwd takes every head dim on sm_90, rounded up to its kernels' (64, 96, 128, 192, 256).
  for (auto [head_dim, kernel_head_dim] : {std::pair{32, 64}, {96, 96}, {160, 192}, {192, 192}, {224, 256}}) {
    const KernelSpec s = detail::select_backward_kernel(backward(head_dim), kH200);
    CHECK(s.family == Family::sm90_bwd);
    CHECK(s.head_dim == kernel_head_dim);
  }
  CHECK(detail::select_backward_kernel(backward(128), kA100).family == Family::fa2_bwd);
  // Deterministic mode: sm90_bwd's ordered dQ at every head dim, where its writer warp adds dQ (up to
  // 128, rounded up too: its TMA adds clip the columns past the head dim) and where its consumers do
  // (above 128).
  for (int head_dim : {40, 64, 112, 128}) {
    const KernelSpec ordered = detail::select_backward_kernel(backward(head_dim, {}, /*deterministic=*/true), kH200);
    CHECK(ordered.family == Family::sm90_bwd);
    CHECK(ordered.ordered_dq);
    CHECK(kernel_layout(ordered).constant("kDqWriters") == 1);
    CHECK_FALSE(detail::select_backward_kernel(backward(head_dim), kH200).ordered_dq);  // atomic: the plain kernel
  }
  for (int head_dim : {96, 160, 256}) {
    const KernelSpec ordered = detail::select_backward_kernel(backward(head_dim, {}, true), kH200);
    CHECK(ordered.family == Family::sm90_bwd);
    CHECK(ordered.ordered_dq);
  }
  detail::BackwardProblem odd_dout = backward(128);
  odd_dout.params.do_row_stride = 12;
  CHECK(detail::select_backward_kernel(odd_dout, kH200).family == Family::fa2_bwd);

  AttentionOptions fa2;
  fa2.backend = Backend::fa2;
  CHECK(detail::select_backward_kernel(backward(128, fa2), kH200).family == Family::fa2_bwd);
  AttentionOptions sm90;
  sm90.backend = Backend::sm90;
  CHECK(detail::select_backward_kernel(backward(128, sm90), kH200).family == Family::sm90_bwd);
  CHECK(detail::select_backward_kernel(backward(128, sm90, true), kH200).family == Family::sm90_bwd);
  // Every head dim, rounded up to the forward's kernel head dims (64, 96, 128, 192, 256).
  for (auto [head_dim, kernel_head_dim] : {std::pair{8, 64}, {32, 64}, {72, 96}, {96, 96}, {136, 192}, {160, 192},
                                           {192, 192}, {224, 256}}) {
    INFO("head dim " << head_dim);
    const KernelSpec s = detail::select_backward_kernel(backward(head_dim, sm90), kH200);
    CHECK(s.family == Family::sm90_bwd);
    CHECK(s.head_dim == kernel_head_dim);
    CHECK(s.block_n == (kernel_head_dim > 128 ? 64 : 128));  // split by head dim above 128
    CHECK(dynamic_smem_bytes(s) <= kH200.max_smem_per_block_optin);
  }
  // Deterministic mode at every head dim: the writer warp orders the adds where it is (up to 128),
  // the consumers elsewhere (192, 256).
  for (auto [head_dim, writers] : {std::pair{72, 1}, {96, 1}, {112, 1}, {160, 0}, {192, 0}, {224, 0}, {256, 0}}) {
    const KernelSpec ordered = detail::select_backward_kernel(backward(head_dim, sm90, true), kH200);
    CHECK(ordered.family == Family::sm90_bwd);
    CHECK(ordered.ordered_dq);
    CHECK(kernel_layout(ordered).constant("kDqWriters") == writers);
  }
  CHECK_THROWS_WITH(detail::select_backward_kernel(backward(128, sm90), kA100),
                    Catch::Contains("needs an sm_90 device"));
  odd_dout.forward.backend = Backend::sm90;
  CHECK_THROWS_WITH(detail::select_backward_kernel(odd_dout, kH200),
                    Catch::Contains("dout: a stride of 12 elements is not a multiple of 16 bytes"));
}

TEST_CASE("backward dispatch: user modifiers and block masks on fa2_bwd and sm90_bwd", "[dispatch]") {
  auto softcap = std::make_shared<AttentionModifier>();
  softcap->score = "return 30.f * tanhf(score / 30.f);";
  const AttentionMod mod{softcap, {}};
  auto backward = [&](int head_dim, Backend backend, bool deterministic = false, bool block_sparse = false) {
    auto q = TensorView::contiguous(arena, ScalarType::bfloat16, {2, 64, 4, head_dim});
    auto lse = TensorView::contiguous(arena, ScalarType::float32, {2, 4, 64});
    AttentionOptions options;
    options.mod = &mod;
    options.backend = backend;
    options.deterministic = deterministic;
    detail::BackwardProblem problem = detail::make_backward_problem(q, q, q, q, q, &lse, q, q, q, nullptr, options);
    problem.forward.block_sparse = block_sparse;  // (the walk's flag is all dispatch reads)
    return problem;
  };
  // sm_80: only fa2_bwd has a backward, automatic or by name.
  for (int head_dim : {64, 128, 256}) {
    const KernelSpec automatic = detail::select_backward_kernel(backward(head_dim, Backend::automatic), kA100);
    CHECK(automatic.family == Family::fa2_bwd);
    CHECK(automatic.modifier != nullptr);
    const KernelSpec s = detail::select_backward_kernel(backward(head_dim, Backend::fa2), kA100);
    INFO(s.name());
    CHECK(s.family == Family::fa2_bwd);
    CHECK(s.modifier != nullptr);
    CHECK_FALSE(s.validate().has_value());
  }
  CHECK(detail::select_backward_kernel(backward(128, Backend::fa2), kA100).block_n == 64);  // (128 keys spilled)
  // sm_90: sm90_bwd, in deterministic mode under a block mask too (its adds ordered by the visits);
  // fa2_bwd by name.
  CHECK(detail::select_backward_kernel(backward(128, Backend::automatic), kH200).family == Family::sm90_bwd);
  const KernelSpec automatic_sparse = detail::select_backward_kernel(backward(128, Backend::automatic, true, true), kH200);
  CHECK(automatic_sparse.family == Family::sm90_bwd);
  CHECK(automatic_sparse.block_sparse);
  CHECK(automatic_sparse.ordered_dq);
  const KernelSpec sparse = detail::select_backward_kernel(backward(128, Backend::fa2, true, true), kH200);
  CHECK(sparse.family == Family::fa2_bwd);
  CHECK(sparse.block_sparse);
  for (int head_dim : {64, 96, 128, 192, 256}) {
    const KernelSpec ordered = detail::select_backward_kernel(backward(head_dim, Backend::sm90, true, true), kH200);
    INFO(ordered.name());
    CHECK(ordered.family == Family::sm90_bwd);
    CHECK(ordered.block_sparse);
    CHECK(ordered.ordered_dq);
    CHECK_FALSE(ordered.validate().has_value());
  }
}

TEST_CASE("backward dispatch: a tuned sm90_bwd entry applies only where sm90_bwd can run", "[dispatch]") {
  // Backward entries are keyed by fa2_bwd; on an H200 the tuner keeps the heuristic's sm90_bwd spec
  // unless an fa2_bwd tile beats it. Layouts TMA cannot read must still get fa2_bwd; deterministic
  // mode takes the tuned tiles with ordered dQ adds.
  auto backward = [](bool deterministic) {
    auto q = TensorView::contiguous(arena, ScalarType::bfloat16, {2, 64, 4, 128});
    auto lse = TensorView::contiguous(arena, ScalarType::float32, {2, 4, 64});
    AttentionOptions options;
    options.deterministic = deterministic;
    return detail::make_backward_problem(q, q, q, q, q, &lse, q, q, q, nullptr, options);
  };
  // Dispatch caches a device's stamp by ordinal: another ordinal keeps this device's apart from the
  // other tests' H200 of different properties.
  DeviceProperties h200 = kH200;
  h200.ordinal = 7;
  const detail::BackwardProblem atomic = backward(false);
  TunedEntry entry;
  entry.device = DeviceStamp::of(h200);
  entry.problem = detail::problem_key(atomic.forward, Family::fa2_bwd);
  entry.spec = detail::select_backward_kernel(atomic, h200);
  REQUIRE(entry.spec.family == Family::sm90_bwd);
  entry.median_ms = 1;
  entry.tuned_at = "2026-11-30T00:00:00Z";
  TuningSources sources;
  sources.add_in_memory(entry);

  CHECK(detail::select_backward_kernel(atomic, h200, &sources) == entry.spec);
  KernelSpec ordered = entry.spec;
  ordered.ordered_dq = true;
  CHECK(detail::select_backward_kernel(backward(true), h200, &sources) == ordered);
  // (Steps of 80 queries, the default here, leave no room for a third stage; the writer warp's buffer
  // fits beside one at 64.)
  REQUIRE(entry.spec.block_m == 80);
  KernelSpec eighty_three_stages = entry.spec;
  eighty_three_stages.num_stages = 3;
  REQUIRE(eighty_three_stages.validate());
  CHECK_THAT(*eighty_three_stages.validate(), Catch::Contains("3 stages leave no room"));
  KernelSpec three_stages = entry.spec;
  three_stages.block_m = 64;
  three_stages.num_stages = 3;
  REQUIRE_FALSE(three_stages.validate().has_value());
  REQUIRE(kernel_layout(three_stages).constant("kDqWriters") == 1);
  TuningSources three_stage_sources;
  entry.spec = three_stages;
  three_stage_sources.add_in_memory(entry);
  CHECK(detail::select_backward_kernel(backward(false), h200, &three_stage_sources) == three_stages);
  KernelSpec ordered_three_stages = three_stages;
  ordered_three_stages.ordered_dq = true;
  CHECK(detail::select_backward_kernel(backward(true), h200, &three_stage_sources) == ordered_three_stages);
  entry.spec = detail::select_backward_kernel(atomic, h200);
  detail::BackwardProblem odd_dout = backward(false);
  odd_dout.params.do_row_stride = 12;
  CHECK(detail::select_backward_kernel(odd_dout, h200, &sources).family == Family::fa2_bwd);
  CHECK(fa2_backward(atomic.forward, h200, &sources).family == Family::fa2_bwd);
  // Forced, deterministic mode runs it with ordered dQ adds (at either depth) and refuses it without;
  // a layout TMA cannot read is an error. Each names why.
  detail::BackwardProblem forced = backward(true);
  forced.forward.forced_kernel = ordered;
  CHECK(detail::select_backward_kernel(forced, h200) == ordered);
  forced.forward.forced_kernel = entry.spec;
  CHECK_THROWS_WITH(detail::select_backward_kernel(forced, h200),
                    Catch::Contains("the options ask for deterministic mode and its dQ adds are unordered (ordered_dq)"));
  detail::BackwardProblem forced_atomic = backward(false);
  forced_atomic.forward.forced_kernel = ordered;
  CHECK_THROWS_WITH(detail::select_backward_kernel(forced_atomic, h200),
                    Catch::Contains("it orders its dQ adds (ordered_dq) and the options are not deterministic"));
  forced.forward.forced_kernel = ordered_three_stages;
  CHECK(detail::select_backward_kernel(forced, h200) == ordered_three_stages);
  odd_dout.forward.forced_kernel = entry.spec;
  CHECK_THROWS_WITH(detail::select_backward_kernel(odd_dout, h200),
                    Catch::Contains("dout: a stride of 12 elements is not a multiple of 16 bytes"));
  forced = backward(false);
  forced.forward.forced_kernel = entry.spec;
  CHECK(detail::select_backward_kernel(forced, h200) == entry.spec);

  // An fa2_bwd entry applies on every path.
  entry.spec = default_spec(Family::fa2_bwd, h200.arch(), DType::bf16, 128, MaskKind::none);
  entry.spec.block_n = 64;
  REQUIRE_FALSE(entry.spec.validate().has_value());
  TuningSources fa2_sources;
  fa2_sources.add_in_memory(entry);
  CHECK(detail::select_backward_kernel(atomic, h200, &fa2_sources) == entry.spec);
  CHECK(detail::select_backward_kernel(backward(true), h200, &fa2_sources) == entry.spec);
}

TEST_CASE("the warm preset's tuned specs: the bundled database's picks of the heuristic's kind", "[dispatch]") {
  // The bundled database holds H200 tunings of the forward (sm90_fwd) and the backward (sm90_bwd)
  // at head dims 64, 128 and 256.
  for (int head_dim : {64, 128, 256})
    for (const KernelSpec& heuristic : {heuristic_forward_spec(kH200.arch(), DType::bf16, head_dim, MaskKind::causal),
                                        heuristic_backward_spec(kH200.arch(), DType::bf16, head_dim, MaskKind::causal)}) {
      INFO(heuristic.name());
      const std::vector<KernelSpec> tuned = bundled_tuned_specs(heuristic);
      REQUIRE_FALSE(tuned.empty());
      for (const KernelSpec& s : tuned) {
        CHECK(s.family == heuristic.family);
        CHECK(s.arch == heuristic.arch);
        CHECK(s.dtype == heuristic.dtype);
        CHECK(s.head_dim == heuristic.head_dim);
        CHECK(s.mask == heuristic.mask);
        CHECK(s.has_softcap == heuristic.has_softcap);
        CHECK_FALSE(s.validate().has_value());
        CHECK(std::count(tuned.begin(), tuned.end(), s) == 1);
      }
    }
  // Nothing was tuned for these: no other arch or dtype.
  CHECK(bundled_tuned_specs(heuristic_forward_spec(kA100.arch(), DType::bf16, 128, MaskKind::none)).empty());
  CHECK(bundled_tuned_specs(heuristic_forward_spec(kH200.arch(), DType::fp16, 128, MaskKind::none)).empty());
  CHECK(bundled_tuned_specs(heuristic_backward_spec(kH200.arch(), DType::fp16, 128, MaskKind::none)).empty());
  CHECK(bundled_tuned_specs(heuristic_backward_spec(kA100.arch(), DType::bf16, 128, MaskKind::none)).empty());
}

// seqused_q/k (VarlenBatch) only where the kernels read it: sm90_fwd and sm90_bwd.
TEST_CASE("dispatch: a varlen batch with seqused runs on the sm_90 families only", "[dispatch]") {
  auto q = TensorView::contiguous(arena, ScalarType::bfloat16, {64, 4, 128});
  static int cu[3] = {0, 32, 64}, used[2] = {16, 32};
  VarlenBatch batch;
  batch.cu_seqlens_q = batch.cu_seqlens_k = TensorView::contiguous(cu, ScalarType::int32, {3});
  batch.seqused_q = batch.seqused_k = TensorView::contiguous(used, ScalarType::int32, {2});
  batch.max_seqlen_q = batch.max_seqlen_k = 32;
  const detail::ForwardProblem p = detail::make_forward_problem(q, q, q, q, nullptr, &batch, {});
  CHECK(p.seqused);
  CHECK(detail::select_forward_kernel(p, kH200).family == Family::sm90_fwd);
  AttentionOptions fa2;
  fa2.backend = Backend::fa2;
  CHECK_THROWS_WITH(detail::select_forward_kernel(detail::make_forward_problem(q, q, q, q, nullptr, &batch, fa2), kA100),
                    Catch::Contains("fa2_fwd does not read seqused_q/seqused_k"));
  batch.seqused_q = batch.seqused_k = TensorView{};
  CHECK_FALSE(detail::make_forward_problem(q, q, q, q, nullptr, &batch, {}).seqused);
}

TEST_CASE("problems over 65535 sequences or heads run as slices that cover them once", "[dispatch]") {
  auto byte_offset = [](const void* p) { return static_cast<const unsigned char*>(p) - arena; };
  struct Case {
    int64_t batch, heads_q, heads_kv;
    size_t slices;
  };
  for (Case c : {Case{70000, 2, 1, 2}, Case{140000, 1, 1, 3}, Case{2, 70000, 10000, 2}, Case{65535, 65535, 65535, 1}}) {
    INFO("batch " << c.batch << " heads " << c.heads_q << "/" << c.heads_kv);
    auto q = TensorView::contiguous(arena, ScalarType::bfloat16, {c.batch, 3, c.heads_q, 64});
    auto k = TensorView::contiguous(arena, ScalarType::bfloat16, {c.batch, 5, c.heads_kv, 64});
    auto lse = TensorView::contiguous(arena, ScalarType::float32, {c.batch, c.heads_q, 3});
    const auto b = detail::make_backward_problem(q, k, k, q, q, &lse, q, k, k, nullptr, AttentionOptions{});
    const auto slices = detail::grid_slices(b.forward);
    CHECK(slices.size() == c.slices);
    CHECK(detail::fits_one_grid(b.forward) == (c.slices == 1));
    // (One slice must be the whole problem; a count per sequence and head would be 17 GB at 65535^2.)
    const bool whole = slices.size() == 1;
    std::vector<int> covered(whole ? 0 : size_t(c.batch) * c.heads_kv, 0);
    const int group = static_cast<int>(c.heads_q / c.heads_kv);
    for (const auto& s : slices) {
      const auto part = detail::slice_problem(b, s);
      const auto& f = part.forward;
      CHECK(detail::fits_one_grid(f));
      CHECK(f.batch == s.batch_count);
      CHECK(f.params.batch == s.batch_count);
      CHECK(f.heads_kv == s.kv_head_count);
      CHECK(f.params.num_heads_q == s.kv_head_count * group);
      const int64_t hq = int64_t(s.kv_head_begin) * group;
      CHECK(byte_offset(f.params.q) == 2 * (s.batch_begin * q.strides[0] + hq * q.strides[2]));
      CHECK(byte_offset(f.params.o) == byte_offset(f.params.q));
      CHECK(byte_offset(f.params.k) == 2 * (s.batch_begin * k.strides[0] + s.kv_head_begin * k.strides[2]));
      CHECK(byte_offset(f.params.lse) == 4 * (s.batch_begin * lse.strides[0] + hq * lse.strides[1]));
      CHECK(part.params.fwd.q == f.params.q);
      CHECK(byte_offset(part.params.dq) == byte_offset(f.params.q));
      CHECK(byte_offset(part.params.dv) == byte_offset(f.params.k));
      CHECK(part.params.workspace_rows == s.batch_count * 3);
      if (whole) {
        CHECK((s.batch_begin == 0 && s.batch_count == c.batch && s.kv_head_begin == 0 && s.kv_head_count == c.heads_kv));
        continue;
      }
      for (int bi = s.batch_begin; bi < s.batch_begin + s.batch_count; ++bi)
        for (int h = s.kv_head_begin; h < s.kv_head_begin + s.kv_head_count; ++h) ++covered[size_t(bi) * c.heads_kv + h];
    }
    CHECK(std::all_of(covered.begin(), covered.end(), [](int n) { return n == 1; }));
  }
  SECTION("a varlen batch moves its lengths, not its rows") {
    auto q = TensorView::contiguous(arena, ScalarType::bfloat16, {64, 2, 64});
    auto cu = TensorView::contiguous(arena, ScalarType::int32, {70001});
    VarlenBatch batch{cu, cu, 1, 1};
    const auto f = detail::make_forward_problem(q, q, q, q, nullptr, &batch, AttentionOptions{});
    const auto slices = detail::grid_slices(f);
    REQUIRE(slices.size() == 2);
    const auto last = detail::slice_problem(f, slices[1]);
    CHECK(last.params.q == f.params.q);
    CHECK(last.params.cu_seqlens_q == f.params.cu_seqlens_q + 65535);
    CHECK(last.batch == 70000 - 65535);
  }
  SECTION("a mod, a block mask or a continuation, indexed by sequence and head, is refused by name") {
    auto q = TensorView::contiguous(arena, ScalarType::bfloat16, {70000, 3, 2, 64});
    const auto plain = detail::make_forward_problem(q, q, q, q, nullptr, nullptr, AttentionOptions{});
    for (int which = 0; which < 2; ++which) {
      auto f = plain;
      (which == 0 ? f.block_sparse : f.continues) = true;
      CHECK_THROWS_WITH(detail::grid_slices(f), Catch::Contains("cannot follow"));
    }
  }
  SECTION("query heads of one KV head beyond the limit are refused by name") {
    auto q = TensorView::contiguous(arena, ScalarType::bfloat16, {1, 1, 70000, 8});
    auto k = TensorView::contiguous(arena, ScalarType::bfloat16, {1, 1, 1, 8});
    const auto f = detail::make_forward_problem(q, k, k, q, nullptr, nullptr, AttentionOptions{});
    CHECK_THROWS_WITH(detail::grid_slices(f), Catch::Contains("70000 query heads share one KV head"));
  }
}

TEST_CASE("empty tensors may have null data; an empty problem is valid", "[dispatch]") {
  for (auto [batch, seqlen_q, seqlen_k, heads] :
       {std::tuple{0, 16, 16, 2}, {2, 0, 16, 2}, {2, 16, 0, 2}, {2, 0, 0, 2}, {2, 16, 16, 0}}) {
    INFO("batch " << batch << " seqlen " << seqlen_q << "/" << seqlen_k << " heads " << heads);
    auto q = TensorView::contiguous(nullptr, ScalarType::bfloat16, {batch, seqlen_q, heads, 64});
    auto k = TensorView::contiguous(nullptr, ScalarType::bfloat16, {batch, seqlen_k, heads, 64});
    auto lse = TensorView::contiguous(nullptr, ScalarType::float32, {batch, heads, seqlen_q});
    // A tensor that has elements keeps its own memory (arena); the empty ones have none.
    if (q.numel() > 0) q.data = arena;
    if (k.numel() > 0) k.data = arena;
    if (lse.numel() > 0) lse.data = arena;
    const auto p = detail::make_backward_problem(q, k, k, q, q, &lse, q, k, k, nullptr, AttentionOptions{});
    // No queries or no keys still leaves gradients to zero (the other side's).
    CHECK(p.forward.is_empty() == (batch == 0 || seqlen_q == 0 || heads == 0));
    CHECK(p.is_empty() == (batch == 0 || heads == 0 || (seqlen_q == 0 && seqlen_k == 0)));
  }
  auto q = TensorView::contiguous(nullptr, ScalarType::bfloat16, {2, 16, 2, 64});
  CHECK_THROWS_WITH(detail::make_forward_problem(q, q, q, q, nullptr, nullptr, AttentionOptions{}),
                    Catch::Contains("q: data pointer is null"));
}

// FP8: sm90_fwd's heuristic tiles (head dim 128: three consumers of 96-key tiles); at head dim 256 a window or a softcap takes 64-key tiles, which
// automatic dispatch leaves to a device run (backend=sm90 runs them).
TEST_CASE("dispatch: FP8 forward tiles, and head dim 256 with a window or softcap behind a device run", "[dispatch]") {
  alignas(16) static unsigned char bf16_out[1 << 16];
  auto fp8_problem = [&](int head_dim, bool window, float softcap, Backend backend) {
    auto q = TensorView::contiguous(arena, ScalarType::float8_e4m3, {2, 64, 4, head_dim});
    auto out = TensorView::contiguous(bf16_out, ScalarType::bfloat16, {2, 64, 4, head_dim});
    AttentionOptions options;
    options.window_left = window ? 16 : -1;
    options.softcap = softcap;
    options.backend = backend;
    return detail::make_forward_problem(q, q, q, out, nullptr, nullptr, options);
  };
  for (int d : {64, 128, 256}) {
    const KernelSpec spec = detail::select_forward_kernel(fp8_problem(d, false, 0.f, Backend::automatic), kH200);
    INFO(spec.name());
    CHECK(spec.family == Family::sm90_fwd);
    CHECK(spec.dtype == DType::e4m3);
    CHECK(spec.block_n == (d == 128 ? 96 : 128));
  }
  CHECK(detail::select_forward_kernel(fp8_problem(128, true, 0.f, Backend::automatic), kH200).block_n == 128);
  for (auto [window, softcap] : {std::pair{true, 0.f}, {false, 30.f}}) {
    // (64-key tiles: 128 keys leave no registers for them; their GPU tests passed at stop 57.)
    for (Backend backend : {Backend::automatic, Backend::sm90}) {
      const KernelSpec spec = detail::select_forward_kernel(fp8_problem(256, window, softcap, backend), kH200);
      CHECK(spec.block_n == 64);
      CHECK_FALSE(spec.validate().has_value());
    }
  }
}
