// FlashAttention-2 backward, mma.sync (sm_80 and newer). Five entries, launched in this order:
//   preprocess     delta = rowsum(dO * O) in fp32; zeroes the fp32 dQ accumulator (atomic mode).
//   dkdv_atomic_dq K/V in the outer loop: one CTA owns kBlockN keys of one K/V head and walks the
//                  query tiles of every query head sharing that K/V head (GQA: dK and dV are summed
//                  in registers, never in a second pass). Per kBlockM-query step it recomputes
//                  S^T = K Q^T and P^T = exp(S^T - LSE) from the saved logsumexp, dP^T = V dO^T,
//                  dS^T = P^T * (dP^T - delta), accumulates dV += P^T dO and dK += dS^T Q in
//                  registers, and adds dQ = dS K into the fp32 accumulator with atomics.
//   dkdv           the same without dQ (deterministic mode).
//   dq             deterministic mode's dQ: Q in the outer loop like the forward, recomputing S
//                  and dP, each CTA summing its rows' dQ over all keys in a fixed order.
//   convert_dq     dQ accumulator -> the output dtype (atomic mode).
// The softmax scale (and the softcap's derivative) is folded into dS once, so no gradient needs a
// final scaling. Query steps and key tiles entirely outside the mask are never visited.
// User modifiers and block masks (common/modifiers.cuh), as sm90_bwd takes them: under a block mask
// dkdv walks the key tile's row of the transposed lists for each query head and dq the query tile's
// row of the forward's lists; the user's mask decides the elements of partly visible steps (every
// step without a block mask), and the score modifier with its derivative (the user's, or dual
// numbers) runs on every element inside the sequence.
//   Grids: preprocess/convert (ceil(seqlen_q / kRowsPerCta), heads_q, batch); dkdv (ceil(seqlen_k /
//   kBlockN), heads_kv, batch); dq (ceil(seqlen_q / kDqBlockM), heads_q, batch).
//   Shared memory (dkdv): K, V, kNumStages buffers of Q and dO, P^T and dS^T, LSE and delta; see
//   the Fa2BwdShape byte counts (the host formula in codegen mirrors them).
//   Warp layout (dkdv): each of the three GEMM outputs (S^T and dP^T, dK and dV, dQ) is split over
//   the warps on its own grid, the most square one (WarpGrid), since every warp reads operand
//   slabs proportional to its tile's rows plus columns from shared memory.
#pragma once

#include "common/bwd.cuh"
#include "common/tile_sm80.cuh"

namespace flashjit::kernels {

// How `warps` split a (rows x cols) GEMM output into whole 16 x 16 warp tiles: the power-of-two
// split that minimises what each warp reads (operand bytes scale with its rows + its cols). 0 when
// no split fits. codegen/src/families/fa2_bwd.cpp mirrors this.
constexpr int balanced_row_warps(int rows, int cols, int warps) {
  int best = 0, best_cost = 1 << 30;
  for (int row_warps = 1; row_warps <= warps; row_warps *= 2) {
    const int col_warps = warps / row_warps;
    if (rows % (16 * row_warps) != 0 || cols % (16 * col_warps) != 0) continue;
    const int cost = rows / row_warps + cols / col_warps;
    if (cost < best_cost) {
      best = row_warps;
      best_cost = cost;
    }
  }
  return best;
}

template <int kRows, int kCols, int kWarps>
struct WarpGrid {
  static constexpr int kRowWarps = balanced_row_warps(kRows, kCols, kWarps);
  static_assert(kRowWarps > 0, "the tile does not split into 16 x 16 warp tiles");
  static constexpr int kColWarps = kWarps / kRowWarps;
  static constexpr int kWarpRows = kRows / kRowWarps;
  static constexpr int kWarpCols = kCols / kColWarps;
  static constexpr int kRowFrags = kWarpRows / 16;  // m16 tiles
  static constexpr int kColFrags = kWarpCols / 8;   // n8 tiles
  __device__ static int row0(int warp) { return (warp % kRowWarps) * kWarpRows; }
  __device__ static int col0(int warp) { return (warp / kRowWarps) * kWarpCols; }
};

template <class Config>
struct Fa2BwdShape {
  using Element = typename Config::Element;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kBlockM = Config::kBlockM;    // queries per step of the dkdv loop
  static constexpr int kBlockN = Config::kBlockN;    // keys per dkdv CTA
  static constexpr int kWarps = Config::kNumWarps;
  static constexpr int kStages = Config::kNumStages;  // Q/dO buffers: 1, or 2 to prefetch a step
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kLoadThreadsPerRow = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  static constexpr int kRowStride = kHeadDim + 8;     // Q, K, V, dO tiles (elements)
  static constexpr int kPStride = kBlockM + 8;        // P^T and dS^T tiles: kBlockN rows of queries

