// The forward families against the float64 reference (and the GPU reference kernel for large
// shapes) over the awkward-shape set: seqlen pairs, batch 1 and 3, GQA 1/4/8, every head dim,
// causal, window, softcap, varlen with empty and long sequences, strided layouts, and bitwise
// reruns. Every case runs fa2_fwd, and on sm_90 devices sm90_fwd too, whose output must also agree
// with fa2_fwd's.
#include <catch2/catch.hpp>

#include <cstring>
#include <limits>

#include "flashjit/tuning.hpp"

#include "support/attention_checks.hpp"

using namespace flashjit;
using namespace flashjit::test;

namespace {

struct Run {
  AttentionShape shape;
  DType dtype = DType::bf16;
  Layout layout = Layout::bshd;
  Oracle oracle = Oracle::cpu_float64;
  std::optional<KernelSpec> kernel;  // forced spec; default: each family's dispatch choice
};

bool on_hopper() { return device_properties(0).arch().name() == "sm_90a"; }

// The families this device runs: fa2_fwd, and sm90_fwd on sm_90.
std::vector<Backend> forward_backends() {
  if (on_hopper()) return {Backend::fa2, Backend::sm90};
  return {Backend::fa2};
}

void check(const Run& r, uint64_t seed) {
  AttentionCase c(r.shape, r.dtype, seed, r.layout, r.oracle);
  const Tolerance tolerance = tensor_core_output_tolerance(r.dtype);
  if (r.kernel) {
    AttentionOptions options;
    options.kernel = r.kernel;
    c.run(test_runtime(), options);
    INFO(c.describe() << " kernel " << r.kernel->name());
    check_against_oracle(c, tolerance, tensor_core_lse_tolerance());
    return;
  }
  std::vector<uint16_t> fa2_output;
  for (Backend backend : forward_backends()) {
    AttentionOptions options;
    options.backend = backend;
    c.run(test_runtime(), options);
    INFO(c.describe() << (backend == Backend::fa2 ? " fa2_fwd" : " sm90_fwd"));
    check_against_oracle(c, tolerance, tensor_core_lse_tolerance());
    if (backend == Backend::fa2) {
      fa2_output = c.output_bits();
    } else {
      const Comparison agreement = c.check_agreement(fa2_output, tolerance);
      INFO("sm90_fwd against fa2_fwd: " << agreement.bad << " of " << agreement.checked << " apart; first "
                                        << agreement.first_bad << "; worst " << agreement.worst_head << " at "
                                        << agreement.worst_head_rms);
      CHECK(agreement.ok());
    }
  }
}

// Runs the case `reruns` more times with `options`: output and LSE must match its last run bit for bit.
void check_bitwise_reruns(AttentionCase& c, const AttentionOptions& options, int reruns) {
  const auto out = c.output_bits();
  const auto lse = c.lse_values();
  for (int i = 0; i < reruns; ++i) {
    c.run(test_runtime(), options);
    CHECK(c.output_bits() == out);
    CHECK(std::memcmp(c.lse_values().data(), lse.data(), lse.size() * 4) == 0);
  }
}

// `family`'s default bf16 spec for head dim `d` and `mask` with its tile fields replaced.
KernelSpec tile_spec(Family family, int d, MaskKind mask, int block_m, int block_n, int warps, int stages) {
  KernelSpec spec = default_spec(family, device_properties(0).arch(), DType::bf16, d, mask);
  spec.block_m = block_m;
  spec.block_n = block_n;
  spec.num_warps = warps;
  spec.num_stages = stages;
  return spec;
}

// The tile-shape tests' case: tile_spec on a shape with tails on both sides and GQA.
std::pair<Run, KernelSpec> tile_case(Family family, int d, MaskKind mask, int block_m, int block_n, int warps,
                                     int stages) {
  Run r;
  r.shape = AttentionShape::make(2, 333, 590, 4, 2, d);
  r.shape.causal = mask == MaskKind::causal;
  const KernelSpec spec = tile_spec(family, d, mask, block_m, block_n, warps, stages);
  r.kernel = spec;
  return {r, spec};
}

// sm90_fwd's `spec` on `shape` against the float64 oracle, then again with one persistent CTA
// (sm_margin), which takes every work tile in turn: its output must equal the many-CTA run's bit
// for bit. No tail splits (they depend on the CTA count).
void check_one_cta_matches(const AttentionShape& shape, const KernelSpec& spec, uint64_t seed) {
  AttentionCase c(shape, DType::bf16, seed);
  AttentionOptions options;
  options.kernel = spec;
  options.num_splits = 1;
  c.run(test_runtime(), options);
  INFO(c.describe() << " kernel " << spec.name());
  check_against_oracle(c, tensor_core_output_tolerance(DType::bf16), tensor_core_lse_tolerance());
  const auto out = c.output_bits();
  options.sm_margin = device_properties(0).sm_count - 1;
  c.run(test_runtime(), options);
  CHECK(c.output_bits() == out);
}

}  // namespace

