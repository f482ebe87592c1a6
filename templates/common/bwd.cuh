// Pieces of the backward shared by its families (fa2_bwd, sm90_bwd): the fp32 workspace rows, the
// mask and the scores' gradient element by element, and the row passes before and after the main
// kernel (delta = rowsum(dO * O) with the dQ accumulator zeroed; dQ converted to the output dtype).
#pragma once

#include "common/mask.cuh"
#include "common/mma_sm80.cuh"
#include "common/modifiers.cuh"

namespace flashjit::kernels {

__device__ __forceinline__ int workspace_row(const AttentionFwdParams& p, const SequenceExtent& seq,
                                             int batch, int row) {
  return p.cu_seqlens_q != nullptr ? seq.q_start + row : batch * p.seqlen_q + row;
}

// fp32 pair add to global memory; one vector reduction on sm_90.
template <int kArch>
__device__ __forceinline__ void atomic_add_pair(float* address, float a, float b) {
  if constexpr (kArch >= 90) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(address), "f"(a), "f"(b) : "memory");
  } else {
    atomicAdd(address, a);
    atomicAdd(address + 1, b);
  }
}

// Four consecutive floats (16-byte aligned) added in one reduction (sm_90).
__device__ __forceinline__ void atomic_add_quad(float* address, float4 v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(address), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}

// A counter that orders CTAs' adds (sm90_bwd's deterministic dQ): wait until it reads `value`, with
// acquire semantics at GPU scope (what the CTA that stored it added before is then visible first),
// and store one with release semantics.
__device__ __forceinline__ void wait_for_counter(const int* counter, int value) {
  int seen;
  for (;;) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
    if (seen == value) return;
    __nanosleep(64);
  }
}
__device__ __forceinline__ void store_counter_release(int* counter, int value) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(counter), "r"(value) : "memory");
}
// The counting form (sm90_bwd's turns under a block mask): wait until at least `value` adds are in,
// and after one raise the count to `value` at least. A list that names a block twice for one key
// tile then adds out of turn instead of waiting forever for a count already passed.
__device__ __forceinline__ void wait_for_count(const int* counter, int value) {
  int seen;
  for (;;) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
    if (seen >= value) return;
    __nanosleep(64);
  }
}
__device__ __forceinline__ void raise_count_release(int* counter, int value) {
  asm volatile("red.release.gpu.global.max.s32 [%0], %1;\n" ::"l"(counter), "r"(value) : "memory");
}

// Two floats from shared memory, kept in program order: a plain load would be hoisted above the
// (volatile) MMAs before it, holding registers across the whole GEMM and spilling.
__device__ __forceinline__ float2 load_shared_pair(unsigned address) {
  float2 r;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(r.x), "=f"(r.y) : "r"(address));
  return r;
}
__device__ __forceinline__ float2 load_shared_pair(const float* pointer) { return load_shared_pair(shared_address(pointer)); }
__device__ __forceinline__ void store_shared_pair(unsigned address, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(address), "f"(a), "f"(b) : "memory");
}

// Scores -> (P, dS * d score / d raw dot), element by element. `dot` is the raw q.k, `lse_log2` the
// row's LSE in base 2, `dp` = dO.v, `delta` = rowsum(dO * O). Returns P; `ds` gets the gradient of
// the raw dot product, with the softmax scale (and softcap derivative) folded in.
template <class Config>
__device__ __forceinline__ float probability_and_ds(float dot, float lse_log2, float dp, float delta,
                                                    bool visible, float scale_log2, float softcap_scale,
                                                    const AttentionFwdParams& p, float& ds) {
  constexpr float kLog2e = 1.4426950408889634f;
  float prob, dscore_ddot;
  if constexpr (Config::kHasSoftcap) {
    const float t = tanh_accurate(dot * softcap_scale);
    prob = visible ? exp2_approx(fmaf(p.softcap * t, kLog2e, -lse_log2)) : 0.f;
    dscore_ddot = p.softmax_scale * (1.f - t * t);
  } else {
    prob = visible ? exp2_approx(fmaf(dot, scale_log2, -lse_log2)) : 0.f;
    dscore_ddot = p.softmax_scale;
  }
  ds = prob * (dp - delta) * dscore_ddot;
  return prob;
}

// probability_and_ds under a score modifier: the modified score of dot * scale replaces the scaled
// dot (the forward's LSE is over it), and dS picks up the modifier's derivative. The modifier runs
// only where `inside` (an element of the sequence); elsewhere, and where it returns -inf, P is 0.
// (Run on clamped indices without the branch, ptxas spilled more.)
template <class Mods>
__device__ __forceinline__ float modified_probability_and_ds(float dot, float lse_log2, float dp, float delta, bool inside,
                                                             const AttentionFwdParams& p, int batch, int head, int query,
                                                             int key, float& ds) {
  constexpr float kLog2e = 1.4426950408889634f;
  float gradient = 0.f, modified = -positive_infinity();
  if (inside) modified = Mods::score_and_gradient(p, dot * p.softmax_scale, batch, head, query, key, gradient);
  const float prob = modified > -positive_infinity() ? exp2_approx(fmaf(modified, kLog2e, -lse_log2)) : 0.f;
  ds = prob * (dp - delta) * gradient * p.softmax_scale;
  return prob;
}