  // dkdv warp tiles of its three GEMM outputs: S^T and dP^T (keys x queries), dK and dV (keys x
  // dims), dQ (queries x dims).
  using ScoreGrid = WarpGrid<kBlockN, kBlockM, kWarps>;
  using KvGradGrid = WarpGrid<kBlockN, kHeadDim, kWarps>;
  using DqGrid = WarpGrid<kBlockM, kHeadDim, kWarps>;
  // dQ is computed a chunk of its dims at a time on top of dK/dV (codegen sizes the chunk).
  static constexpr int kDqChunkFrags = Config::kDqChunkFrags;
  static constexpr int kDqChunks = DqGrid::kColFrags / kDqChunkFrags;

  // The deterministic dq kernel: one m16 tile per warp, kDqBlockN keys per step (codegen picks them
  // smaller for the big head dims so Q, dO, K and V fit the 163 KB of sm_80; the host sizes the
  // dq grid by kDqBlockM).
  static constexpr int kDqBlockM = Config::kDqBlockM;
  static constexpr int kDqBlockN = Config::kDqBlockN;
  static constexpr int kDqSmemBytes = 2 * (kDqBlockM + kDqBlockN) * kRowStride * 2;

  // Preprocess / convert: rows per CTA.
  static constexpr int kRowsPerCta = kBwdRowPassRows;

  // dkdv shared memory, in bytes from the base.
  static constexpr int kTileBytes = kBlockN * kRowStride * 2;
  static constexpr int kStepBytes = kBlockM * kRowStride * 2;
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kTileBytes;
  static constexpr int kQOffset = 2 * kTileBytes;
  static constexpr int kDoOffset = kQOffset + kStages * kStepBytes;
  static constexpr int kPOffset = kDoOffset + kStages * kStepBytes;
  static constexpr int kDsOffset = kPOffset + kBlockN * kPStride * 2;
  static constexpr int kLseOffset = kDsOffset + kBlockN * kPStride * 2;
  static constexpr int kDeltaOffset = kLseOffset + kStages * kBlockM * 4;
  static constexpr int kDkdvSmemBytes = kDeltaOffset + kStages * kBlockM * 4;