TEST_CASE("forward: every head dim, kernel or rounded up", "[forward]") {
  uint64_t seed = 1000;
  for (int d : {8, 32, 40, 64, 72, 96, 128, 136, 160, 192, 200, 224, 256})
    for (bool causal : {false, true}) {
      Run r;
      r.shape = AttentionShape::make(3, 113, 203, 8, 2, d);
      r.shape.causal = causal;
      r.dtype = d % 16 == 0 ? DType::bf16 : DType::fp16;
      check(r, seed++);
    }
}

TEST_CASE("forward: awkward seqlen pairs, batch 1 and 3, GQA 1/4/8", "[forward]") {
  const std::pair<int, int> pairs[] = {{1, 1}, {1, 4096}, {239, 1}, {113, 203}, {1023, 1024}};
  uint64_t seed = 2000;
  for (auto [sq, sk] : pairs)
    for (int group : {1, 4, 8})
      for (bool causal : {false, true}) {
        Run r;
        r.shape = AttentionShape::make(group == 4 ? 1 : 3, sq, sk, 8, 8 / group, 128);
        r.shape.causal = causal;
        check(r, seed++);
      }
}

TEST_CASE("forward: 4224 x 4224 against the GPU reference kernel", "[forward]") {
  uint64_t seed = 3000;
  for (int d : {64, 128, 256})
    for (bool causal : {false, true}) {
      Run r;
      r.shape = AttentionShape::make(1, 4224, 4224, 4, 2, d);
      r.shape.causal = causal;
      r.oracle = Oracle::gpu_reference;
      check(r, seed++);
    }
}

TEST_CASE("forward: sliding windows and softcap", "[forward]") {
  uint64_t seed = 4000;
  struct Window {
    int left, right;
    bool causal;
  };
  // Sides past both sequences (300 + 517 rows) bound nothing: the runtime takes them as unbounded, so
  // INT_MAX cannot overflow the kernels' index sums; 800 stays a (non-binding) window.
  constexpr int kHuge = std::numeric_limits<int>::max();
  for (Window w : {Window{0, 0, false}, Window{16, -1, false}, Window{-1, 7, false}, Window{100, 50, false},
                   Window{64, 0, true}, Window{1000, 1000, false}, Window{800, 800, false}, Window{kHuge, 3, false},
                   Window{3, kHuge, false}, Window{kHuge, 0, true}})
    for (float softcap : {0.f, 30.f, 2.f}) {
      Run r;
      r.shape = AttentionShape::make(2, 300, 517, 8, 2, 64);
      r.shape.window_left = w.left;
      r.shape.window_right = w.causal ? -1 : w.right;
      r.shape.causal = w.causal;
      r.shape.softcap = softcap;
      r.dtype = softcap == 2.f ? DType::fp16 : DType::bf16;
      check(r, seed++);
    }
  Run r;  // seqlen_q > seqlen_k under causal: the top rows see nothing (O = 0, LSE = +inf)
  r.shape = AttentionShape::make(1, 400, 130, 4, 4, 96);
  r.shape.causal = true;
  r.shape.softcap = 15.f;
  check(r, seed++);
}

