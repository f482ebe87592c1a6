// The online softmax of the FlashAttention forward families, over accumulators in the C layout of
// mma.sync m16n8 tiles (which is also wgmma's accumulator layout, warp by warp). A Shape provides
// kMFrags (m16 tiles of rows per warp), kSFrags (n8 tiles of keys) and kOFrags (n8 tiles of O).
#pragma once

#include "common/mask.cuh"
#include "common/mma_sm80.cuh"

namespace flashjit::kernels {

// The running statistics of a thread's rows (g and g + 8 of each m16 tile). O, which they scale,
// stays with the caller: a plain array is what mma.sync and wgmma accumulate into.
template <class Shape>
struct RowStatistics {
  float row_max[Shape::kMFrags][2];  // raw score units (softcapped if softcap); maybe lazy, see kLazyRescale
  float row_sum[Shape::kMFrags][2];  // this thread's columns only; quad-reduced at the end

  __device__ __forceinline__ void reset() {
#pragma unroll
    for (int mi = 0; mi < Shape::kMFrags; ++mi) {
      row_max[mi][0] = row_max[mi][1] = -positive_infinity();
      row_sum[mi][0] = row_sum[mi][1] = 0.f;
    }
  }
};

// A row's total over the quad of lanes that hold its columns.
__device__ __forceinline__ float quad_sum(float value) {
  value += __shfl_xor_sync(0xffffffffu, value, 1);
  return value + __shfl_xor_sync(0xffffffffu, value, 2);
}

// A finished row's logsumexp of the scaled scores, from its running max (raw score units; with
// final scores, a softcap's or a score modifier's, which include the scale) and quad-reduced sum.
// A row that saw no key gets +inf (flash-attn's convention), or -inf with kEmptyRowNegative
// (FlexAttention's, for user masks and block masks: the log of an empty sum).
template <bool kFinalScores, bool kEmptyRowNegative = false>
__device__ __forceinline__ float row_logsumexp(const AttentionFwdParams& p, float row_max, float sum) {
  const float max_natural = kFinalScores ? row_max : row_max * p.softmax_scale;
  return sum > 0.f ? max_natural + logf(sum) : kEmptyRowNegative ? -positive_infinity() : positive_infinity();
}

// Online softmax over one tile, in two halves so that a caller can run the first while an
// asynchronous GEMM still accumulates into O (the Hopper family's intra-warpgroup overlap):
//   softmax_scores: new running max and sums, S becomes P (fp32); returns the factors O must be
//     scaled by, and whether any row of the warp moved its max (else they are all 1);
//   rescale_output: applies them.
// Lazy rescaling (kLazyRescale, sm90_fwd): a row's running max moves only when a tile's max exceeds
// it by more than kRescaleThreshold (log2 units), so P = exp2(s - max) may reach 2^8: fine for
// fp16/bf16 P and fp32 sums. O, the sum and the LSE all refer to the same (stale) max, so the
// result is unchanged. With the exact max, a warp's 16 rows kept finding new maxima and most steps
// rescaled O; lazily, a row's max settles in its first tile. When no row of the warp moves, the O
// rescale (kOFrags * 4 multiplies per row pair) is skipped with one warp vote. (fa2_fwd keeps the
// exact max: at head dim 256 with softcap its 255 registers spill with the lazy test.)
// kProbabilityLog2Offset (FP8's P): P = exp2(s - max + offset), so that P, which wgmma reads in
// e4m3 (largest 448, subnormal below 2^-6), keeps the precision of small probabilities; the lazy
// threshold shrinks by as much, so P stays within 2^8. O, the sums and the LSE (the caller
// subtracts the offset) carry the factor alike.
constexpr float kRescaleThreshold = 8.f;
template <class Shape>
struct OutputRescale {
  float factor[Shape::kMFrags][2];
  bool any_moved;
};

template <class Shape, bool kLazyRescale = false, int kProbabilityLog2Offset = 0>
__device__ __forceinline__ OutputRescale<Shape> softmax_scores(RowStatistics<Shape>& st,
                                                               float (&s)[Shape::kMFrags][Shape::kSFrags][4],
                                                               float scale_log2) {
  OutputRescale<Shape> rescale;
  bool max_moved = false;
#pragma unroll
  for (int mi = 0; mi < Shape::kMFrags; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the thread's two rows: g and g + 8
      float tile_max = st.row_max[mi][h];
#pragma unroll
      for (int ni = 0; ni < Shape::kSFrags; ++ni)
        tile_max = fmaxf(tile_max, fmaxf(s[mi][ni][2 * h], s[mi][ni][2 * h + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      // Lazily, from -inf any visible key moves it (the difference would be NaN when both are -inf).
      const bool moves = !kLazyRescale ? tile_max != st.row_max[mi][h]
                         : st.row_max[mi][h] == -positive_infinity()
                             ? tile_max != -positive_infinity()
                             : (tile_max - st.row_max[mi][h]) * scale_log2 > kRescaleThreshold - kProbabilityLog2Offset;
      const float row_max = kLazyRescale && !moves ? st.row_max[mi][h] : tile_max;
      // A row with no visible key so far keeps max -inf; subtracting 0 then keeps exp2 at 0.
      const float max_scaled = row_max == -positive_infinity() ? 0.f : row_max * scale_log2;
      max_moved = max_moved || moves;
      rescale.factor[mi][h] = exp2_approx(st.row_max[mi][h] * scale_log2 - max_scaled);
      st.row_max[mi][h] = row_max;
      float sum = 0.f;
      const float shift = kProbabilityLog2Offset == 0 ? -max_scaled : kProbabilityLog2Offset - max_scaled;
#pragma unroll
      for (int ni = 0; ni < Shape::kSFrags; ++ni)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          s[mi][ni][e] = exp2_approx(fmaf(s[mi][ni][e], scale_log2, shift));
          sum += s[mi][ni][e];
        }
      st.row_sum[mi][h] = fmaf(st.row_sum[mi][h], rescale.factor[mi][h], sum);
    }
  rescale.any_moved = __any_sync(0xffffffffu, max_moved);
  return rescale;
}

template <class Shape>
__device__ __forceinline__ void rescale_output(float (&o)[Shape::kMFrags][Shape::kOFrags][4],
                                               const OutputRescale<Shape>& rescale) {
  if (!rescale.any_moved) return;
#pragma unroll
  for (int mi = 0; mi < Shape::kMFrags; ++mi)
#pragma unroll
    for (int nd = 0; nd < Shape::kOFrags; ++nd)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mi][nd][e] *= rescale.factor[mi][e / 2];
}

// The same for a warp of one m16 tile whose O is flat, as the wgmma wrappers take it: element i is
// element i % 4 of n8 tile i / 4, in row half (i % 4) / 2.
template <class Shape>
__device__ __forceinline__ void rescale_output(float (&o)[Shape::kOFrags * 4], const OutputRescale<Shape>& rescale) {
  static_assert(Shape::kMFrags == 1, "a flat O holds one m16 tile");
  if (!rescale.any_moved) return;
#pragma unroll
  for (int i = 0; i < Shape::kOFrags * 4; ++i) o[i] *= rescale.factor[0][(i % 4) / 2];
}

// The logsumexp merge of two partial results over disjoint key sets (a continuing forward's step
// and its running state): the combined LSE and each part's weight exp(lse_part - lse), by which its
// normalised O is scaled. An empty part (LSE -inf) weighs 0; two make an empty result.
struct LseMerge {
  float lse, weight_a, weight_b;
};
__device__ __forceinline__ LseMerge merge_logsumexp(float lse_a, float lse_b) {
  const float high = fmaxf(lse_a, lse_b);
  if (high == -positive_infinity()) return {high, 0.f, 0.f};
  const float a = expf(lse_a - high), b = expf(lse_b - high), total = a + b;
  return {high + logf(total), a / total, b / total};
}

template <class Shape>
__device__ __forceinline__ void online_softmax(RowStatistics<Shape>& st, float (&o)[Shape::kMFrags][Shape::kOFrags][4],
                                               float (&s)[Shape::kMFrags][Shape::kSFrags][4], float scale_log2) {
  rescale_output<Shape>(o, softmax_scores(st, s, scale_log2));
}

}  // namespace flashjit::kernels
