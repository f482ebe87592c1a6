// The compile path with real NVRTC: a sweep of every family x arch x representative specs (fails
// on spills or a register budget overrun), ptxas report parsing, and compile error messages.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <future>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>

#include "compiler.hpp"
#include "flashjit/dispatch.hpp"
#include "flashjit/error.hpp"
#include "flashjit/kernel_cache.hpp"
#include "flashjit/tuning.hpp"

using namespace flashjit;

namespace {

// Representative specs of each family: every kernel head dim with each mask kind, and with a
// window and a softcap together (the most code). The dtype changes conversions and the MMA's
// operand type, not the shape of the code: bf16 takes every mask, fp16 the most-code variant.
std::vector<KernelSpec> sweep_specs(const Arch& arch) {
  std::vector<KernelSpec> specs;
  for (Family f : all_families())
    for (int d : {32, 64, 96, 128, 160, 192, 224, 256}) {
      if (!family_covers(f, arch, d)) continue;  // e.g. sm90_fwd on sm_80, or head dim 96 there
      for (MaskKind mask : {MaskKind::none, MaskKind::causal, MaskKind::window})
        specs.push_back(default_spec(f, arch, DType::bf16, d, mask, false));
      for (DType t : {DType::fp16, DType::bf16}) specs.push_back(default_spec(f, arch, t, d, MaskKind::window, true));
    }
  // forward_kvcache's dispatch widens the default (decode) tile for longer queries: its taller
  // tiles too, with each mask and with a window and a softcap (the most code is not always the
  // most registers: head dim 256 at 64 x 64 spilled with a window and without a softcap).
  for (int d : {32, 64, 96, 128, 160, 192, 224, 256})
    for (MaskKind mask : {MaskKind::none, MaskKind::causal, MaskKind::window})
      for (bool softcap : {false, true})
        for (const KernelSpec& s : heuristic_kvcache_specs(arch, DType::bf16, d, mask, softcap))
          if (std::find(specs.begin(), specs.end(), s) == specs.end()) specs.push_back(s);
  // User modifiers: a document mask with a side tensor through a block mask (fa2_fwd and sm90_fwd),
  // and a score modifier beside the causal mask; the block mask builder with that mask. (ALiBi
  // beside causal spills 20-24 bytes in fa2_fwd at head dim 256: left out.)
  auto document = std::make_shared<AttentionModifier>();
  document->mask = "return doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx;";
  document->tensors = {{"doc", ModifierTensorType::int32}};
  auto alibi = std::make_shared<AttentionModifier>();
  alibi->score = "return score - slopes[head] * float(q_idx - kv_idx);";
  alibi->tensors = {{"slopes", ModifierTensorType::float32}};
  for (int d : {64, 128, 256})
    if (family_covers(Family::fa2_fwd, arch, d))
      specs.push_back(default_spec(Family::fa2_fwd, arch, DType::bf16, d, MaskKind::none, false, document, true));
  for (int d : {64, 128, 256})
    if (family_covers(Family::sm90_fwd, arch, d)) {
      specs.push_back(default_spec(Family::sm90_fwd, arch, DType::bf16, d, MaskKind::none, false, document, true));
      if (d <= 128) specs.push_back(default_spec(Family::sm90_fwd, arch, DType::bf16, d, MaskKind::causal, false, alibi));
    }
  // The backward (sm90_bwd, and fa2_bwd: sm_80's): the document mask through a block mask, and a
  // score modifier whose gradient is derived (dual numbers); ALiBi beside the causal mask in
  // sm90_bwd. (A score of the indices, as ALiBi's, spills 100-130 bytes in fa2_bwd at head dim 128:
  // left out there.)
  auto softcap = std::make_shared<AttentionModifier>();
  softcap->score = "return 30.f * tanhf(score / 30.f);";
  for (Family family : {Family::sm90_bwd, Family::fa2_bwd})
    for (int d : {64, 128, 256})
      if (family_covers(family, arch, d)) {
        specs.push_back(default_spec(family, arch, DType::bf16, d, MaskKind::none, false, document, true));
        specs.push_back(default_spec(family, arch, DType::bf16, d, MaskKind::none, false, softcap));
        if (family == Family::sm90_bwd)
          specs.push_back(default_spec(family, arch, DType::bf16, d, MaskKind::causal, false, alibi));
      }
  // sm90_bwd's deterministic mode (ordered dQ adds): the writer warp's at 64, 96 and 128, the
  // consumers' at 192 and 256; with each mask (each has its own add order) and a softcap, and the
  // document mask through a block mask (turns counted from the visits: the producer warp counts).
  for (int d : {64, 96, 128, 192, 256})
    if (family_covers(Family::sm90_bwd, arch, d)) {
      for (auto [mask, softcap] : {std::pair{MaskKind::none, false}, std::pair{MaskKind::causal, false},
                                   std::pair{MaskKind::window, true}}) {
        KernelSpec s = default_spec(Family::sm90_bwd, arch, DType::bf16, d, mask, softcap);
        s.ordered_dq = true;
        specs.push_back(s);
      }
      KernelSpec s = default_spec(Family::sm90_bwd, arch, DType::bf16, d, MaskKind::none, false, document, true);
      s.ordered_dq = true;
      specs.push_back(s);
    }
  // sm90_bwd's steps of 80 queries (dQ transposed; the default at 64 to 128 without a mask, taken
  // above in bf16) in fp16, where P^T's own registers keep P for dS^T.
  for (int d : {64, 96, 128})
    if (family_covers(Family::sm90_bwd, arch, d))
      specs.push_back(default_spec(Family::sm90_bwd, arch, DType::fp16, d, MaskKind::none, false));
  // Its steps of 128 queries at head dim 64 (dQ split by queries; a tuner candidate): each mask,
  // fp16 and ordered dQ adds. (A window with a softcap spills 64 bytes: the tuner skips it.)
  if (family_covers(Family::sm90_bwd, arch, 64))
    for (auto [mask, softcap, dtype, ordered] :
         {std::tuple{MaskKind::none, false, DType::bf16, false}, std::tuple{MaskKind::causal, false, DType::bf16, false},
          std::tuple{MaskKind::window, false, DType::bf16, false}, std::tuple{MaskKind::none, false, DType::fp16, false},
          std::tuple{MaskKind::causal, false, DType::bf16, true}}) {
      KernelSpec s = default_spec(Family::sm90_bwd, arch, dtype, 64, mask, softcap);
      s.block_m = 128;
      s.ordered_dq = ordered;
      if (std::find(specs.begin(), specs.end(), s) == specs.end()) specs.push_back(s);
    }
  if (arch.sm == 80 || arch.sm == 90)
    specs.push_back(default_spec(Family::block_mask, arch, DType::bf16, 0, MaskKind::none, false, document));
  // A masked forward that asks for tail splits (num_splits > 1): the split items' merge beside a
  // window and a softcap, the most code.
  for (int d : {64, 96, 128, 192, 256})
    if (family_covers(Family::sm90_fwd, arch, d)) {
      KernelSpec s = default_spec(Family::sm90_fwd, arch, DType::bf16, d, MaskKind::window, true);
      s.tail_splits = true;
      specs.push_back(s);
    }
  // FP8 (e4m3) forwards: every kernel head dim with each mask, a window with a softcap, tail splits
  // (the transposers in the producer warpgroup, P in 8-bit A fragments, the bf16 output; at 256 the
  // window's 64-key tiles), and key tiles that end in a partly filled 128-key Vt panel.
  for (int d : {64, 96, 128, 192, 256})
    if (family_covers(Family::sm90_fwd, arch, d)) {
      for (MaskKind mask : {MaskKind::none, MaskKind::causal, MaskKind::window})
        specs.push_back(default_spec(Family::sm90_fwd, arch, DType::e4m3, d, mask, false));
      KernelSpec s = default_spec(Family::sm90_fwd, arch, DType::e4m3, d, MaskKind::window, true);
      s.tail_splits = true;
      specs.push_back(s);
      KernelSpec partial_panel = default_spec(Family::sm90_fwd, arch, DType::e4m3, d, MaskKind::causal);
      partial_panel.block_m = 128;
      partial_panel.num_warps = 12;
      partial_panel.block_n = d <= 128 ? 192 : 96;
      specs.push_back(partial_panel);
      // V transposed beforehand (the transpose_v entry, TMA into the Vt ring): unmasked (causal at
      // 256, where the unmasked 128 x 128 tile spills 24 bytes, the descale product) and the partly
      // filled panel.
      const MaskKind plain_mask = d == 256 ? MaskKind::causal : MaskKind::none;
      const KernelSpec plain = default_spec(Family::sm90_fwd, arch, DType::e4m3, d, plain_mask);
      for (KernelSpec pretransposed : {plain, partial_panel}) {
        pretransposed.v_pretransposed = true;
        specs.push_back(pretransposed);
      }
    }
  // Ring attention's continuing forward and backward, unmasked and causal (the calls a ring makes),
  // and with a window and a softcap together (the most code).
  for (Family family : {Family::sm90_fwd, Family::sm90_bwd})
    for (int d : {64, 96, 128, 192, 256})
      if (family_covers(family, arch, d))
        for (auto [mask, softcap] : {std::pair{MaskKind::none, false}, std::pair{MaskKind::causal, false},
                                     std::pair{MaskKind::window, true}}) {
          KernelSpec s = default_spec(family, arch, DType::bf16, d, mask, softcap);
          s.continues = true;
          specs.push_back(s);
        }
  return specs;
}

// `arch`'s sweep less the specs whose tiles are sm_80's: sm_86 and sm_89 (99 KB of shared memory)
// take other tiles than sm_80 for some specs only, and where they take the same ones ptxas sees the
// kernel the sm_80 sweep compiles.
std::vector<KernelSpec> specs_with_own_tiles(const Arch& arch) {
  const Arch sm80 = Arch::parse("sm_80");
  const auto on_sm80 = sweep_specs(sm80);
  std::vector<KernelSpec> own;
  for (const KernelSpec& spec : sweep_specs(arch)) {
    KernelSpec as_sm80 = spec;
    as_sm80.arch = sm80;
    if (std::find(on_sm80.begin(), on_sm80.end(), as_sm80) == on_sm80.end()) own.push_back(spec);
  }
  return own;
}

constexpr const char* kSweptArchs[] = {"sm_80", "sm_86", "sm_89", "sm_90a"};

// The bundled tuning database's specs for `arch`: its winners and runner-ups, which dispatch runs
// instead of the heuristic's on the GPUs it was tuned on.
std::vector<KernelSpec> bundled_specs(const Arch& arch) {
  std::vector<KernelSpec> specs;
  for (const auto& entry : bundled_tuning_db().entries()) {
    std::vector<KernelSpec> candidates{entry.spec};
    for (const auto& [spec, ms] : entry.runner_ups) candidates.push_back(spec);
    for (const auto& spec : candidates)
      if (spec.arch == arch && std::find(specs.begin(), specs.end(), spec) == specs.end()) specs.push_back(spec);
  }
  return specs;
}

// Compiles `specs` for `arch`, with the bundled database's specs for that arch; fails on spills, a
// register budget overrun, NVRTC warnings, and ptxas's setmaxnreg and wgmma-serialisation
// warnings. (The HGMMA check of the Hopper kernels' SASS needs a disassembler, which this tier's
// machines lack: it is a GPU test, "sm90 kernels are built on wgmma".)
void check_compiles(const Arch& arch, std::vector<KernelSpec> specs) {
  const auto bundled = bundled_specs(arch);
  for (const auto& spec : bundled)
    if (std::find(specs.begin(), specs.end(), spec) == specs.end()) specs.push_back(spec);
  KernelCache cache(CacheConfig{});  // memory only: this measures NVRTC, not the disk
  std::vector<std::future<std::shared_ptr<const CompiledKernel>>> jobs;
  for (const auto& spec : specs)
    jobs.push_back(std::async(std::launch::async, [&cache, spec] { return cache.get(spec); }));
  double slowest_ms = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    auto kernel = jobs[i].get();
    INFO(specs[i].name() << "\n" << kernel->log);
    CHECK(kernel->cubin.size() > 1000);
    CHECK(kernel->cubin.compare(0, 4, "\x7f" "ELF") == 0);
    REQUIRE(kernel->entries.size() == kernel->entry_names.size());
    CHECK(kernel->log.find(": warning #") == std::string::npos);  // NVRTC's own, shown to FLASHJIT_VERBOSE users
    for (const auto& e : kernel->entries) {
      CHECK(e.registers > 0);
      CHECK(e.spill_store_bytes == 0);
      CHECK(e.spill_load_bytes == 0);
      CHECK(kernel->log.find("C7508") == std::string::npos);  // setmaxnreg ignored by ptxas
      // wgmma serialized (C7512: too few registers; C7515, C7518, C7520: no overlap) or a wait
      // injected by ptxas (C7517)
      for (const char* code : {"C7512", "C7515", "C7517", "C7518", "C7520"})
        CHECK(kernel->log.find(code) == std::string::npos);
      // The register budget __launch_bounds__ implies: 64K registers over threads x min blocks.
      const int budget = std::min(255, 65536 / threads_per_block(specs[i]));
      CHECK(e.registers <= budget);
    }
    slowest_ms = std::max(slowest_ms, kernel->compile_ms);
  }
  WARN(arch.name() << ": " << specs.size() << " specs compiled (" << bundled.size()
                   << " from the bundled tuning database), slowest " << slowest_ms << " ms (all at once on "
                   << std::thread::hardware_concurrency() << " cores)");
}

}  // namespace