// sm90_fwd's running max is lazy (kLazyRescale in softmax.cuh): it moves only when a key tile's
// max exceeds it by more than 2^8 in exp2 terms, and P may then exceed 1. With N(0, 1) inputs and the
// default scale it hardly moves after a row's first tile; at these scales (score std 5.7 and 23)
// it moves in the middle of rows too.
TEST_CASE("forward: large softmax scales move the running max mid-row", "[forward]") {
  uint64_t seed = 4500;
  for (double scale : {0.5, 2.0})
    for (bool causal : {false, true}) {
      Run r;
      r.shape = AttentionShape::make(2, 260, 1100, 4, 2, 128);
      r.shape.causal = causal;
      r.shape.scale = scale;
      check(r, seed++);
    }
}

TEST_CASE("forward: varlen batches with empty, single and long sequences", "[forward]") {
  uint64_t seed = 5000;
  for (bool causal : {false, true})
    for (int d : {64, 128}) {
      Run r;
      r.shape = AttentionShape::make(6, 0, 0, 8, 2, d);
      r.shape.seqlens_q = {0, 1, 2049, 37, 1, 200};
      r.shape.seqlens_k = {7, 0, 2049, 300, 1, 129};
      r.shape.causal = causal;
      check(r, seed++);
    }
  Run r;
  r.shape = AttentionShape::make(3, 0, 0, 4, 4, 128);
  r.shape.seqlens_q = {2049, 0, 64};
  r.shape.seqlens_k = {2049, 64, 0};
  r.shape.window_left = 100;
  r.shape.window_right = 20;
  check(r, seed++);
}

TEST_CASE("forward: padded rows, packed QKV, and varlen head-major and padded", "[forward][quick]") {
  // Strides other than dense ones: TMA reads them through its descriptors' strides and the bases'
  // offsets (k and v start heads_q x head_dim elements into a packed QKV row).
  uint64_t seed = 6100;
  for (Layout layout : {Layout::bshd_padded, Layout::packed_qkv})
    for (bool causal : {false, true}) {
      Run r;
      r.shape = AttentionShape::make(2, 300, 300, 4, 2, causal ? 64 : 128);
      r.shape.causal = causal;
      r.layout = layout;
      check(r, seed++);
    }
  for (Layout layout : {Layout::bhsd, Layout::bshd_padded})
    for (bool causal : {false, true}) {
      Run r;
      r.shape = AttentionShape::make(4, 0, 0, 4, 2, 128);
      r.shape.seqlens_q = {0, 1, 700, 37};
      r.shape.seqlens_k = {5, 1, 700, 200};
      r.shape.causal = causal;
      r.layout = layout;
      check(r, seed++);
    }
}

TEST_CASE("forward: head-major (BHSD) strides", "[forward][quick]") {
  Run r;
  r.shape = AttentionShape::make(3, 257, 300, 4, 2, 128);
  r.layout = Layout::bhsd;
  check(r, 6000);
  r.shape.causal = true;
  r.shape.head_dim = 64;
  check(r, 6001);
}

TEST_CASE("fa2_fwd: tile shapes, warps and pipeline depths", "[forward]") {
  // The autotuner's candidates must all be right, not only the defaults.
  uint64_t seed = 7000;
  struct Tiles {
    int d, block_m, block_n, warps, stages;
  };
  for (Tiles t : {Tiles{64, 64, 32, 4, 1}, Tiles{64, 128, 128, 8, 3}, Tiles{64, 256, 64, 8, 2},
                  Tiles{128, 64, 64, 4, 3}, Tiles{128, 128, 32, 4, 1}, Tiles{128, 128, 64, 8, 2},
                  Tiles{128, 64, 128, 4, 2}, Tiles{256, 64, 32, 4, 3}, Tiles{256, 128, 64, 8, 1},
                  Tiles{96, 128, 64, 8, 2}, Tiles{160, 64, 64, 4, 2}, Tiles{224, 128, 32, 8, 1}})
    for (MaskKind mask : {MaskKind::none, MaskKind::causal}) {
      const auto [r, spec] = tile_case(Family::fa2_fwd, t.d, mask, t.block_m, t.block_n, t.warps, t.stages);
      if (auto reason = spec.validate()) {
        CaseLedger::get().skipped(spec.name() + " (" + *reason + ")", "the tile does not fit this arch");
        continue;
      }
      check(r, seed++);
    }
}

TEST_CASE("forward: reruns are bitwise identical", "[forward]") {
  AttentionShape s = AttentionShape::make(2, 1000, 1500, 8, 2, 128);
  s.causal = true;
  AttentionCase c(s, DType::bf16, 8000);
  for (Backend backend : forward_backends()) {
    AttentionOptions options;
    options.backend = backend;
    c.run(test_runtime(), options);
    check_bitwise_reruns(c, options, 3);
  }
}