  static_assert(kDqChunkFrags % 2 == 0 && DqGrid::kColFrags % kDqChunkFrags == 0,
                "dQ dims split into equal chunks of n8 pairs");
  static_assert(kDqBlockM == 16 * kWarps && kDqBlockN % 16 == 0, "dq: one m16 tile per warp, k16 steps of keys");
  static_assert(kDkdvSmemBytes == Config::kDkdvSmemBytes && kDqSmemBytes == Config::kDqSmemBytes,
                "the shared-memory layouts are the sizes codegen launches them with");
  static_assert(kHeadDim % 16 == 0, "k16 steps over the head dim");
};

// ---------------------------------------------------------------------------------------------
// preprocess and convert_dq: the row passes shared with the Hopper backward (common/bwd.cuh).

template <class Config>
__device__ void fa2_bwd_preprocess_kernel(const AttentionBwdParams& p) {
  bwd_preprocess<Config, Fa2BwdShape<Config>::kThreads>(p);
}

template <class Config>
__device__ void fa2_bwd_convert_dq_kernel(const AttentionBwdParams& p) {
  bwd_convert_dq<Config, Fa2BwdShape<Config>::kThreads>(p);
}

// ---------------------------------------------------------------------------------------------
// dkdv: K/V outer loop.

template <class Config, bool kAtomicDq>
__device__ void fa2_bwd_dkdv(const AttentionBwdParams& p) {
  using Shape = Fa2BwdShape<Config>;
  using Element = typename Shape::Element;
  using Mods = typename ModifiersOf<Config>::type;
  constexpr int kBlockM = Shape::kBlockM, kBlockN = Shape::kBlockN, kStages = Shape::kStages;
  constexpr MaskKind kMask = Config::kMask;
  constexpr float kLog2e = 1.4426950408889634f;
  const AttentionFwdParams& f = p.fwd;

  extern __shared__ __align__(16) unsigned char smem[];
  require_dynamic_smem(Shape::kDkdvSmemBytes);
  const unsigned base = shared_address(smem);
  const unsigned sK = base + Shape::kKOffset, sV = base + Shape::kVOffset;
  const unsigned sP = base + Shape::kPOffset, sDs = base + Shape::kDsOffset;
  float* sLse = reinterpret_cast<float*>(smem + Shape::kLseOffset);      // (kStages, kBlockM)
  float* sDelta = reinterpret_cast<float*>(smem + Shape::kDeltaOffset);  // (kStages, kBlockM)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int n_block = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
  const SequenceExtent seq = sequence_extent(f, batch);
  const int n0 = n_block * kBlockN;
  if (n0 >= seq.seqlen_k) return;  // varlen: this sequence is shorter than the longest
  const int group = f.num_heads_q / f.num_heads_kv;

  // Query steps that can see this key tile.
  // The step loop's tile test from plain values computed here: through the mask object (or with
  // these taken from it), the atomic-dQ entry spilled 24 bytes at head dim 128 causal on sm_90a,
  // where it uses 254 registers.
  const int diagonal = seq.seqlen_k - seq.seqlen_q;
  const bool has_right = kMask != MaskKind::kNone && f.window_right >= 0;
  const bool has_left = kMask == MaskKind::kWindow && f.window_left >= 0;
  const AttentionMask<kMask> mask(f, seq.seqlen_q, seq.seqlen_k);
  const KeyRange queries = mask.queries_of(f, n0, kBlockN);
  const int m_block_min = queries.begin / kBlockM;
  const int m_block_max = queries.end > queries.begin ? (queries.end + kBlockM - 1) / kBlockM : m_block_min;
  const int steps_per_head = m_block_max - m_block_min;
  // Under a block mask, every query head's row of the transposed lists instead.
  const int num_steps = Mods::kBlockSparse ? sparse_query_step_count(p.transposed_block_mask, batch, kv_head, group, n0)
                                           : steps_per_head * group;

  const Element* gK = static_cast<const Element*>(f.k) + seq.k_batch_offset +
                      (seq.k_start + n0) * f.k_row_stride + kv_head * f.k_head_stride;
  const Element* gV = static_cast<const Element*>(f.v) + seq.v_batch_offset +
                      (seq.k_start + n0) * f.v_row_stride + kv_head * f.v_head_stride;
  const long long do_batch = f.cu_seqlens_q != nullptr ? 0 : batch * p.do_batch_stride;

  // Query step `step`: its first query, its query head and whether the user's mask decides its
  // elements.
  auto query_step = [&](int step) -> QueryStep {
    if constexpr (Mods::kBlockSparse) {
      return sparse_query_step<kBlockM>(p.transposed_block_mask, batch, kv_head, group, n0, step);
    } else {  // (the head first: computed after m0, ptxas scheduled the plain kernels otherwise)
      const int head = kv_head * group + step / steps_per_head, m0 = (m_block_min + step % steps_per_head) * kBlockM;
      return {m0, head, 1};
    }
  };
  auto load_step = [&](int step, int buffer) {
    const QueryStep at = query_step(step);
    const int head = at.head, m0 = at.m0;
    const Element* gQ = static_cast<const Element*>(f.q) + seq.q_batch_offset +
                        (seq.q_start + m0) * f.q_row_stride + head * f.q_head_stride;
    const Element* gDo = static_cast<const Element*>(p.d_o) + do_batch +
                         (seq.q_start + m0) * p.do_row_stride + head * p.do_head_stride;
    load_tile_async<Shape, kBlockM>(base + Shape::kQOffset + buffer * Shape::kStepBytes, gQ, f.q_row_stride,
                                    seq.seqlen_q - m0, f.head_dim, tid);
    load_tile_async<Shape, kBlockM>(base + Shape::kDoOffset + buffer * Shape::kStepBytes, gDo, p.do_row_stride,
                                    seq.seqlen_q - m0, f.head_dim, tid);
    // LSE and delta, 4 bytes each; rows past seqlen_q read as 0 (their Q and dO rows are zero, so
    // they add nothing).
    const float* gLse = f.lse + batch * f.lse_batch_stride + head * f.lse_head_stride +
                        (f.cu_seqlens_q != nullptr ? seq.q_start : 0) + m0;
    const float* gDelta = p.delta + static_cast<long long>(head) * p.workspace_rows + workspace_row(f, seq, batch, m0);
    for (int i = tid; i < kBlockM; i += Shape::kThreads) {
      const bool valid = m0 + i < seq.seqlen_q;
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                       shared_address(sLse + buffer * kBlockM + i)),
                   "l"(valid ? gLse + i : gLse), "r"(valid ? 4 : 0));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                       shared_address(sDelta + buffer * kBlockM + i)),
                   "l"(valid ? gDelta + i : gDelta), "r"(valid ? 4 : 0));
    }
  };

  // Warp tiles.
  using ScoreGrid = typename Shape::ScoreGrid;
  using KvGradGrid = typename Shape::KvGradGrid;
  using DqGrid = typename Shape::DqGrid;
  const int score_key0 = ScoreGrid::row0(warp), score_query0 = ScoreGrid::col0(warp);
  const int grad_key0 = KvGradGrid::row0(warp), grad_dim0 = KvGradGrid::col0(warp);
  const int dq_query0 = DqGrid::row0(warp), dq_dim0 = DqGrid::col0(warp);

  float dk[KvGradGrid::kRowFrags][KvGradGrid::kColFrags][4], dv[KvGradGrid::kRowFrags][KvGradGrid::kColFrags][4];
  zero_fragments(dk);
  zero_fragments(dv);

  const float scale_log2 = f.softmax_scale * kLog2e;
  const float softcap_scale = Config::kHasSoftcap ? f.softmax_scale / f.softcap : 0.f;

  load_tile_async<Shape, kBlockN>(sK, gK, f.k_row_stride, seq.seqlen_k - n0, f.head_dim, tid);
  load_tile_async<Shape, kBlockN>(sV, gV, f.v_row_stride, seq.seqlen_k - n0, f.head_dim, tid);
  if (num_steps > 0) load_step(0, 0);
  cp_async_commit();

  int buffer = 0;
  for (int step = 0; step < num_steps; ++step) {
    cp_async_wait<0>();
    __syncthreads();  // step's Q/dO landed; every warp is done with the previous step
    if constexpr (kStages == 2) {
      if (step + 1 < num_steps) load_step(step + 1, buffer ^ 1);
      cp_async_commit();
    }
    const QueryStep at = query_step(step);
    const int head = at.head, m0 = at.m0;
    const unsigned sQ = base + Shape::kQOffset + buffer * Shape::kStepBytes;
    const unsigned sDo = base + Shape::kDoOffset + buffer * Shape::kStepBytes;
    const float* lse = sLse + buffer * kBlockM;
    const float* delta = sDelta + buffer * kBlockM;

    // S^T = K Q^T and dP^T = V dO^T for this warp's keys and queries; P^T and dS^T to shared.
    {
      constexpr int kKeyFrags = ScoreGrid::kRowFrags, kQueryFrags = ScoreGrid::kColFrags;
      float s[kKeyFrags][kQueryFrags][4], dp[kKeyFrags][kQueryFrags][4];
      zero_fragments(s);
      zero_fragments(dp);
      warp_gemm_ss<Element, kKeyFrags, kQueryFrags, Shape::kHeadDim / 16, false, false>(
          s, sK + score_key0 * Shape::kRowStride * 2, Shape::kRowStride, sQ + score_query0 * Shape::kRowStride * 2,
          Shape::kRowStride, lane);
      warp_gemm_ss<Element, kKeyFrags, kQueryFrags, Shape::kHeadDim / 16, false, false>(
          dp, sV + score_key0 * Shape::kRowStride * 2, Shape::kRowStride, sDo + score_query0 * Shape::kRowStride * 2,
          Shape::kRowStride, lane);
      const bool asks_mask = Mods::kHasMask && at.partial != 0;  // the user's mask decides this step's elements
      const bool needs_mask = asks_mask || n0 + kBlockN > seq.seqlen_k ||
                              (has_right && n0 + kBlockN - 1 > m0 + diagonal + f.window_right) ||
                              (has_left && n0 < m0 + kBlockM - 1 + diagonal - f.window_left);
#pragma unroll
      for (int ni = 0; ni < kQueryFrags; ++ni) {
        const int query = score_query0 + ni * 8 + (lane % 4) * 2;  // tile-relative, and query + 1
        const float2 lse2 = load_shared_pair(lse + query);
        const float2 delta2 = load_shared_pair(delta + query);
        const float lse_log2[2] = {lse2.x * kLog2e, lse2.y * kLog2e};
        const float deltas[2] = {delta2.x, delta2.y};
#pragma unroll
        for (int mi = 0; mi < kKeyFrags; ++mi)
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // the thread's two keys: g and g + 8
            const int key = score_key0 + mi * 16 + lane / 4 + h * 8;
            float prob[2], ds[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int q = m0 + query + c;
              const bool visible = !needs_mask || AttentionMask<kMask>::visible(f, q, n0 + key, seq.seqlen_k, diagonal);
              if constexpr (Mods::kHasMask || Mods::kHasScore)
                prob[c] = modified_element<Mods, Config>(s[mi][ni][2 * h + c], lse_log2[c], dp[mi][ni][2 * h + c],
                                                         deltas[c], visible, asks_mask, seq, f, batch, head, q,
                                                         n0 + key, scale_log2, softcap_scale, ds[c]);
              else
                prob[c] = probability_and_ds<Config>(s[mi][ni][2 * h + c], lse_log2[c], dp[mi][ni][2 * h + c],
                                                     deltas[c], visible, scale_log2, softcap_scale, f, ds[c]);
            }
            const int offset = (key * Shape::kPStride + query) * 2;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sP + offset), "r"(pack2<Element>(prob[0], prob[1])));
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sDs + offset), "r"(pack2<Element>(ds[0], ds[1])));
          }
      }
    }
    __syncthreads();  // P^T and dS^T complete

    // dV += P^T dO, dK += dS^T Q.
    warp_gemm_ss<Element, KvGradGrid::kRowFrags, KvGradGrid::kColFrags, kBlockM / 16, false, true>(
        dv, sP + grad_key0 * Shape::kPStride * 2, Shape::kPStride, sDo + grad_dim0 * 2, Shape::kRowStride, lane);
    warp_gemm_ss<Element, KvGradGrid::kRowFrags, KvGradGrid::kColFrags, kBlockM / 16, false, true>(
        dk, sDs + grad_key0 * Shape::kPStride * 2, Shape::kPStride, sQ + grad_dim0 * 2, Shape::kRowStride, lane);

    if constexpr (kStages == 1) {
      __syncthreads();  // every warp is done with Q and dO: the next step's load overlaps dQ
      if (step + 1 < num_steps) load_step(step + 1, 0);
      cp_async_commit();
    }

    // dQ += dS K, added to the fp32 accumulator.
    if constexpr (kAtomicDq) {
      float* accum = p.dq_accum + static_cast<long long>(head) * p.workspace_rows * f.head_dim;
#pragma unroll
      for (int chunk = 0; chunk < Shape::kDqChunks; ++chunk) {
        const int dim0 = dq_dim0 + chunk * Shape::kDqChunkFrags * 8;
        float dq[DqGrid::kRowFrags][Shape::kDqChunkFrags][4];
        zero_fragments(dq);
        warp_gemm_ss<Element, DqGrid::kRowFrags, Shape::kDqChunkFrags, kBlockN / 16, true, true>(
            dq, sDs + dq_query0 * 2, Shape::kPStride, sK + dim0 * 2, Shape::kRowStride, lane);
#pragma unroll
        for (int mi = 0; mi < DqGrid::kRowFrags; ++mi)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = m0 + dq_query0 + mi * 16 + lane / 4 + h * 8;
            if (row >= seq.seqlen_q) continue;
            float* accum_row = accum + static_cast<long long>(workspace_row(f, seq, batch, row)) * f.head_dim;
#pragma unroll
            for (int ni = 0; ni < Shape::kDqChunkFrags; ++ni) {
              const int col = dim0 + ni * 8 + (lane % 4) * 2;
              if (col < f.head_dim)
                atomic_add_pair<Config::kArch>(accum_row + col, dq[mi][ni][2 * h], dq[mi][ni][2 * h + 1]);
            }
          }
      }
    }
    buffer = kStages == 2 ? buffer ^ 1 : 0;
  }
  cp_async_wait<0>();  // a key tile no query sees still has K and V in flight
  __syncthreads();     // sK and sV are reused below for the dK and dV tiles

  // Epilogue: stage dK and dV in shared memory (over K and V) for 16-byte coalesced stores. Keys
  // no query sees get zeros.
  Element* sDk = reinterpret_cast<Element*>(smem + Shape::kKOffset);
  Element* sDv = reinterpret_cast<Element*>(smem + Shape::kVOffset);