// The sweeps are the slow part of the CPU tier (NVRTC, about a thousand kernels); the sanitizer
// tier leaves them out ([sweep]) and compiles the smoke set below instead.
TEST_CASE("compile sweep: sm_80 and sm_90a compile without spills", "[compile][sweep]") {
  for (const char* arch : {"sm_80", "sm_90a"}) check_compiles(Arch::parse(arch), sweep_specs(Arch::parse(arch)));
  // And none of the bundled database's specs targets an arch the sweeps leave out.
  for (const auto& entry : bundled_tuning_db().entries()) {
    INFO(entry.spec.name());
    CHECK(std::count_if(std::begin(kSweptArchs), std::end(kSweptArchs),
                        [&](const char* name) { return entry.spec.arch == Arch::parse(name); }) == 1);
  }
}

TEST_CASE("compile sweep: sm_86 and sm_89 compile without spills where their tiles are not sm_80's",
          "[compile][sweep]") {
  for (const char* arch : {"sm_86", "sm_89"})
    check_compiles(Arch::parse(arch), specs_with_own_tiles(Arch::parse(arch)));
}

// Every family through NVRTC and the ptxas report once, with the most code (window and softcap) at
// its smallest head dim: the host side of compiling, which is what the sanitizer tier checks.
TEST_CASE("compile smoke: every family compiles for sm_90a", "[compile]") {
  const Arch arch = Arch::parse("sm_90a");
  for (Family f : all_families()) {
    // (The block mask builder has no head dim and takes its mask from a modifier alone.)
    const bool builder = f == Family::block_mask;
    const int head_dim = builder ? 0 : *family_kernel_head_dim(f, 1);
    INFO(to_string(f));
    REQUIRE(family_covers(f, arch, head_dim));
    KernelCache cache(CacheConfig{});
    const auto kernel = cache.get(builder ? default_spec(f, arch, DType::bf16, 0)
                                          : default_spec(f, arch, DType::bf16, head_dim, MaskKind::window, true));
    CHECK(kernel->cubin.compare(0, 4, "\x7f" "ELF") == 0);
    REQUIRE(!kernel->entries.empty());
    for (const auto& e : kernel->entries) CHECK((e.registers > 0 && e.spill_store_bytes == 0));
  }
}