TEST_CASE("forward: a forced kernel that does not fit the problem is refused", "[forward]") {
  AttentionShape s = AttentionShape::make(1, 64, 64, 2, 2, 128);
  AttentionCase c(s, DType::bf16, 9000);
  AttentionOptions options;
  options.kernel = default_spec(Family::fa2_fwd, device_properties(0).arch(), DType::fp16, 128);
  CHECK_THROWS_WITH(c.run(test_runtime(), options), Catch::Contains("dtype fp16 but the tensors are bf16"));
  options.kernel = default_spec(Family::fa2_fwd, device_properties(0).arch(), DType::bf16, 64);
  CHECK_THROWS_WITH(c.run(test_runtime(), options), Catch::Contains("head_dim 64 is smaller than the problem's 128"));
  options.kernel = default_spec(Family::fa2_fwd, device_properties(0).arch(), DType::bf16, 128, MaskKind::causal);
  CHECK_THROWS_WITH(c.run(test_runtime(), options), Catch::Contains("mask causal but the options ask for none"));
}

TEST_CASE("forward: bad cu_seqlens are refused before anything runs", "[forward]") {
  DeviceBuffer q(300 * 4 * 64 * 2), cu_q(4 * 4), cu_k(4 * 4);
  auto qv = TensorView::contiguous(q.get(), ScalarType::bfloat16, {300, 4, 64});
  auto run = [&](std::vector<int> q_offsets, std::vector<int> k_offsets, int max_q, int max_k) {
    cu_q.upload(q_offsets);
    cu_k.upload(k_offsets);
    VarlenBatch batch{TensorView::contiguous(cu_q.get(), ScalarType::int32, {4}),
                      TensorView::contiguous(cu_k.get(), ScalarType::int32, {4}), max_q, max_k};
    test_runtime().forward_varlen(qv, qv, qv, qv, nullptr, batch);
  };
  CHECK_NOTHROW(run({0, 100, 200, 300}, {0, 50, 250, 300}, 100, 200));
  CHECK_THROWS_WITH(run({0, 100, 90, 300}, {0, 50, 250, 300}, 210, 200),
                    Catch::Contains("cu_seqlens_q is not monotone: entry 2 is 90 after 100"));
  CHECK_THROWS_WITH(run({0, 100, 200, 300}, {0, 50, 250, 301}, 100, 200),
                    Catch::Contains("cu_seqlens_k ends at 301, past the 300 packed rows"));
  CHECK_THROWS_WITH(run({0, 100, 200, 300}, {0, 50, 250, 300}, 99, 200),
                    Catch::Contains("cu_seqlens_q: sequence 0 has 100 rows, more than max_seqlen_q = 99"));
  CHECK_THROWS_WITH(run({5, 100, 200, 300}, {0, 50, 250, 300}, 100, 200),
                    Catch::Contains("cu_seqlens_q[0] is 5, expected 0"));
  synchronize();
}

TEST_CASE("sm90_fwd: tile shapes, stages and consumer counts", "[forward][sm90]") {
  if (!hopper_or_skip()) return;
  uint64_t seed = 7500;
  struct Tiles {
    int d, block_m, block_n, stages;
  };
  // Including the widest the register rule admits: d64 m192 n128, d64 m128 n224, d128 n192, d256 n80.
  for (Tiles t : {Tiles{64, 128, 192, 2}, Tiles{64, 192, 64, 3}, Tiles{64, 192, 128, 2}, Tiles{64, 128, 224, 2},
                  Tiles{96, 128, 144, 2}, Tiles{128, 128, 64, 3}, Tiles{128, 128, 160, 2}, Tiles{128, 128, 192, 2},
                  Tiles{192, 128, 80, 2}, Tiles{192, 128, 64, 3}, Tiles{256, 128, 80, 2}})
    for (MaskKind mask : {MaskKind::none, MaskKind::causal}) {
      const auto [r, spec] =
          tile_case(Family::sm90_fwd, t.d, mask, t.block_m, t.block_n, 4 * (1 + t.block_m / 64), t.stages);
      REQUIRE_FALSE(spec.validate().has_value());
      check(r, seed++);
    }
}

