// FlashAttention-2 forward, mma.sync (sm_80 and newer).
//   Algorithm: one CTA owns a kBlockM-row query tile and streams kBlockN-key K/V tiles through
//   shared memory (cp.async); each warp owns kBlockM / kNumWarps query rows (Q split across warps,
//   no split over keys), computes S = Q K^T with m16n8k16 MMAs, keeps a running row max and sum
//   (online softmax in base 2, softmax_scale * log2(e) folded into one FFMA), rescales its O
//   accumulators, and adds P V with P taken straight from the S registers. Normalisation waits for
//   the end; the natural-log LSE is written for the backward. Key tiles entirely outside the mask
//   are never visited; only tiles that straddle a mask edge or the seqlen_k tail pay for masking.
//   Grid: (ceil(seqlen_q / kBlockM), heads_q, batch); masked problems walk query tiles heaviest
//   first so the long causal rows start early. Threads: kNumWarps * 32, all computing.
//   Shared memory (bytes): (kBlockM + 2 * max(1, kNumStages) * kBlockN) * (kHeadDim + 8) * 2. Rows
//   are padded by 16 bytes so the eight row addresses of an ldmatrix hit distinct bank groups.
//   kNumStages == 1: K and V single-buffered, V's load overlaps QK^T and the next K's load
//   overlaps PV. kNumStages >= 2: a ring of K/V tiles, kNumStages - 1 loads in flight.
//   Preconditions: kHeadDim % 32 == 0 and >= head_dim; head_dim % 8 == 0; 16-byte aligned base
//   pointers and row/head/batch strides multiple of 8 elements (checked on the host).
//   User modifiers (common/modifiers.cuh): the score modifier on every tile, the mask modifier on
//   every tile or, under a block mask, on its partly visible tiles; a block mask's row lists replace
//   the key range (walked from the last step, as sm90_fwd walks them).
#pragma once

#include "common/modifiers.cuh"
#include "common/softmax.cuh"
#include "common/tile_sm80.cuh"