// A cold training step's two compiles, one after the other and with the backward's prefetched while
// the forward's compiles (what AttentionOptions::prepare_backward does): both ways give the same
// kernels, each compiled once; the times are reported, not judged (that is a benchmark's place).
TEST_CASE("compile: a prefetched backward compiles beside its forward", "[compile]") {
  const Arch arch = Arch::parse("sm_90a");
  const KernelSpec forward = default_spec(Family::sm90_fwd, arch, DType::bf16, 128, MaskKind::causal);
  const KernelSpec backward = default_spec(Family::sm90_bwd, arch, DType::bf16, 128, MaskKind::causal);
  auto timed = [&](bool prefetch) {
    KernelCache cache(CacheConfig{});
    const auto start = std::chrono::steady_clock::now();
    if (prefetch) cache.prefetch(backward);
    const auto f = cache.get(forward);
    const auto b = cache.get(backward);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    CHECK(cache.stats().compiles == 2);
    CHECK(cache.stats().memory_hits == (prefetch ? 1 : 0));
    return std::tuple{ms, f->cubin, b->cubin};
  };
  const auto [serial_ms, serial_forward, serial_backward] = timed(false);
  const auto [prefetched_ms, forward_cubin, backward_cubin] = timed(true);
  CHECK(forward_cubin == serial_forward);
  CHECK(backward_cubin == serial_backward);
  WARN(forward.name() << " + " << backward.name() << ": one after the other " << serial_ms
                      << " ms, the backward prefetched " << prefetched_ms << " ms (" << std::thread::hardware_concurrency()
                      << " cores)");
}

