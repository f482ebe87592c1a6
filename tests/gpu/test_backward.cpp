// The backward families: dq, dk, dv against the float64 reference gradients over the forward's
// awkward-shape set (seqlen pairs, batch 1 and 3, GQA 1/4/8, every head dim, causal, window,
// softcap, varlen with empty and long sequences, strided layouts), forced tile shapes, and
// deterministic reruns. Every case runs fa2_bwd, and on sm_90 devices sm90_bwd too (backend=sm90:
// every head dim, rounded up to 64, 96, 128, 192 or 256, also where automatic dispatch does not pick
// it yet).
#include <catch2/catch.hpp>
#include <algorithm>
#include <utility>

#include "support/backward_case.hpp"

using namespace flashjit;
using namespace flashjit::test;

namespace {

struct Run {
  AttentionShape shape;
  DType dtype = DType::bf16;
  Layout layout = Layout::bshd;
  bool deterministic = false;
  std::optional<KernelSpec> kernel;
};

// The backends a case runs on: fa2_bwd always; sm90_bwd on sm_90 at every head dim, deterministic
// mode included (up to 128 its dQ writer warp orders the adds, above its consumers do).
std::vector<Backend> backward_backends(const Run& r) {
  const bool hopper = device_properties(0).arch().name() == "sm_90a";
  if (hopper && !r.kernel) return {Backend::fa2, Backend::sm90};
  return {Backend::fa2};
}

void check(const Run& r, uint64_t seed) {
  BackwardCase c(r.shape, r.dtype, seed, r.layout);
  for (Backend backend : backward_backends(r)) {
    AttentionOptions options;
    options.deterministic = r.deterministic;
    options.kernel = r.kernel;
    options.backend = backend;
    c.run(test_runtime(), options);
    INFO(c.describe() << (r.deterministic ? " deterministic" : "")
                      << (r.kernel ? " kernel " + r.kernel->name()
                                   : std::string(backend == Backend::sm90 ? " sm90_bwd" : " fa2_bwd")));
    const GradientComparison g = c.check(tensor_core_gradient_tolerance(r.dtype));
    for (auto [name, cmp] : {std::pair{"forward out", &g.forward_out}, {"dq", &g.dq}, {"dk", &g.dk}, {"dv", &g.dv}}) {
      INFO(name << ": " << cmp->bad << " of " << cmp->checked << " outside tolerance; first " << cmp->first_bad
                << "; max abs error " << cmp->max_abs);
      CHECK(cmp->ok());
    }
  }
}

}  // namespace

TEST_CASE("backward: every head dim, kernel or rounded up", "[backward]") {
  uint64_t seed = 11000;
  for (int d : {8, 32, 40, 64, 96, 128, 160, 192, 224, 256})
    for (bool causal : {false, true}) {
      Run r;
      r.shape = AttentionShape::make(3, 113, 203, 4, 2, d);
      r.shape.causal = causal;
      r.dtype = d % 16 == 0 ? DType::bf16 : DType::fp16;
      check(r, seed++);
    }
}

TEST_CASE("backward: awkward seqlen pairs, batch 1 and 3, GQA 1/4/8", "[backward]") {
  const std::pair<int, int> pairs[] = {{1, 1}, {1, 4096}, {239, 1}, {113, 203}, {1023, 1024}};
  uint64_t seed = 12000;
  for (auto [sq, sk] : pairs)
    for (int group : {1, 4, 8})
      for (bool causal : {false, true}) {
        Run r;
        const bool large = sq > 1000;
        r.shape = AttentionShape::make(group == 4 || large ? 1 : 3, sq, sk, 8, 8 / group, large ? 64 : 128);
        r.shape.causal = causal;
        check(r, seed++);
      }
}

TEST_CASE("backward: 4224 x 4224", "[backward]") {
  uint64_t seed = 13000;
  for (bool causal : {false, true}) {
    Run r;
    r.shape = AttentionShape::make(1, 4224, 4224, 1, 1, 64);
    r.shape.causal = causal;
    check(r, seed++);
  }
}