namespace flashjit::kernels {

template <class Config>
struct Fa2FwdShape {
  using Element = typename Config::Element;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kWarps = Config::kNumWarps;
  static constexpr int kStages = Config::kNumStages;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpRows = kBlockM / kWarps;
  static constexpr int kMFrags = kWarpRows / 16;      // m16 tiles per warp
  static constexpr int kSFrags = kBlockN / 8;         // n8 tiles of S per warp
  static constexpr int kOFrags = kHeadDim / 8;        // n8 tiles of O per warp
  static constexpr int kChunks = kHeadDim / 8;        // 16-byte chunks per row
  // Threads that share one row when loading or storing a tile: kChunks rounded up to a power of
  // two (head dims 96, 160, 224 leave a few threads idle rather than wrap rows mid-warp).
  static constexpr int kLoadThreadsPerRow = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  static constexpr int kRowStride = kHeadDim + 8;     // elements
  static constexpr int kKVBuffers = kStages > 1 ? kStages : 1;
  static constexpr int kTileElements = kBlockN * kRowStride;
  static_assert(kWarpRows % 16 == 0, "each warp owns whole m16 tiles");
  static_assert(kBlockN % 16 == 0, "PV consumes keys 16 at a time");
  static_assert(kHeadDim % 16 == 0, "QK^T consumes head dims 16 at a time");
};

// S = Q K^T for this warp's rows. sQ/sK are shared addresses of the padded tiles.
template <class Shape>
__device__ __forceinline__ void warp_scores(float (&s)[Shape::kMFrags][Shape::kSFrags][4], unsigned sQ,
                                            unsigned sK, int warp_row0, int lane) {
  using Element = typename Shape::Element;
#pragma unroll
  for (int mi = 0; mi < Shape::kMFrags; ++mi)
#pragma unroll
    for (int ni = 0; ni < Shape::kSFrags; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][ni][e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < Shape::kHeadDim / 16; ++ks) {
    unsigned a[Shape::kMFrags][4];
#pragma unroll
    for (int mi = 0; mi < Shape::kMFrags; ++mi) {
      const int row = warp_row0 + mi * 16 + lane % 16;
      ldmatrix_x4(a[mi], sQ + (row * Shape::kRowStride + (ks * 2 + lane / 16) * 8) * 2);
    }
#pragma unroll
    for (int ni2 = 0; ni2 < Shape::kSFrags / 2; ++ni2) {
      unsigned b[4];
      const int key = ni2 * 16 + lane % 8 + (lane / 16) * 8;
      ldmatrix_x4(b, sK + (key * Shape::kRowStride + (ks * 2 + (lane / 8) % 2) * 8) * 2);
#pragma unroll
      for (int mi = 0; mi < Shape::kMFrags; ++mi) {
        mma_16816<Element>(s[mi][2 * ni2], a[mi], b[0], b[1]);
        mma_16816<Element>(s[mi][2 * ni2 + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

template <class Config>
__device__ void fa2_fwd_kernel(const AttentionFwdParams& p) {
  using Shape = Fa2FwdShape<Config>;
  using Element = typename Shape::Element;
  constexpr int kBlockM = Shape::kBlockM, kBlockN = Shape::kBlockN, kStages = Shape::kStages;
  constexpr MaskKind kMask = Config::kMask;
  using Mods = typename ModifiersOf<Config>::type;
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(16) unsigned char smem[];
  static_assert((kBlockM + 2 * Shape::kKVBuffers * kBlockN) * Shape::kRowStride * 2 == Config::kSmemBytes,
                "the shared-memory layout is the size codegen launches it with");
  require_dynamic_smem(Config::kSmemBytes);
  const unsigned sQ = shared_address(smem);                                   // (kBlockM, kRowStride)
  const unsigned sK = sQ + kBlockM * Shape::kRowStride * 2;                   // (buffers, kBlockN, kRowStride)
  const unsigned sV = sK + Shape::kKVBuffers * Shape::kTileElements * 2;      // (buffers, kBlockN, kRowStride)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int head = blockIdx.y, batch = blockIdx.z;
  const SequenceExtent seq = sequence_extent(p, batch);
  const int m_block = kMask == MaskKind::kNone ? blockIdx.x : gridDim.x - 1 - blockIdx.x;
  const int m0 = m_block * kBlockM;
  if (m0 >= seq.seqlen_q) return;  // varlen: this sequence is shorter than the longest
  const int kv_head = head / (p.num_heads_q / p.num_heads_kv);

  const Element* gQ = static_cast<const Element*>(p.q) + seq.q_batch_offset +
                      (seq.q_start + m0) * p.q_row_stride + head * p.q_head_stride;  // (kBlockM, d)
  const Element* gK = static_cast<const Element*>(p.k) + seq.k_batch_offset +
                      seq.k_start * p.k_row_stride + kv_head * p.k_head_stride;    // (seqlen_k, d)
  const Element* gV = static_cast<const Element*>(p.v) + seq.v_batch_offset +
                      seq.k_start * p.v_row_stride + kv_head * p.v_head_stride;    // (seqlen_k, d)

  // Key tiles this query tile can see.
  // The key range and the tile test from plain values computed here, as AttentionMask's keys_of()
  // and cuts() compute them: through the object, specs at 255 registers on sm_90a spilled (head dim
  // 256 causal 48 bytes, 256 window with softcap 52). The element mask is the object's.
  const AttentionMask<kMask> mask(p, seq.seqlen_q, seq.seqlen_k);
  const int diagonal = seq.seqlen_k - seq.seqlen_q;
  const bool has_right = kMask != MaskKind::kNone && p.window_right >= 0;
  const bool has_left = kMask == MaskKind::kWindow && p.window_left >= 0;
  KeyRange keys{0, seq.seqlen_k};
  if (has_right) keys.end = min(keys.end, m0 + kBlockM - 1 + diagonal + p.window_right + 1);
  if (has_left) keys.begin = max(0, m0 + diagonal - p.window_left);
  auto tile_cut = [&](int n0) {
    return n0 + kBlockN > seq.seqlen_k || (has_right && n0 + kBlockN - 1 > m0 + diagonal + p.window_right) ||
           (has_left && n0 < m0 + kBlockM - 1 + diagonal - p.window_left);
  };
  int n_block_min = keys.begin / kBlockN;
  int n_block_max = keys.end > keys.begin ? (keys.end + kBlockN - 1) / kBlockN : n_block_min;
  // Under a block mask, steps 0 .. count - 1 of the row's lists instead (n_block below is a step).
  SparseRow sparse{};
  if constexpr (Mods::kBlockSparse) {
    sparse = sparse_row(p.block_mask, batch, head, m0 / p.block_mask.row_block_size);
    n_block_min = 0;
    n_block_max = sparse.count;
  }
  const int num_tiles = n_block_max - n_block_min;
  // Key tile n_block: its first key and whether the mask modifier decides its elements.
  auto tile_at = [&](int n_block) -> SparseTile {
    if constexpr (Mods::kBlockSparse) return sparse_tile<kBlockN>(p.block_mask, sparse, n_block);
    else return {n_block * kBlockN, 1};
  };

  auto load_k = [&](int n0, int buffer) {
    load_tile_async<Shape, kBlockN>(sK + buffer * Shape::kTileElements * 2, gK + n0 * p.k_row_stride,
                                    p.k_row_stride, seq.seqlen_k - n0, p.head_dim, tid);
  };
  auto load_v = [&](int n0, int buffer) {
    load_tile_async<Shape, kBlockN>(sV + buffer * Shape::kTileElements * 2, gV + n0 * p.v_row_stride,
                                    p.v_row_stride, seq.seqlen_k - n0, p.head_dim, tid);
  };

  RowStatistics<Shape> st;
  st.reset();
  float o[Shape::kMFrags][Shape::kOFrags][4];  // (kWarpRows, kHeadDim) accumulators
#pragma unroll
  for (int mi = 0; mi < Shape::kMFrags; ++mi)
#pragma unroll
    for (int nd = 0; nd < Shape::kOFrags; ++nd)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mi][nd][e] = 0.f;

  // Softcap and a score modifier leave final scores (the softmax scale applied).
  constexpr bool kFinalScores = Config::kHasSoftcap || Mods::kHasScore;
  const float scale_log2 = kFinalScores ? kLog2e : p.softmax_scale * kLog2e;
  const float softcap_scale = Config::kHasSoftcap ? p.softmax_scale / p.softcap : 0.f;
  const int warp_row0 = warp * Shape::kWarpRows;
  const int thread_row0 = m0 + warp_row0 + lane / 4;
  float s[Shape::kMFrags][Shape::kSFrags][4];

  auto scores_to_probabilities = [&](const SparseTile& tile) {
    if constexpr (Config::kHasSoftcap) {
#pragma unroll
      for (int mi = 0; mi < Shape::kMFrags; ++mi)
#pragma unroll
        for (int ni = 0; ni < Shape::kSFrags; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mi][ni][e] = p.softcap * tanh_accurate(s[mi][ni][e] * softcap_scale);
    }
    const int n0 = tile.start;
    if constexpr (Mods::kBlockSparse) {
      // A partly visible block's elements go through the mask modifier; a fully visible one's are
      // hidden only past the keys' end.
      const bool partial = tile.partial != 0, tail = n0 + kBlockN > seq.seqlen_k;
      if (Mods::kHasScore || partial || tail)
        modify_scores<Mods, Shape>(s, p, batch, head, seq.seqlen_q, seq.seqlen_k, thread_row0, n0, lane, partial || tail,
                                   partial);
    } else {
      if constexpr (Mods::kHasScore || Mods::kHasMask)
        modify_scores<Mods, Shape>(s, p, batch, head, seq.seqlen_q, seq.seqlen_k, thread_row0, n0, lane, Mods::kHasMask,
                                   true);
      if (tile_cut(n0)) mask.template mask_tile<Shape>(s, p, thread_row0, n0, lane);
    }
    online_softmax<Shape>(st, o, s, scale_log2);
  };

  load_tile_async<Shape, kBlockM>(sQ, gQ, p.q_row_stride, seq.seqlen_q - m0, p.head_dim, tid);
  if constexpr (kStages == 1) {
    // Single K and V buffers: V(n) streams in during QK^T(n), K(n-1) during PV(n).
    if (num_tiles > 0) load_k(tile_at(n_block_max - 1).start, 0);
    cp_async_commit();
    for (int n_block = n_block_max - 1; n_block >= n_block_min; --n_block) {
      const SparseTile tile = tile_at(n_block);
      cp_async_wait<0>();
      __syncthreads();  // K(n) landed for everyone; every warp is done with V(n+1)
      load_v(tile.start, 0);
      cp_async_commit();
      warp_scores<Shape>(s, sQ, sK, warp_row0, lane);
      scores_to_probabilities(tile);
      cp_async_wait<0>();
      __syncthreads();  // V(n) landed; every warp is done with K(n)
      if (n_block > n_block_min) load_k(tile_at(n_block - 1).start, 0);
      cp_async_commit();
      warp_accumulate_pv<Element, Shape::kBlockN / 16>(o, s, sV, Shape::kRowStride, lane);
    }
  } else {
    // A ring of kStages K/V tiles: tile t + kStages - 1 loads while tile t is computed.
    cp_async_commit();
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < num_tiles) {
        const int n0 = tile_at(n_block_max - 1 - i).start;
        load_k(n0, i);
        load_v(n0, i);
      }
      cp_async_commit();
    }
    int buffer = 0;
    for (int t = 0; t < num_tiles; ++t) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // tile t landed; every warp is done with tile t - 1's buffer
      const int ahead = t + kStages - 1;
      const int ahead_buffer = buffer == 0 ? kStages - 1 : buffer - 1;  // == ahead % kStages
      if (ahead < num_tiles) {
        const int n0 = tile_at(n_block_max - 1 - ahead).start;
        load_k(n0, ahead_buffer);
        load_v(n0, ahead_buffer);
      }
      cp_async_commit();
      warp_scores<Shape>(s, sQ, sK + buffer * Shape::kTileElements * 2, warp_row0, lane);
      scores_to_probabilities(tile_at(n_block_max - 1 - t));
      warp_accumulate_pv<Element, Shape::kBlockN / 16>(o, s, sV + buffer * Shape::kTileElements * 2,
                                                        Shape::kRowStride, lane);
      buffer = buffer == kStages - 1 ? 0 : buffer + 1;
    }
  }
  cp_async_wait<0>();  // an empty problem still has Q in flight
  __syncthreads();     // sQ is reused below for the output tile

  // Epilogue: finish the row sums across the quad, normalise, stage O in shared memory for 16-byte
  // coalesced stores, and write the LSE.
  Element* sO = reinterpret_cast<Element*>(smem);  // (kBlockM, kRowStride)
#pragma unroll
  for (int mi = 0; mi < Shape::kMFrags; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = quad_sum(st.row_sum[mi][h]);
      const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
      const int local_row = warp_row0 + mi * 16 + lane / 4 + h * 8;
#pragma unroll
      for (int nd = 0; nd < Shape::kOFrags; ++nd) {
        const unsigned packed = pack2<Element>(o[mi][nd][2 * h] * inv_sum, o[mi][nd][2 * h + 1] * inv_sum);
        *reinterpret_cast<unsigned*>(&sO[local_row * Shape::kRowStride + nd * 8 + (lane % 4) * 2]) = packed;
      }
      const int row = m0 + local_row;
      if (p.lse != nullptr && lane % 4 == 0 && row < seq.seqlen_q) {
        const long long lse_row = p.cu_seqlens_q != nullptr ? seq.q_start + row : row;
        p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + lse_row] =
            row_logsumexp<kFinalScores, Mods::kHasMask || Mods::kBlockSparse>(p, st.row_max[mi][h], sum);
      }
    }
  __syncthreads();
  Element* gO = static_cast<Element*>(p.o) + seq.o_batch_offset + (seq.q_start + m0) * p.o_row_stride +
                head * p.o_head_stride;  // (kBlockM, d)
  constexpr int kRowsPerPass = Shape::kThreads / Shape::kLoadThreadsPerRow;
  const int chunk = tid % Shape::kLoadThreadsPerRow;
  if (chunk < Shape::kChunks && chunk * 8 < p.head_dim) {
#pragma unroll
    for (int pass = 0; pass < kBlockM / kRowsPerPass; ++pass) {
      const int row = tid / Shape::kLoadThreadsPerRow + pass * kRowsPerPass;
      if (m0 + row < seq.seqlen_q)
        *reinterpret_cast<uint4*>(gO + row * p.o_row_stride + chunk * 8) =
            *reinterpret_cast<const uint4*>(&sO[row * Shape::kRowStride + chunk * 8]);
    }
  }
}

}  // namespace flashjit::kernels