TEST_CASE("ptxas reports are parsed per entry", "[compile]") {
  const char* log =
      "ptxas info    : 0 bytes gmem\n"
      "ptxas info    : Compiling entry function 'first' for 'sm_90a'\n"
      "ptxas info    : Function properties for first\n"
      "ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
      "ptxas info    : Used 168 registers, used 1 barriers, 4096 bytes smem, 400 bytes cmem[0]\n"
      "ptxas info    : Function properties for helper\n"
      "ptxas         .     99 bytes stack frame, 99 bytes spill stores, 99 bytes spill loads\n"
      "ptxas info    : Compiling entry function 'second' for 'sm_90a'\n"
      "ptxas info    : Function properties for second\n"
      "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Used 40 registers, used 0 barriers, 364 bytes cmem[0]\n"
      "ptxas info    : Compile time = 21.936 ms\n";
  const auto entries = detail::parse_ptxas_stats(log);
  REQUIRE(entries.size() == 2);
  CHECK(entries[0].name == "first");
  CHECK(entries[0].registers == 168);
  CHECK(entries[0].barriers == 1);
  CHECK(entries[0].static_smem_bytes == 4096);
  CHECK(entries[0].stack_frame_bytes == 24);
  CHECK(entries[0].spill_store_bytes == 8);
  CHECK(entries[0].spill_load_bytes == 12);
  CHECK(entries[1].name == "second");
  CHECK(entries[1].registers == 40);
  CHECK(entries[1].static_smem_bytes == 0);
  CHECK(entries[1].spill_store_bytes == 0);  // the helper's line did not leak into it
}