// A query step of a key tile: its first query, its query head and whether the mask modifier decides
// its elements (under a block mask, a partly visible block; otherwise every step).
struct QueryStep {
  int m0, head, partial;
};

// The query steps key tile n0 of K/V head kv_head visits under the block mask: every query head's
// row of the transposed lists.
__device__ __forceinline__ int sparse_query_step_count(const BlockSparseParams& mask, int batch, int kv_head,
                                                       int heads_per_kv, int n0) {
  int steps = 0;
  for (int h = 0; h < heads_per_kv; ++h)
    steps += sparse_row(mask, batch, kv_head * heads_per_kv + h, n0 / mask.row_block_size).count;
  return steps;
}

// Step `step` of that walk (kBlockM queries a step), found by walking the query heads' rows: each
// query head's row in turn, its fully visible blocks first. (sm90_bwd's producer walks the rows
// once, in order; fa2_bwd's threads look each step up, a few loads from L1.)
template <int kBlockM>
__device__ __forceinline__ QueryStep sparse_query_step(const BlockSparseParams& mask, int batch, int kv_head,
                                                       int heads_per_kv, int n0, int step) {
  for (int h = 0; h < heads_per_kv; ++h) {
    const int head = kv_head * heads_per_kv + h;
    const SparseRow row = sparse_row(mask, batch, head, n0 / mask.row_block_size);
    if (step < row.count) {
      const SparseTile queries = sparse_tile<kBlockM>(mask, row, step);
      return {queries.start, head, queries.partial};
    }
    step -= row.count;
  }
  return {0, kv_head * heads_per_kv, 1};  // (past the walk's end: no caller asks)
}

// One element of fa2_bwd's backward under user modifiers: the user's mask where it decides the
// element (`asks_mask`) on top of `visible` (the built-in mask's and the bounds' verdict), then P
// and dS, through the score modifier where there is one. The user's functions see only elements
// inside the sequence.
template <class Mods, class Config>
__device__ __forceinline__ float modified_element(float dot, float lse_log2, float dp, float delta, bool visible,
                                                  bool asks_mask, const SequenceExtent& seq, const AttentionFwdParams& f,
                                                  int batch, int head, int query, int key, float scale_log2,
                                                  float softcap_scale, float& ds) {
  const bool inside = query < seq.seqlen_q && key < seq.seqlen_k;
  if constexpr (Mods::kHasMask) visible = visible && (!asks_mask || (inside && Mods::mask(f, batch, head, query, key)));
  if constexpr (Mods::kHasScore) {
    const float prob = modified_probability_and_ds<Mods>(dot, lse_log2, dp, delta, inside, f, batch, head, query, key, ds);
    if (!visible) ds = 0.f;
    return visible ? prob : 0.f;
  } else {
    return probability_and_ds<Config>(dot, lse_log2, dp, delta, visible, scale_log2, softcap_scale, f, ds);
  }
}

// ---------------------------------------------------------------------------------------------
// preprocess and convert_dq: row-parallel passes of kRowsPerCta rows, kLoadThreadsPerRow threads
// (16 bytes each) per row.

template <class Config, int kThreadCount>
struct BwdRowPass {
  using Element = typename Config::Element;
  static constexpr int kThreads = kThreadCount;
  static constexpr int kChunks = Config::kHeadDim / 8;
  static constexpr int kLoadThreadsPerRow = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  static constexpr int kRowsPerCta = kBwdRowPassRows;
  static_assert(kRowsPerCta % (kThreads / kLoadThreadsPerRow) == 0, "whole passes of rows per CTA");
};