#pragma unroll
  for (int mi = 0; mi < KvGradGrid::kRowFrags; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = grad_key0 + mi * 16 + lane / 4 + h * 8;
#pragma unroll
      for (int ni = 0; ni < KvGradGrid::kColFrags; ++ni) {
        const int col = grad_dim0 + ni * 8 + (lane % 4) * 2;
        *reinterpret_cast<unsigned*>(&sDk[key * Shape::kRowStride + col]) = pack2<Element>(dk[mi][ni][2 * h], dk[mi][ni][2 * h + 1]);
        *reinterpret_cast<unsigned*>(&sDv[key * Shape::kRowStride + col]) = pack2<Element>(dv[mi][ni][2 * h], dv[mi][ni][2 * h + 1]);
      }
    }
  __syncthreads();
  const long long dk_batch = f.cu_seqlens_k != nullptr ? 0 : batch * p.dk_batch_stride;
  const long long dv_batch = f.cu_seqlens_k != nullptr ? 0 : batch * p.dv_batch_stride;
  Element* gDk = static_cast<Element*>(p.dk) + dk_batch + (seq.k_start + n0) * p.dk_row_stride + kv_head * p.dk_head_stride;
  Element* gDv = static_cast<Element*>(p.dv) + dv_batch + (seq.k_start + n0) * p.dv_row_stride + kv_head * p.dv_head_stride;
  constexpr int kRowsPerPass = Shape::kThreads / Shape::kLoadThreadsPerRow;
  const int chunk = tid % Shape::kLoadThreadsPerRow;
  if (chunk < Shape::kChunks && chunk * 8 < f.head_dim) {
#pragma unroll
    for (int pass = 0; pass < (kBlockN + kRowsPerPass - 1) / kRowsPerPass; ++pass) {
      const int row = tid / Shape::kLoadThreadsPerRow + pass * kRowsPerPass;
      if (row < kBlockN && n0 + row < seq.seqlen_k) {
        *reinterpret_cast<uint4*>(gDk + row * p.dk_row_stride + chunk * 8) =
            *reinterpret_cast<const uint4*>(&sDk[row * Shape::kRowStride + chunk * 8]);
        *reinterpret_cast<uint4*>(gDv + row * p.dv_row_stride + chunk * 8) =
            *reinterpret_cast<const uint4*>(&sDv[row * Shape::kRowStride + chunk * 8]);
      }
    }
  }
}