TEST_CASE("backward: sliding windows and softcap", "[backward]") {
  uint64_t seed = 14000;
  struct Window {
    int left, right;
    bool causal;
  };
  for (Window w : {Window{0, 0, false}, Window{16, -1, false}, Window{-1, 7, false}, Window{100, 50, false},
                   Window{64, 0, true}, Window{1000, 1000, false}})
    for (float softcap : {0.f, 30.f, 2.f}) {
      Run r;
      r.shape = AttentionShape::make(2, 157, 301, 4, 2, 64);
      r.shape.window_left = w.left;
      r.shape.window_right = w.right;
      r.shape.causal = w.causal;
      r.shape.softcap = softcap;
      check(r, seed++);
    }
}

TEST_CASE("backward: head dims 192 and 256 with GQA, windows, softcap and varlen", "[backward]") {
  // sm90_bwd splits the head dim between its consumers here, a path of its own (see sm90_bwd.cuh);
  // at 192 the tiles' fourth panel is never loaded.
  uint64_t seed = 14500;
  struct Case {
    int left, right;
    bool causal;
    float softcap;
  };
  for (int head_dim : {192, 256}) {
    for (Case w : {Case{-1, -1, false, 0.f}, Case{-1, -1, true, 30.f}, Case{100, 50, false, 0.f}, Case{64, 0, true, 2.f}}) {
      Run r;
      r.shape = AttentionShape::make(2, 157, 301, 8, 2, head_dim);
      r.shape.window_left = w.left;
      r.shape.window_right = w.right;
      r.shape.causal = w.causal;
      r.shape.softcap = w.softcap;
      check(r, seed++);
    }
    for (bool causal : {false, true}) {
      Run r;
      r.shape = AttentionShape::make(4, 0, 0, 2, 1, head_dim);
      r.shape.seqlens_q = {0, 1, 200, 77};
      r.shape.seqlens_k = {5, 1, 333, 0};
      r.shape.causal = causal;
      check(r, seed++);
    }
  }
}

TEST_CASE("backward: varlen with empty, single and long sequences", "[backward]") {
  uint64_t seed = 15000;
  for (bool causal : {false, true})
    for (bool deterministic : {false, true}) {
      Run r;
      r.shape = AttentionShape::make(5, 0, 0, 4, 2, 128);
      r.shape.seqlens_q = {0, 1, 2049, 77, 300};
      r.shape.seqlens_k = {5, 1, 2049, 0, 129};
      r.shape.causal = causal;
      r.deterministic = deterministic;
      check(r, seed++);
    }
}

TEST_CASE("backward: BHSD strides, fp16, custom scale", "[backward]") {
  uint64_t seed = 16000;
  for (DType dtype : {DType::fp16, DType::bf16}) {
    Run r;
    r.shape = AttentionShape::make(2, 130, 250, 8, 2, 128);
    r.shape.causal = true;
    r.shape.scale = 0.3;
    r.dtype = dtype;
    r.layout = Layout::bhsd;
    check(r, seed++);
  }
}

TEST_CASE("backward: padded rows, packed QKV, and varlen head-major", "[backward]") {
  uint64_t seed = 16500;
  for (Layout layout : {Layout::bshd_padded, Layout::packed_qkv})
    for (bool causal : {false, true}) {
      Run r;
      r.shape = AttentionShape::make(2, 260, 260, 4, 2, causal ? 64 : 128);
      r.shape.causal = causal;
      r.layout = layout;
      check(r, seed++);
    }
  for (bool causal : {false, true}) {
    Run r;
    r.shape = AttentionShape::make(3, 0, 0, 4, 2, 128);
    r.shape.seqlens_q = {1, 300, 37};
    r.shape.seqlens_k = {9, 300, 150};
    r.shape.causal = causal;
    r.layout = Layout::bhsd;
    check(r, seed++);
  }
}