TEST_CASE("a compile error quotes the log and numbered source lines", "[compile]") {
  Source source;
  source.spec_name = "broken_spec";
  source.file_name = "broken_spec.cu";
  source.text =
      "#include \"common/types.cuh\"\n"
      "extern \"C\" __global__ void broken(float* x) {\n"
      "  x[0] = undefined_name;\n"
      "}\n";
  source.entry_names = {"broken"};
  try {
    detail::compile_source(source, Arch::parse("sm_80"));
    FAIL("the broken source compiled");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::compile_failed);
    const std::string message = e.what();
    CHECK_THAT(message, Catch::Contains("broken_spec"));
    CHECK_THAT(message, Catch::Contains("sm_80"));
    CHECK_THAT(message, Catch::Contains("identifier \"undefined_name\" is undefined"));
    CHECK_THAT(message, Catch::Contains(">     3 |   x[0] = undefined_name;"));
    CHECK_THAT(message, Catch::Contains("      2 | extern \"C\""));
  }
}

TEST_CASE("NVRTC knows the archs flashjit targets", "[compile]") {
  CHECK(nvrtc_supports(Arch::parse("sm_80")));
  CHECK(nvrtc_supports(Arch::parse("sm_90a")));
  CHECK_FALSE(nvrtc_supports(Arch::parse("sm_51")));
  CHECK(nvrtc_version().find('.') != std::string::npos);
}
