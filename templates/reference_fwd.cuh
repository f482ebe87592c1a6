// Reference forward attention: the GPU oracle for shapes too large for the CPU reference.
//   Algorithm: for one query row, stream the visible keys 32 at a time (one key per lane), score
//   them in fp32, keep a running max and sum (online softmax, natural base), and accumulate P.V in
//   fp32; divide by the sum at the end. Rows that see no key get O = 0 and LSE = +inf.
//   Grid: (ceil(seqlen_q / kBlockM), heads_q, batch); one warp per query row, kBlockM == kNumWarps.
//   Shared memory: the query rows in fp32, kNumWarps * kHeadDim * 4 bytes, static.
//   Preconditions: kHeadDim a multiple of 32 and >= head_dim; last dims contiguous.
// Accuracy over speed: no approximate exp, fp32 accumulation in plain FMA order.
#pragma once

#include "common/mask.cuh"

namespace flashjit::kernels {

template <class Config>
__device__ void reference_fwd_kernel(const AttentionFwdParams& p) {
  using Element = typename Config::Element;
  constexpr int kHeadDim = Config::kHeadDim;
  constexpr int kDimsPerLane = kHeadDim / 32;
  static_assert(kHeadDim % 32 == 0, "reference_fwd spreads head_dim over 32 lanes");
  static_assert(Config::kBlockM == Config::kNumWarps, "one query row per warp");

  __shared__ float sQ[Config::kNumWarps][kHeadDim];  // (kNumWarps, kHeadDim)

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const SequenceExtent seq = sequence_extent(p, batch);
  const int row = blockIdx.x * Config::kBlockM + warp;
  if (row >= seq.seqlen_q) return;  // no block-wide barrier below, so a warp may leave early
  const int kv_head = head / (p.num_heads_q / p.num_heads_kv);

  const Element* gQ = static_cast<const Element*>(p.q) + seq.q_batch_offset +
                      (seq.q_start + row) * p.q_row_stride + head * p.q_head_stride;  // (kHeadDim)
  const Element* gK = static_cast<const Element*>(p.k) + seq.k_batch_offset +
                      seq.k_start * p.k_row_stride + kv_head * p.k_head_stride;  // (seqlen_k, kHeadDim)
  const Element* gV = static_cast<const Element*>(p.v) + seq.v_batch_offset +
                      seq.k_start * p.v_row_stride + kv_head * p.v_head_stride;  // (seqlen_k, kHeadDim)

  for (int d = lane; d < kHeadDim; d += 32) sQ[warp][d] = d < p.head_dim ? to_float(gQ[d]) : 0.f;
  __syncwarp();

  const KeyRange keys = AttentionMask<Config::kMask>(p, seq.seqlen_q, seq.seqlen_k).keys_of(p, row, 1);
  float row_max = -positive_infinity();
  float row_sum = 0.f;
  float rO[kDimsPerLane];  // this lane's dims: lane * kDimsPerLane + i
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) rO[i] = 0.f;

  for (int key_base = keys.begin; key_base < keys.end; key_base += 32) {
    const int key = key_base + lane;
    float score = -positive_infinity();
    if (key < keys.end) {
      const Element* k_row = gK + key * p.k_row_stride;
      float dot = 0.f;
      for (int d = 0; d < p.head_dim; ++d) dot = fmaf(sQ[warp][d], to_float(k_row[d]), dot);
      score = dot * p.softmax_scale;
      if constexpr (Config::kHasSoftcap) score = p.softcap * tanhf(score / p.softcap);
    }
    const float new_max = fmaxf(row_max, warp_max(score));  // finite: key_base < keys.end
    const float rescale = expf(row_max - new_max);
    const float prob = expf(score - new_max);
    row_sum = row_sum * rescale + warp_sum(prob);
    row_max = new_max;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) rO[i] *= rescale;

    const int keys_here = min(32, keys.end - key_base);
    for (int t = 0; t < keys_here; ++t) {
      const float prob_t = __shfl_sync(0xffffffffu, prob, t);
      const Element* v_row = gV + (key_base + t) * p.v_row_stride;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int d = lane * kDimsPerLane + i;
        if (d < p.head_dim) rO[i] = fmaf(prob_t, to_float(v_row[d]), rO[i]);
      }
    }
  }

  Element* gO = static_cast<Element*>(p.o) + seq.o_batch_offset +
                (seq.q_start + row) * p.o_row_stride + head * p.o_head_stride;  // (head_dim)
  const float inv_sum = row_sum > 0.f ? 1.f / row_sum : 0.f;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    const int d = lane * kDimsPerLane + i;
    if (d < p.head_dim) gO[d] = from_float<Element>(rO[i] * inv_sum);
  }
  if (p.lse != nullptr && lane == 0) {
    const long long lse_row = p.cu_seqlens_q != nullptr ? seq.q_start + row : row;
    p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + lse_row] =
        row_sum > 0.f ? row_max + logf(row_sum) : positive_infinity();
  }
}

}  // namespace flashjit::kernels