TEST_CASE("fa2_bwd: forced tile shapes", "[backward]") {
  const Arch arch = device_properties(0).arch();
  uint64_t seed = 17000;
  struct Tiles {
    int d, block_m, block_n, warps, stages;
  };
  for (Tiles t : {Tiles{64, 64, 64, 4, 1}, Tiles{64, 128, 128, 8, 2}, Tiles{128, 64, 64, 4, 2},
                  Tiles{128, 32, 32, 4, 1}, Tiles{128, 64, 128, 8, 1}, Tiles{256, 32, 32, 4, 1},
                  Tiles{256, 64, 64, 8, 1}, Tiles{192, 64, 64, 8, 2}})
    for (bool causal : {false, true}) {
      KernelSpec spec = default_spec(Family::fa2_bwd, arch, DType::bf16, t.d, causal ? MaskKind::causal : MaskKind::none);
      spec.block_m = t.block_m;
      spec.block_n = t.block_n;
      spec.num_warps = t.warps;
      spec.num_stages = t.stages;
      if (auto reason = spec.validate()) {
        CaseLedger::get().skipped(spec.name() + " (" + *reason + ")", "the tile does not fit this arch");
        continue;
      }
      Run r;
      r.shape = AttentionShape::make(2, 200, 333, 4, 1, t.d);
      r.shape.causal = causal;
      r.kernel = spec;
      check(r, seed++);
      r.deterministic = true;
      check(r, seed++);
    }
}

// sm90_bwd's steps of 80 queries (dQ transposed) are the default at head dims 64 to 128 without a
// mask, which the cases above run; the tuner may take them under masks and softcaps too: those here,
// both dQ modes.
TEST_CASE("sm90_bwd: steps of 80 queries under masks and softcaps", "[backward]") {
  const Arch arch = device_properties(0).arch();
  if (arch.name() != "sm_90a") {
    CaseLedger::get().skipped("sm90_bwd steps of 80 queries", "sm90_bwd runs on sm_90 only");
    return;
  }
  uint64_t seed = 17500;
  struct Case {
    int head_dim, left, right;
    bool causal;
    float softcap;
  };
  for (Case k : {Case{128, -1, -1, true, 0.f}, Case{128, 100, 50, false, 0.f}, Case{128, -1, -1, false, 30.f},
                 Case{96, 64, 0, true, 2.f}, Case{96, -1, -1, true, 0.f}, Case{64, -1, -1, true, 0.f},
                 Case{64, 100, 50, false, 30.f}}) {
    const MaskKind mask = k.left >= 0 || k.right >= 0 ? MaskKind::window : k.causal ? MaskKind::causal : MaskKind::none;
    KernelSpec spec = default_spec(Family::sm90_bwd, arch, DType::bf16, k.head_dim, mask, k.softcap > 0);
    spec.block_m = 80;
    REQUIRE_FALSE(spec.validate().has_value());
    Run r;
    r.shape = AttentionShape::make(2, 250, 333, 8, 2, k.head_dim);
    r.shape.window_left = k.left;
    r.shape.window_right = k.right;
    r.shape.causal = k.causal;
    r.shape.softcap = k.softcap;
    r.kernel = spec;
    check(r, seed++);
    r.deterministic = true;
    r.kernel->ordered_dq = true;
    check(r, seed++);
  }
}