TEST_CASE("sm90_fwd: a consumer without rows in the last query block skips it", "[forward][sm90]") {
  if (!hopper_or_skip()) return;
  // 300 query rows: block_m 192's last block leaves its third consumer none (rows 320..383) and
  // block_m 128's its second; with one persistent CTA (sm_margin) it runs every transition between
  // skipped and computed tiles. Head dim 256 is the V-stage output's path.
  struct Tiles {
    int d, block_m, block_n, stages;
  };
  uint64_t seed = 7700;
  for (Tiles t : {Tiles{64, 192, 128, 3}, Tiles{128, 192, 80, 3}, Tiles{128, 128, 128, 2}, Tiles{256, 128, 80, 2}})
    for (MaskKind mask : {MaskKind::none, MaskKind::causal}) {
      AttentionShape shape = AttentionShape::make(2, 300, 590, 4, 2, t.d);
      shape.causal = mask == MaskKind::causal;
      const KernelSpec spec =
          tile_spec(Family::sm90_fwd, t.d, mask, t.block_m, t.block_n, 4 * (1 + t.block_m / 64), t.stages);
      REQUIRE_FALSE(spec.validate().has_value());
      check_one_cta_matches(shape, spec, seed++);
    }
}

TEST_CASE("sm90_fwd: consumers pass over the key blocks right of their own rows", "[forward][sm90]") {
  if (!hopper_or_skip()) return;
  // Under a right band edge a consumer skips the CTA tile's first key blocks that lie right of its
  // own 64 rows' last visible key: at a tile's start, or inside the step that ends the previous
  // tile (up to kStages - 1 of them), else after a drain. Shapes where the diagonal sits at the
  // top (seqlen_q > seqlen_k: rows that see no key), in the middle and at the bottom; causal and a
  // window with a right side; with one persistent CTA (sm_margin) every tile follows another, and
  // its output must equal the many-CTA run's bit for bit. The tiles: skips of one block at three
  // stages (d64 n128) and of two at three (d64 n64: inside the step) and two (d128 n64: drained),
  // two consumers (d128 m128), and one Q slot (d256: every tile drains); windows on those the
  // register rule admits for them.
  struct Tiles {
    int d, block_m, block_n, stages;
  };
  struct Band {
    int seqlen_q, seqlen_k;
    bool causal;
    int left, right;
  };
  uint64_t seed = 7900;
  for (Tiles t : {Tiles{64, 192, 128, 3}, Tiles{64, 192, 64, 3}, Tiles{128, 192, 64, 2}, Tiles{128, 128, 64, 2},
                  Tiles{256, 128, 80, 2}})
    for (Band b : {Band{700, 700, true, -1, -1}, Band{900, 333, true, -1, -1}, Band{333, 900, true, -1, -1},
                   Band{700, 700, false, 150, 70}, Band{640, 500, false, 300, 0}}) {
      AttentionShape shape = AttentionShape::make(2, b.seqlen_q, b.seqlen_k, 4, 2, t.d);
      shape.causal = b.causal;
      shape.window_left = b.left;
      shape.window_right = b.right;
      const MaskKind mask = b.causal ? MaskKind::causal : MaskKind::window;
      const KernelSpec spec =
          tile_spec(Family::sm90_fwd, t.d, mask, t.block_m, t.block_n, 4 * (1 + t.block_m / 64), t.stages);
      if (mask == MaskKind::window && spec.validate().has_value()) continue;  // (windows need more registers)
      REQUIRE_FALSE(spec.validate().has_value());
      check_one_cta_matches(shape, spec, seed++);
    }
}

TEST_CASE("sm90_fwd: sm_margin leaves SMs free and changes nothing else", "[forward][sm90]") {
  if (!hopper_or_skip()) return;
  AttentionShape s = AttentionShape::make(2, 1500, 1500, 8, 2, 128);
  s.causal = true;
  AttentionCase c(s, DType::bf16, 7600);
  AttentionOptions options;
  options.backend = Backend::sm90;
  c.run(test_runtime(), options);
  const auto out = c.output_bits();
  options.sm_margin = device_properties(0).sm_count - 1;  // one persistent CTA does every tile
  c.run(test_runtime(), options);
  CHECK(c.output_bits() == out);
  options.sm_margin = device_properties(0).sm_count;
  CHECK_THROWS_WITH(c.run(test_runtime(), options), Catch::Contains("sm_margin"));
}

