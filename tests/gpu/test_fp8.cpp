// The FP8 (e4m3) forward on sm_90 (sm90_fwd with e4m3 q, k, v and descales per batch and KV head,
// bf16 out) against float64 attention of the dequantised inputs: every tile shape it takes (the
// V transpose and P's key order change with block_n, the consumer count with block_m), causal,
// window, softcap and GQA. Inputs are quantised per (batch, KV head) with scale amax / 448, and the
// heads' magnitudes differ, so a descale applied to the wrong head or batch fails.
#include <catch2/catch.hpp>

#include "support/fp8_case.hpp"

using namespace flashjit;
using namespace flashjit::test;

namespace {

// sm90_fwd's FP8 tiles: head dim, query rows (two or three consumers), keys and stages.
struct Tiles {
  int d, block_m, block_n, stages;
};

// Each tile's spec (the default FP8 spec for its head dim and mask with its tile fields replaced,
// and V transposed beforehand or in shared memory), full and causal, against float64 on 333 query
// rows and 590 keys (which end inside a group of 16 keys and inside a 64-key chunk), GQA 2.
void check_tiles(std::initializer_list<Tiles> tiles, bool v_pretransposed, uint64_t seed) {
  for (Tiles t : tiles)
    for (MaskKind mask : {MaskKind::none, MaskKind::causal}) {
      AttentionShape shape = AttentionShape::make(2, 333, 590, 4, 2, t.d);
      shape.causal = mask == MaskKind::causal;
      KernelSpec spec = default_spec(Family::sm90_fwd, device_properties(0).arch(), DType::e4m3, t.d, mask);
      spec.block_m = t.block_m;
      spec.block_n = t.block_n;
      spec.num_warps = 4 * (1 + t.block_m / 64);
      spec.num_stages = t.stages;
      spec.v_pretransposed = v_pretransposed;
      REQUIRE_FALSE(spec.validate().has_value());
      AttentionOptions options;
      options.causal = shape.causal;
      options.kernel = spec;
      INFO(spec.name());
      Fp8Case(shape, seed++).run_and_check(options);
    }
}

}  // namespace

TEST_CASE("fp8: every FP8 tile shape of sm90_fwd, full and causal, GQA, against float64", "[forward][sm90][fp8]") {
  if (!hopper_or_skip("FP8 attention runs on sm_90")) return;
  // The defaults (d64 m192n128, d128 m192n96, d256 m128n128), and the key tiles that are not whole
  // 128-key Vt panels, the widest the registers admit, three consumers and three stages.
  check_tiles({{64, 192, 128, 2}, {64, 128, 256, 2}, {64, 128, 192, 2}, {64, 128, 64, 3}, {64, 192, 96, 2},
               {128, 192, 96, 2}, {128, 128, 128, 2}, {128, 128, 192, 2}, {128, 128, 160, 2}, {128, 128, 96, 3},
               {128, 192, 64, 2}, {256, 128, 128, 2}, {256, 128, 96, 2}, {256, 128, 64, 2}},
              /*v_pretransposed=*/false, 8100);
}

// V transposed before the forward (v_pretransposed: the transpose_v entry writes V^T, TMA loads it
// into the Vt ring): the defaults of every head dim, a partly filled 128-key panel, three stages.
TEST_CASE("fp8: V transposed beforehand, every head dim, full and causal, against float64", "[forward][sm90][fp8]") {
  if (!hopper_or_skip("FP8 attention runs on sm_90")) return;
  check_tiles({{64, 192, 128, 2}, {96, 128, 128, 2}, {128, 192, 96, 2}, {128, 128, 128, 3}, {192, 128, 128, 2},
               {256, 128, 128, 2}, {256, 128, 96, 2}},
              /*v_pretransposed=*/true, 8600);
}

// Varlen, both V modes: sequences whose key counts end inside a group of 16, one shorter than 16,
// and one past a 64-key chunk of the transpose pass, packed back to back (so V^T's columns for
// sequence b start 16 b past its first key, rounded down to 16); full and causal, GQA 2.
TEST_CASE("fp8: varlen, V transposed in shared memory and beforehand, against float64", "[forward][sm90][fp8]") {
  if (!hopper_or_skip("FP8 attention runs on sm_90")) return;
  uint64_t seed = 8700;
  for (int d : {64, 128, 256})
    for (bool v_pretransposed : {false, true})
      for (MaskKind mask : {MaskKind::none, MaskKind::causal}) {
        AttentionShape shape = AttentionShape::make(3, 0, 0, 4, 2, d);
        shape.seqlens_q = {37, 300, 129};
        shape.seqlens_k = {53, 333, 9};
        shape.causal = mask == MaskKind::causal;
        KernelSpec spec = default_spec(Family::sm90_fwd, device_properties(0).arch(), DType::e4m3, d, mask);
        spec.v_pretransposed = v_pretransposed;
        AttentionOptions options;
        options.causal = shape.causal;
        options.kernel = spec;
        INFO(spec.name() << " varlen");
        Fp8Case(shape, seed++).run_and_check(options);
      }
}

namespace {

// The heuristic's FP8 kernels at head dim `d` on a window (GQA 8), a softcap (two batches) and one causal
// row against 700 keys (decode-like, bottom-right).
void check_dispatched_masks(int d, uint64_t seed) {
  AttentionShape window = AttentionShape::make(1, 300, 300, 8, 1, d);
  window.window_left = 37;
  window.window_right = 5;
  AttentionShape softcap = AttentionShape::make(2, 129, 257, 4, 4, d);
  softcap.softcap = 3.f;
  AttentionShape causal = AttentionShape::make(1, 1, 700, 2, 1, d);
  causal.causal = true;
  for (const AttentionShape& shape : {window, softcap, causal}) {
    AttentionOptions options;
    options.backend = Backend::sm90;  // (the only FP8 family)
    options.causal = shape.causal;
    options.window_left = shape.window_left;
    options.window_right = shape.window_right;
    options.softcap = shape.softcap;
    INFO("d " << d << " window " << shape.window_left << "," << shape.window_right << " softcap " << shape.softcap
              << " causal " << shape.causal);
    Fp8Case(shape, seed++).run_and_check(options);
  }
}

}  // namespace

TEST_CASE("fp8: window, softcap, GQA 8 and one row by dispatch, head dim 128", "[forward][sm90][fp8][quick]") {
  if (!hopper_or_skip("FP8 attention runs on sm_90")) return;
  check_dispatched_masks(128, 8200);
}

TEST_CASE("fp8: window, softcap, GQA 8 and one row by dispatch, head dims 64 and 256 (64-key tiles there)",
          "[forward][sm90][fp8]") {
  if (!hopper_or_skip("FP8 attention runs on sm_90")) return;
  check_dispatched_masks(64, 8300);
  check_dispatched_masks(256, 8400);
}