// sm90_bwd's steps of 128 queries at head dim 64 (each consumer computes dQ for its half of the
// queries), forced: without a mask and under the masks and softcaps the tuner may take them for,
// fp16, varlen and GQA, both dQ modes.
TEST_CASE("sm90_bwd: steps of 128 queries at head dim 64", "[backward]") {
  const Arch arch = device_properties(0).arch();
  if (arch.name() != "sm_90a") {
    CaseLedger::get().skipped("sm90_bwd steps of 128 queries", "sm90_bwd runs on sm_90 only");
    return;
  }
  uint64_t seed = 17700;
  struct Case {
    int left, right;
    bool causal, varlen;
    float softcap;
    DType dtype;
  };
  for (Case k : {Case{-1, -1, false, false, 0.f, DType::bf16}, Case{-1, -1, true, false, 0.f, DType::bf16},
                 Case{100, 50, false, false, 30.f, DType::bf16}, Case{-1, -1, false, false, 0.f, DType::fp16},
                 Case{-1, -1, false, true, 0.f, DType::bf16}, Case{-1, -1, true, true, 0.f, DType::fp16}}) {
    const MaskKind mask = k.left >= 0 || k.right >= 0 ? MaskKind::window : k.causal ? MaskKind::causal : MaskKind::none;
    KernelSpec spec = default_spec(Family::sm90_bwd, arch, k.dtype, 64, mask, k.softcap > 0);
    spec.block_m = 128;
    REQUIRE_FALSE(spec.validate().has_value());
    Run r;
    r.shape = AttentionShape::make(2, 250, 333, 8, 2, 64);
    if (k.varlen) {
      r.shape = AttentionShape::make(3, 0, 0, 4, 2, 64);
      r.shape.seqlens_q = {1, 300, 137};
      r.shape.seqlens_k = {9, 300, 250};
    }
    r.shape.window_left = k.left;
    r.shape.window_right = k.right;
    r.shape.causal = k.causal;
    r.shape.softcap = k.softcap;
    r.dtype = k.dtype;
    r.kernel = spec;
    check(r, seed++);
    r.deterministic = true;
    r.kernel->ordered_dq = true;
    check(r, seed++);
  }
}

TEST_CASE("backward: every winner of the bundled tuning database", "[backward][bundled]") {
  // The kernels dispatch runs instead of the heuristic's on the GPUs the database was tuned on, each
  // once, atomic and deterministic, in its entry's layout and mask. On uneven short sequences rather
  // than the bucket's length, which the float64 reference of the gradients could not afford at 16k:
  // a tile's edges and steps are what the shape has to reach.
  const Arch arch = device_properties(0).arch();
  uint64_t seed = 19500;
  std::vector<KernelSpec> ran;
  for (const TunedEntry& entry : bundled_tuning_db().entries()) {
    const bool runs_here = !is_forward_family(entry.spec.family) && entry.spec.arch == arch;
    if (!runs_here || std::count(ran.begin(), ran.end(), entry.spec)) continue;
    const TunedProblemCase tuned = tuned_problem_case(entry.problem, 2, 300, 397, /*window_left=*/100);
    Run r{tuned.shape, tuned.dtype, tuned.layout};
    r.kernel = entry.spec;
    INFO(entry.problem.describe());
    check(r, seed++);
    r.deterministic = true;
    r.kernel->ordered_dq = true;
    if (!r.kernel->validate()) check(r, seed++);
    ran.push_back(entry.spec);
  }
  if (ran.empty()) CaseLedger::get().skipped(Catch::getResultCapture().getCurrentTestName(), "no bundled entry for " + arch.name());
}

