// Hopper forward (sm_90a): FlashAttention-3's structure on TMA, mbarriers and wgmma. DRAFT: written
// without a GPU; the tests in tests/gpu/test_sm90_fwd.cpp have not run yet.
//   Warp specialisation: warpgroup 0 is the producer (one thread issues TMA loads of the Q tile
//   once and of K/V tiles into a ring of kNumStages stages, gated by full/empty mbarriers; the
//   group gives its registers away with setmaxnreg); warpgroups 1 and 2 each own 64 query rows
//   of the 128-row tile: S = Q K^T by wgmma with both operands in shared memory (K-major,
//   128-byte swizzle), online softmax in base 2 in registers (the accumulator layout is mma.sync's
//   C layout warp by warp, so common/softmax.cuh serves both families), then O += P V by wgmma
//   with P from registers and V read MN-major from shared memory.
//   Shared memory: Q (kHeadDim / 64 panels of 128 rows x 128 bytes), kNumStages K and V tiles
//   (panels of kBlockN rows), then the barriers; the base is aligned to 1024 bytes (the swizzle
//   atom). TMA boxes are 64 values wide, so a head dim below the kernel's reads zeros.
//   Not yet: ping-pong between the consumer groups, intra-warpgroup overlap of QK^T with the
//   softmax, the persistent scheduler.
//   Varlen: the maps cover the packed rows as one batch entry; rows past a sequence's end belong
//   to the next sequence, so its edge tiles are always masked and its rows past the end never
//   written.
#pragma once

#include "common/sm90.cuh"
#include "common/softmax.cuh"
#include "common/tile_sm80.cuh"

namespace flashjit::kernels {

template <class Config>
struct Sm90FwdShape {
  using Element = typename Config::Element;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kBlockM = Config::kBlockM;  // 128: two consumer warpgroups of 64 rows
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStages = Config::kNumStages;
  static constexpr int kThreads = Config::kNumWarps * 32;  // 384
  static constexpr int kPanels = kHeadDim / 64;            // 128-byte-wide column panels
  static constexpr int kQPanelBytes = kBlockM * 128;
  static constexpr int kQBytes = kPanels * kQPanelBytes;
  static constexpr int kKVPanelBytes = kBlockN * 128;
  static constexpr int kKVTileBytes = kPanels * kKVPanelBytes;
  static constexpr int kBarrierBytes = 8 * (1 + 2 * kStages);
  static constexpr int kSmemBytes = 1024 + kQBytes + 2 * kStages * kKVTileBytes + kBarrierBytes;

  // One consumer warp's share of the softmax: 16 rows, kBlockN keys, kHeadDim output columns.
  struct Warp {
    using Element = typename Config::Element;
    static constexpr int kMFrags = 1;
    static constexpr int kSFrags = kBlockN / 8;
    static constexpr int kOFrags = kHeadDim / 8;
  };