TEST_CASE("sm90_fwd: tail splits merge the key shares of the last tiles", "[forward][sm90]") {
  if (!hopper_or_skip()) return;
  // 16 to 48 work tiles, fewer than the CTAs: every tile is split. The merge must not depend on
  // which item finishes last (bitwise reruns). At 400 x 130 causal, the first query blocks see no
  // key at all and the next has fewer key blocks than shares, so some of its items have none.
  uint64_t seed = 7800;
  struct Split {
    int batch, seqlen_q, seqlen_k, d, splits;
    bool causal;
  };
  for (Split t : {Split{2, 333, 1000, 64, 2, false}, Split{2, 333, 1000, 128, 3, false},
                  Split{2, 333, 1000, 256, 4, false}, Split{2, 333, 1000, 128, 4, true},
                  Split{3, 400, 130, 96, 3, true}, Split{1, 1000, 999, 192, 2, false}}) {
    AttentionShape shape = AttentionShape::make(t.batch, t.seqlen_q, t.seqlen_k, 4, 2, t.d);
    shape.causal = t.causal;
    AttentionCase c(shape, DType::bf16, seed++);
    AttentionOptions options;
    options.backend = Backend::sm90;
    options.num_splits = t.splits;
    c.run(test_runtime(), options);
    INFO(c.describe() << " num_splits " << t.splits);
    check_against_oracle(c, tensor_core_output_tolerance(DType::bf16), tensor_core_lse_tolerance());
    check_bitwise_reruns(c, options, 2);
  }
  // The automatic choice where it splits: more tiles than CTAs (176 at block_m 192 and 4k, 44 in
  // the last round, in thirds of 17-18 key blocks), split and not, against the GPU reference kernel.
  AttentionShape shape = AttentionShape::make(1, 4096, 4096, 8, 2, 128);
  AttentionCase c(shape, DType::bf16, seed++, Layout::bshd, Oracle::gpu_reference);
  KernelSpec spec = default_spec(Family::sm90_fwd, device_properties(0).arch(), DType::bf16, 128);
  spec.block_m = 192;
  spec.block_n = 80;
  spec.num_warps = 16;
  spec.num_stages = 3;
  for (int splits : {0, 1}) {
    AttentionOptions options;
    options.kernel = spec;
    options.num_splits = splits;
    c.run(test_runtime(), options);
    INFO(c.describe() << " num_splits " << splits);
    check_against_oracle(c, tensor_core_output_tolerance(DType::bf16), tensor_core_lse_tolerance());
  }
  {  // a negative count is refused
    AttentionOptions options;
    options.num_splits = -1;
    CHECK_THROWS_WITH(c.run(test_runtime(), options), Catch::Contains("num_splits must be >= 0"));
  }
}

TEST_CASE("forward: every winner of the bundled tuning database, on a shape from its bucket", "[forward][bundled]") {
  // The kernels behind the tuned numbers: dispatch runs these instead of the heuristic's on the
  // GPUs the database was tuned on. Each on its bucket's sequence length, in its layout, with the
  // batch reduced to 4 query heads (GQA 2); the float64 reference checks every few rows at 16k.
  const Arch arch = device_properties(0).arch();
  uint64_t seed = 9500;
  int ran = 0;
  for (const TunedEntry& entry : bundled_tuning_db().entries()) {
    if (!is_forward_family(entry.spec.family) || !(entry.spec.arch == arch)) continue;  // (backward: test_backward.cpp)
    const int seqlen = entry.problem.seqlen_bucket;
    const TunedProblemCase tuned = tuned_problem_case(entry.problem, 1, seqlen, seqlen, /*window_left=*/256);
    Run r{tuned.shape, tuned.dtype, tuned.layout};
    r.kernel = entry.spec;
    INFO(entry.problem.describe());
    check(r, seed++);
    ++ran;
  }
  if (ran == 0) CaseLedger::get().skipped(Catch::getResultCapture().getCurrentTestName(), "no bundled entry for " + arch.name());
}