// Both families' deterministic modes (sm90_bwd's on sm_90 at every head dim):
// correct, and reruns bitwise identical, over GQA, masks whose key tiles visit different query
// blocks (causal with seqlen_q > seqlen_k and the other way round, a window) and varlen.
TEST_CASE("backward: deterministic mode is bitwise reproducible and correct", "[backward]") {
  uint64_t seed = 18000;
  struct Shape {
    int seqlen_q, seqlen_k, group, head_dim;
    MaskKind mask;
  };
  for (Shape s : {Shape{777, 777, 1, 128, MaskKind::none}, Shape{777, 777, 4, 128, MaskKind::causal},
                  Shape{1000, 333, 2, 64, MaskKind::causal}, Shape{333, 1000, 1, 64, MaskKind::causal},
                  Shape{600, 700, 2, 96, MaskKind::causal}, Shape{700, 600, 4, 96, MaskKind::none},
                  // Above 128 the consumers take the turns (no writer warps), also where the head dim
                  // is rounded up (160 in 192).
                  Shape{500, 600, 2, 192, MaskKind::causal}, Shape{600, 500, 1, 256, MaskKind::none},
                  Shape{640, 640, 4, 160, MaskKind::window}, Shape{400, 900, 2, 256, MaskKind::causal},
                  Shape{900, 900, 8, 128, MaskKind::window},
                  // sm90_bwd's add orders (DqAddOrder): 777 keys rotate the walks of 7 key tiles,
                  // 900 those of 8 over 4 query heads' steps, 4300 keys (34 tiles) take launch
                  // order; varlen mixes them per sequence.
                  Shape{500, 900, 4, 128, MaskKind::none}, Shape{700, 4300, 2, 64, MaskKind::none},
                  // Rounded up below 128: the writer warp's TMA adds clip the columns past the head dim.
                  Shape{700, 650, 2, 80, MaskKind::causal}, Shape{650, 700, 1, 40, MaskKind::none},
                  Shape{600, 600, 4, 112, MaskKind::window}})
    for (bool varlen : {false, true}) {
      Run r;
      r.shape = AttentionShape::make(2, s.seqlen_q, s.seqlen_k, 8, 8 / s.group, s.head_dim);
      r.shape.causal = s.mask == MaskKind::causal;
      if (s.mask == MaskKind::window) r.shape.window_left = r.shape.window_right = 200;
      if (varlen) {  // two sequences, the first ending mid query block
        r.shape.seqlens_q = {s.seqlen_q / 3, s.seqlen_q - s.seqlen_q / 3};
        r.shape.seqlens_k = {s.seqlen_k, s.seqlen_k / 2};
      }
      r.deterministic = true;
      BackwardCase c(r.shape, DType::bf16, seed++);
      for (Backend backend : backward_backends(r)) {
        AttentionOptions options;
        options.deterministic = true;
        options.backend = backend;
        c.run(test_runtime(), options);
        INFO(c.describe() << (backend == Backend::sm90 ? " sm90_bwd" : " fa2_bwd") << " deterministic");
        CHECK(c.check(tensor_core_gradient_tolerance(DType::bf16)).ok());
        const std::vector<uint16_t> first = c.gradient_bits();
        for (int rerun = 0; rerun < 3; ++rerun) {
          c.run(test_runtime(), options);
          CHECK(c.gradient_bits() == first);
        }
      }
    }
}

TEST_CASE("backward: one head and an odd row count (workspace alignment)", "[backward][quick]") {
  // heads_q x rows = 37 puts the dQ accumulator right after 148 bytes of row statistics unless the
  // launcher aligns it; its float4 accesses would then fault.
  // Also the smallest case of each sm90_bwd head dim, which the sanitize step of bench/device_run.sh
  // runs under racecheck and synccheck, and a small one with four query steps and two key tiles,
  // so that the shared buffers reused from step to step are checked too; in deterministic mode as
  // well (sm90_bwd's ordered dQ: two key tiles, one waits for the other; the writer warps order the
  // adds up to head dim 128, the consumers above).
  uint64_t seed = 19000;
  for (int head_dim : {64, 96, 128, 192, 256})
    for (bool causal : {false, true})
      for (auto [seqlen_q, seqlen_k] : {std::pair{37, 53}, std::pair{203, 131}}) {
        Run r;
        r.shape = AttentionShape::make(1, seqlen_q, seqlen_k, 1, 1, head_dim);
        r.shape.causal = causal;
        check(r, seed++);
        r.deterministic = true;
        check(r, seed++);
      }
}

TEST_CASE("backward: a cold forward that prepares its backward compiles the backward's kernel beside it",
          "[backward][quick]") {
  uint64_t seed = 19100;
  for (bool deterministic : {false, true}) {
    Runtime runtime(CacheConfig{});  // memory only: each kernel is compiled here
    BackwardCase c(AttentionShape::make(1, 200, 300, 2, 1, 128), DType::bf16, seed++);
    AttentionOptions options;
    options.deterministic = deterministic;  // (which backward the forward prepares)
    options.prepare_backward = true;        // (BackwardCase's forward takes the options too)
    c.run(runtime, options);
    INFO(c.describe() << (deterministic ? " deterministic" : ""));
    CHECK(c.check(tensor_core_gradient_tolerance(DType::bf16)).ok());
    const CacheStats stats = runtime.kernel_cache().stats();
    CHECK(stats.compiles == 2);     // the forward's kernel and the backward's, each once
    CHECK(stats.memory_hits == 1);  // the backward's: it found the kernel the forward started
  }
}