template <class Config>
__device__ void fa2_bwd_dkdv_atomic_dq_kernel(const AttentionBwdParams& p) {
  fa2_bwd_dkdv<Config, true>(p);
}
template <class Config>
__device__ void fa2_bwd_dkdv_kernel(const AttentionBwdParams& p) {
  fa2_bwd_dkdv<Config, false>(p);
}

// ---------------------------------------------------------------------------------------------
// dq (deterministic mode): Q in the outer loop. Shared memory: Q, dO (kDqBlockM rows), K, V
// (kDqBlockN rows), single-buffered.

template <class Config>
__device__ void fa2_bwd_dq_kernel(const AttentionBwdParams& p) {
  using Shape = Fa2BwdShape<Config>;
  using Element = typename Shape::Element;
  using Mods = typename ModifiersOf<Config>::type;
  constexpr int kBlockM = Shape::kDqBlockM, kBlockN = Shape::kDqBlockN;
  constexpr int kSFrags = kBlockN / 8, kOFrags = Shape::kHeadDim / 8;
  constexpr MaskKind kMask = Config::kMask;
  constexpr float kLog2e = 1.4426950408889634f;
  const AttentionFwdParams& f = p.fwd;

  extern __shared__ __align__(16) unsigned char smem[];
  require_dynamic_smem(Shape::kDqSmemBytes);
  const unsigned sQ = shared_address(smem);
  const unsigned sDo = sQ + kBlockM * Shape::kRowStride * 2;
  const unsigned sK = sDo + kBlockM * Shape::kRowStride * 2;
  const unsigned sV = sK + kBlockN * Shape::kRowStride * 2;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int head = blockIdx.y, batch = blockIdx.z;
  const SequenceExtent seq = sequence_extent(f, batch);
  const int m_block = kMask == MaskKind::kNone ? blockIdx.x : gridDim.x - 1 - blockIdx.x;
  const int m0 = m_block * kBlockM;
  if (m0 >= seq.seqlen_q) return;
  const int kv_head = head / (f.num_heads_q / f.num_heads_kv);
  const long long do_batch = f.cu_seqlens_q != nullptr ? 0 : batch * p.do_batch_stride;

  const Element* gQ = static_cast<const Element*>(f.q) + seq.q_batch_offset +
                      (seq.q_start + m0) * f.q_row_stride + head * f.q_head_stride;
  const Element* gDo = static_cast<const Element*>(p.d_o) + do_batch +
                       (seq.q_start + m0) * p.do_row_stride + head * p.do_head_stride;
  const Element* gK = static_cast<const Element*>(f.k) + seq.k_batch_offset + seq.k_start * f.k_row_stride +
                      kv_head * f.k_head_stride;
  const Element* gV = static_cast<const Element*>(f.v) + seq.v_batch_offset + seq.k_start * f.v_row_stride +
                      kv_head * f.v_head_stride;

  // The key tiles from the mask object; the tile test below from plain values, as in the dK/dV
  // entry (through the object, this entry's SASS was no longer the pre-object kernel's).
  const int diagonal = seq.seqlen_k - seq.seqlen_q;
  const bool has_right = kMask != MaskKind::kNone && f.window_right >= 0;
  const bool has_left = kMask == MaskKind::kWindow && f.window_left >= 0;
  const AttentionMask<kMask> mask(f, seq.seqlen_q, seq.seqlen_k);
  const KeyRange keys = mask.keys_of(f, m0, kBlockM);
  int n_block_min = keys.begin / kBlockN;
  int n_block_max = keys.end > keys.begin ? (keys.end + kBlockN - 1) / kBlockN : n_block_min;
  // Under a block mask, steps 0 .. count - 1 of the query tile's row of the forward's lists instead.
  SparseRow sparse{};
  if constexpr (Mods::kBlockSparse) {
    sparse = sparse_row(f.block_mask, batch, head, m0 / f.block_mask.row_block_size);
    n_block_min = 0;
    n_block_max = sparse.count;
  }

  // This thread's two rows: LSE (base 2) and delta, read once.
  const int warp_row0 = warp * 16;
  float lse_log2[2], delta[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = m0 + warp_row0 + lane / 4 + h * 8;
    const bool valid = row < seq.seqlen_q;
    const long long lse_row = f.cu_seqlens_q != nullptr ? seq.q_start + row : row;
    lse_log2[h] = valid ? f.lse[batch * f.lse_batch_stride + head * f.lse_head_stride + lse_row] * kLog2e : 0.f;
    delta[h] = valid ? p.delta[static_cast<long long>(head) * p.workspace_rows + workspace_row(f, seq, batch, row)] : 0.f;
  }

  using Tile = Shape;  // load_tile_async reads kThreads, kChunks, kLoadThreadsPerRow, kRowStride
  load_tile_async<Tile, kBlockM>(sQ, gQ, f.q_row_stride, seq.seqlen_q - m0, f.head_dim, tid);
  load_tile_async<Tile, kBlockM>(sDo, gDo, p.do_row_stride, seq.seqlen_q - m0, f.head_dim, tid);

  float dq[1][kOFrags][4];
  zero_fragments(dq);
  const float scale_log2 = f.softmax_scale * kLog2e;
  const float softcap_scale = Config::kHasSoftcap ? f.softmax_scale / f.softcap : 0.f;

  for (int n_block = n_block_min; n_block < n_block_max; ++n_block) {
    // The key tile: its first key, and whether the user's mask decides its elements.
    SparseTile tile{n_block * kBlockN, 1};
    if constexpr (Mods::kBlockSparse) tile = sparse_tile<kBlockN>(f.block_mask, sparse, n_block);
    const int n0 = tile.start;
    __syncthreads();  // every warp is done with the previous K and V
    load_tile_async<Tile, kBlockN>(sK, gK + n0 * f.k_row_stride, f.k_row_stride, seq.seqlen_k - n0, f.head_dim, tid);
    load_tile_async<Tile, kBlockN>(sV, gV + n0 * f.v_row_stride, f.v_row_stride, seq.seqlen_k - n0, f.head_dim, tid);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    float s[1][kSFrags][4], dp[1][kSFrags][4];
    zero_fragments(s);
    zero_fragments(dp);
    warp_gemm_ss<Element, 1, kSFrags, Shape::kHeadDim / 16, false, false>(
        s, sQ + warp_row0 * Shape::kRowStride * 2, Shape::kRowStride, sK, Shape::kRowStride, lane);
    warp_gemm_ss<Element, 1, kSFrags, Shape::kHeadDim / 16, false, false>(
        dp, sDo + warp_row0 * Shape::kRowStride * 2, Shape::kRowStride, sV, Shape::kRowStride, lane);
    const bool asks_mask = Mods::kHasMask && tile.partial != 0;  // the user's mask decides this tile's elements
    const bool needs_mask = asks_mask || n0 + kBlockN > seq.seqlen_k ||
                            (has_right && n0 + kBlockN - 1 > m0 + diagonal + f.window_right) ||
                            (has_left && n0 < m0 + kBlockM - 1 + diagonal - f.window_left);
#pragma unroll
    for (int ni = 0; ni < kSFrags; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = m0 + warp_row0 + lane / 4 + (e / 2) * 8, key = n0 + ni * 8 + (lane % 4) * 2 + e % 2;
        const bool visible = !needs_mask || AttentionMask<kMask>::visible(f, row, key, seq.seqlen_k, diagonal);
        float ds;
        if constexpr (Mods::kHasMask || Mods::kHasScore)
          modified_element<Mods, Config>(s[0][ni][e], lse_log2[e / 2], dp[0][ni][e], delta[e / 2], visible, asks_mask,
                                         seq, f, batch, head, row, key, scale_log2, softcap_scale, ds);
        else
          probability_and_ds<Config>(s[0][ni][e], lse_log2[e / 2], dp[0][ni][e], delta[e / 2], visible, scale_log2,
                                     softcap_scale, f, ds);
        s[0][ni][e] = ds;
      }
    // dQ += dS K: dS straight from the registers (C layout of two n8 tiles = A layout of one k16).
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      unsigned a[4];
      a[0] = pack2<Element>(s[0][2 * ks][0], s[0][2 * ks][1]);
      a[1] = pack2<Element>(s[0][2 * ks][2], s[0][2 * ks][3]);
      a[2] = pack2<Element>(s[0][2 * ks + 1][0], s[0][2 * ks + 1][1]);
      a[3] = pack2<Element>(s[0][2 * ks + 1][2], s[0][2 * ks + 1][3]);
#pragma unroll
      for (int nd2 = 0; nd2 < kOFrags / 2; ++nd2) {
        unsigned b[4];
        const int key = ks * 16 + lane % 8 + ((lane / 8) % 2) * 8;
        ldmatrix_x4_trans(b, sK + (key * Shape::kRowStride + (nd2 * 2 + lane / 16) * 8) * 2);
        mma_16816<Element>(dq[0][2 * nd2], a, b[0], b[1]);
        mma_16816<Element>(dq[0][2 * nd2 + 1], a, b[2], b[3]);
      }
    }
  }
  cp_async_wait<0>();  // no key tile: Q and dO are still in flight

  const long long dq_batch = f.cu_seqlens_q != nullptr ? 0 : batch * p.dq_batch_stride;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = m0 + warp_row0 + lane / 4 + h * 8;
    if (row >= seq.seqlen_q) continue;
    Element* out = static_cast<Element*>(p.dq) + dq_batch + (seq.q_start + row) * p.dq_row_stride + head * p.dq_head_stride;
#pragma unroll
    for (int nd = 0; nd < kOFrags; ++nd) {
      const int col = nd * 8 + (lane % 4) * 2;
      if (col < f.head_dim)
        *reinterpret_cast<unsigned*>(out + col) = pack2<Element>(dq[0][nd][2 * h], dq[0][nd][2 * h + 1]);
    }
  }
}

}  // namespace flashjit::kernels