  static_assert(kBlockM == 128 && kThreads == 384, "one producer and two consumer warpgroups");
  static_assert(kHeadDim % 64 == 0, "head dims in whole 64-value panels");
};

// Keeps the compiler from moving reads or writes of wgmma operands across the asynchronous MMA
// (it cannot see that the hardware still reads or writes them until wgmma.wait_group).
template <int kN>
__device__ __forceinline__ void fence_operands(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int kRows, int kN>
__device__ __forceinline__ void fence_operands(unsigned (&r)[kRows][kN]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int j = 0; j < kN; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

template <class Config>
__device__ void sm90_fwd_kernel(const AttentionSm90FwdParams& params) {
  using Shape = Sm90FwdShape<Config>;
  using Warp = typename Shape::Warp;
  using Element = typename Shape::Element;
  constexpr int kBlockM = Shape::kBlockM, kBlockN = Shape::kBlockN, kStages = Shape::kStages;
  constexpr MaskKind kMask = Config::kMask;
  constexpr float kLog2e = 1.4426950408889634f;
  const AttentionFwdParams& p = params.fwd;

  extern __shared__ __align__(1024) unsigned char smem[];
  require_dynamic_smem(Shape::kSmemBytes);
  const unsigned base = (shared_address(smem) + 1023u) & ~1023u;
  const unsigned sQ = base;
  const unsigned sK = sQ + Shape::kQBytes;                       // kStages tiles
  const unsigned sV = sK + kStages * Shape::kKVTileBytes;        // kStages tiles
  const unsigned bar_q = sV + kStages * Shape::kKVTileBytes;
  auto bar_full = [&](int stage) { return bar_q + 8 + 8 * stage; };
  auto bar_empty = [&](int stage) { return bar_q + 8 + 8 * kStages + 8 * stage; };

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, group = warp / 4;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int m_block = kMask == MaskKind::kNone ? blockIdx.x : gridDim.x - 1 - blockIdx.x;
  const int m0 = m_block * kBlockM;
  const SequenceExtent seq = sequence_extent(p, batch);
  if (m0 >= seq.seqlen_q) return;  // uniform across the CTA (varlen: a shorter sequence)
  const int kv_head = head / (p.num_heads_q / p.num_heads_kv);
  // TMA coordinates: varlen tensors are packed rows of one batch entry.
  const int q_row0 = seq.q_start + m0, k_row0 = seq.k_start, tma_batch = p.cu_seqlens_q != nullptr ? 0 : batch;

  const int diagonal = seq.seqlen_k - seq.seqlen_q;
  const bool has_right = kMask != MaskKind::kNone && p.window_right >= 0;
  const bool has_left = kMask == MaskKind::kWindow && p.window_left >= 0;
  int n_end = seq.seqlen_k;
  if (has_right) n_end = min(n_end, m0 + kBlockM - 1 + diagonal + p.window_right + 1);
  const int n_begin = has_left ? max(0, m0 + diagonal - p.window_left) : 0;
  const int n_block_min = n_begin / kBlockN;
  const int n_block_max = n_end > n_begin ? (n_end + kBlockN - 1) / kBlockN : n_block_min;
  const int num_tiles = n_block_max - n_block_min;

  if (tid == 0) {
    mbarrier_init(bar_q, 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(bar_full(s), 1);
      mbarrier_init(bar_empty(s), 8);  // lane 0 of each consumer warp
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (group == 0) {  // producer
    registers_decrease<40>();
    if (tid == 0) {
      mbarrier_arrive_expect_tx(bar_q, Shape::kQBytes);
      for (int panel = 0; panel < Shape::kPanels; ++panel)
        tma_load_4d(sQ + panel * Shape::kQPanelBytes, params.q_map, bar_q, panel * 64, q_row0, head, tma_batch);
      for (int t = 0; t < num_tiles; ++t) {
        const int stage = t % kStages, round = t / kStages;
        mbarrier_wait(bar_empty(stage), (round & 1) ^ 1);  // a fresh barrier passes parity 1
        const int n0 = (n_block_max - 1 - t) * kBlockN;
        mbarrier_arrive_expect_tx(bar_full(stage), 2 * Shape::kKVTileBytes);
        for (int panel = 0; panel < Shape::kPanels; ++panel) {
          const unsigned offset = stage * Shape::kKVTileBytes + panel * Shape::kKVPanelBytes;
          tma_load_4d(sK + offset, params.k_map, bar_full(stage), panel * 64, k_row0 + n0, kv_head, tma_batch);
          tma_load_4d(sV + offset, params.v_map, bar_full(stage), panel * 64, k_row0 + n0, kv_head, tma_batch);
        }
      }
    }
    return;
  }

  // Consumers.
  registers_increase<232>();
  const int consumer = group - 1, warp_in_group = warp % 4;
  const int warp_row0 = consumer * 64 + warp_in_group * 16;  // this warp's rows in the tile
  const int thread_row0 = m0 + warp_row0 + lane / 4;

  RowSoftmaxState<Warp> st;
#pragma unroll
  for (int nd = 0; nd < Warp::kOFrags; ++nd)
#pragma unroll
    for (int e = 0; e < 4; ++e) st.o[0][nd][e] = 0.f;
  st.row_max[0][0] = st.row_max[0][1] = -positive_infinity();
  st.row_sum[0][0] = st.row_sum[0][1] = 0.f;
  float(&o_flat)[Shape::kHeadDim / 2] = reinterpret_cast<float(&)[Shape::kHeadDim / 2]>(st.o);

  const float scale_log2 = Config::kHasSoftcap ? kLog2e : p.softmax_scale * kLog2e;
  const float softcap_scale = Config::kHasSoftcap ? p.softmax_scale / p.softcap : 0.f;

  mbarrier_wait(bar_q, 0);
  for (int t = 0; t < num_tiles; ++t) {
    const int stage = t % kStages, round = t / kStages;
    const int n0 = (n_block_max - 1 - t) * kBlockN;
    mbarrier_wait(bar_full(stage), round & 1);

    // S = Q K^T: 16 k-steps of 16 values per 64-value panel advance the descriptors by 32 bytes.
    float s[1][Warp::kSFrags][4];
    float(&s_flat)[kBlockN / 2] = reinterpret_cast<float(&)[kBlockN / 2]>(s);
    fence_operands(s_flat);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < Shape::kHeadDim / 16; ++ks) {
      const unsigned k_bytes = (ks % 4) * 32;
      const unsigned long long desc_q = smem_descriptor_sw128(
          sQ + (ks / 4) * Shape::kQPanelBytes + consumer * 64 * 128 + k_bytes, 16, 1024);
      const unsigned long long desc_k = smem_descriptor_sw128(
          sK + stage * Shape::kKVTileBytes + (ks / 4) * Shape::kKVPanelBytes + k_bytes, 16, 1024);
      wgmma_ss<Element, kBlockN>(s_flat, desc_q, desc_k, ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(s_flat);

    if constexpr (Config::kHasSoftcap) {
#pragma unroll
      for (int ni = 0; ni < Warp::kSFrags; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][ni][e] = p.softcap * tanh_accurate(s[0][ni][e] * softcap_scale);
    }
    // Varlen: rows past this sequence hold the next one's keys, not zeros; masking removes them.
    const bool needs_mask = n0 + kBlockN > seq.seqlen_k ||
                            (has_right && n0 + kBlockN - 1 > m0 + diagonal + p.window_right) ||
                            (has_left && n0 < m0 + kBlockM - 1 + diagonal - p.window_left);
    if (needs_mask) mask_tile<Warp, kMask>(s, p, thread_row0, n0, lane, seq.seqlen_k, diagonal);
    online_softmax<Warp>(st, s, scale_log2);

    // O += P V: P from the S registers (C layout of two n8 tiles = A layout of one k16 step), V
    // MN-major: each k-step is 16 key rows further (2048 bytes); panels of 64 dims are kKVPanelBytes apart.
    unsigned a[kBlockN / 16][4];
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      a[ks][0] = pack2<Element>(s[0][2 * ks][0], s[0][2 * ks][1]);
      a[ks][1] = pack2<Element>(s[0][2 * ks][2], s[0][2 * ks][3]);
      a[ks][2] = pack2<Element>(s[0][2 * ks + 1][0], s[0][2 * ks + 1][1]);
      a[ks][3] = pack2<Element>(s[0][2 * ks + 1][2], s[0][2 * ks + 1][3]);
    }
    fence_operands(a);
    fence_operands(o_flat);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      const unsigned long long desc_v =
          smem_descriptor_sw128(sV + stage * Shape::kKVTileBytes + ks * 16 * 128, Shape::kKVPanelBytes, 1024);
      wgmma_rs_b_mn_major<Element, Shape::kHeadDim>(o_flat, a[ks], desc_v, true);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(o_flat);
    fence_operands(a);
    if (lane == 0) mbarrier_arrive(bar_empty(stage));  // this warp is done with K and V of the stage
  }

  // Epilogue: normalise and store O straight from the registers (4-byte pairs), and the LSE.
  Element* gO = static_cast<Element*>(p.o) + seq.o_batch_offset + seq.q_start * p.o_row_stride +
               head * p.o_head_stride;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = st.row_sum[0][h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
    const int row = thread_row0 + h * 8;
    if (row >= seq.seqlen_q) continue;
    Element* out_row = gO + static_cast<long long>(row) * p.o_row_stride;
#pragma unroll
    for (int nd = 0; nd < Warp::kOFrags; ++nd) {
      const int col = nd * 8 + (lane % 4) * 2;
      if (col < p.head_dim)
        *reinterpret_cast<unsigned*>(out_row + col) =
            pack2<Element>(st.o[0][nd][2 * h] * inv_sum, st.o[0][nd][2 * h + 1] * inv_sum);
    }
    if (p.lse != nullptr && lane % 4 == 0) {
      const float max_natural = Config::kHasSoftcap ? st.row_max[0][h] : st.row_max[0][h] * p.softmax_scale;
      const long long lse_row = p.cu_seqlens_q != nullptr ? seq.q_start + row : row;
      p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + lse_row] =
          sum > 0.f ? max_natural + logf(sum) : positive_infinity();
    }
  }
}

}  // namespace flashjit::kernels