// delta = rowsum(dO * O); zeroes the dQ accumulator when there is one. kSeqused: the family reads
// seqused_q/k (sequence_extent).
template <class Config, int kThreads, bool kSeqused = false>
__device__ void bwd_preprocess(const AttentionBwdParams& p) {
  using Shape = BwdRowPass<Config, kThreads>;
  using Element = typename Shape::Element;
  const AttentionFwdParams& f = p.fwd;
  const int head = blockIdx.y, batch = blockIdx.z, tid = threadIdx.x;
  const SequenceExtent seq = sequence_extent<kSeqused>(f, batch);
  const int row0 = blockIdx.x * Shape::kRowsPerCta;
  if (row0 >= seq.seqlen_q) return;
  constexpr int kRowsPerPass = Shape::kThreads / Shape::kLoadThreadsPerRow;
  const int chunk = tid % Shape::kLoadThreadsPerRow;
  const bool active = chunk < Shape::kChunks && chunk * 8 < f.head_dim;
  const long long do_batch = f.cu_seqlens_q != nullptr ? 0 : batch * p.do_batch_stride;
  for (int pass = 0; pass < Shape::kRowsPerCta / kRowsPerPass; ++pass) {
    const int row = row0 + tid / Shape::kLoadThreadsPerRow + pass * kRowsPerPass;
    const bool valid = row < seq.seqlen_q;
    float sum = 0.f;
    if (valid && active) {
      const Element* o = static_cast<const Element*>(f.o) + seq.o_batch_offset +
                         (seq.q_start + row) * f.o_row_stride + head * f.o_head_stride + chunk * 8;
      const Element* d_o = static_cast<const Element*>(p.d_o) + do_batch +
                           (seq.q_start + row) * p.do_row_stride + head * p.do_head_stride + chunk * 8;
      const uint4 o_bits = *reinterpret_cast<const uint4*>(o);
      const uint4 do_bits = *reinterpret_cast<const uint4*>(d_o);
      const Element* o_values = reinterpret_cast<const Element*>(&o_bits);
      const Element* do_values = reinterpret_cast<const Element*>(&do_bits);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum = fmaf(to_float(o_values[i]), to_float(do_values[i]), sum);
    }
#pragma unroll
    for (int offset = Shape::kLoadThreadsPerRow / 2; offset > 0; offset /= 2)
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (!valid) continue;
    const long long flat_row = static_cast<long long>(head) * p.workspace_rows + workspace_row(f, seq, batch, row);
    if (chunk == 0) p.delta[flat_row] = sum;
    if (p.dq_accum != nullptr && active) {
      float4* accum = reinterpret_cast<float4*>(p.dq_accum + flat_row * f.head_dim + chunk * 8);
      accum[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      accum[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
}

// The fp32 dQ accumulator -> dQ in the output dtype; in a continuing spec, added to the running dQ
// (dq_state), which it then leaves as dQ on the last step (gradients_final) or goes back to.
template <class Config, int kThreads, bool kSeqused = false>
__device__ void bwd_convert_dq(const AttentionBwdParams& p) {
  using Shape = BwdRowPass<Config, kThreads>;
  using Element = typename Shape::Element;
  const AttentionFwdParams& f = p.fwd;
  const int head = blockIdx.y, batch = blockIdx.z, tid = threadIdx.x;
  const SequenceExtent seq = sequence_extent<kSeqused>(f, batch);
  const int row0 = blockIdx.x * Shape::kRowsPerCta;
  if (row0 >= seq.seqlen_q) return;
  constexpr int kRowsPerPass = Shape::kThreads / Shape::kLoadThreadsPerRow;
  const int chunk = tid % Shape::kLoadThreadsPerRow;
  if (chunk >= Shape::kChunks || chunk * 8 >= f.head_dim) return;
  const long long dq_batch = f.cu_seqlens_q != nullptr ? 0 : batch * p.dq_batch_stride;
  for (int pass = 0; pass < Shape::kRowsPerCta / kRowsPerPass; ++pass) {
    const int row = row0 + tid / Shape::kLoadThreadsPerRow + pass * kRowsPerPass;
    if (row >= seq.seqlen_q) break;
    const long long flat_row = static_cast<long long>(head) * p.workspace_rows + workspace_row(f, seq, batch, row);
    const float4* accum = reinterpret_cast<const float4*>(p.dq_accum + flat_row * f.head_dim + chunk * 8);
    float4 lo = accum[0], hi = accum[1];
    if constexpr (ContinuesOf<Config>::value) {
      float4* state = reinterpret_cast<float4*>(p.dq_state + (f.cu_seqlens_q != nullptr ? 0 : batch * p.dq_state_batch_stride) +
                                                (seq.q_start + row) * p.dq_state_row_stride + head * p.dq_state_head_stride +
                                                chunk * 8);
      const float4 before_lo = state[0], before_hi = state[1];
      lo = make_float4(lo.x + before_lo.x, lo.y + before_lo.y, lo.z + before_lo.z, lo.w + before_lo.w);
      hi = make_float4(hi.x + before_hi.x, hi.y + before_hi.y, hi.z + before_hi.z, hi.w + before_hi.w);
      if (!p.gradients_final) {
        state[0] = lo;
        state[1] = hi;
        continue;
      }
    }
    uint4 packed;
    packed.x = pack2<Element>(lo.x, lo.y);
    packed.y = pack2<Element>(lo.z, lo.w);
    packed.z = pack2<Element>(hi.x, hi.y);
    packed.w = pack2<Element>(hi.z, hi.w);
    Element* dq = static_cast<Element*>(p.dq) + dq_batch + (seq.q_start + row) * p.dq_row_stride +
                  head * p.dq_head_stride + chunk * 8;
    *reinterpret_cast<uint4*>(dq) = packed;
  }
}

}  // namespace flashjit::kernels
