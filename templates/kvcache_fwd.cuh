// Attention over a KV cache (decode, speculative verification, chunked prefill), mma.sync, sm_80+.
//   Algorithm: flash-decoding. A CTA owns kBlockM packed query rows of one KV head (row r is query
//   r / group of query head kv_head * group + r % group, so the `group` query heads of a KV head
//   share every K/V byte read) and one of num_splits contiguous shares of the key tiles its rows
//   see. K/V tiles of kBlockN keys stream through a ring of kNumStages buffers, two ways:
//   - attention_tma (sm_90, head dims in 128-byte panels, pages of a whole tile or of 16+ rows that
//     tile it): one extra warp issues TMA copies of whole tiles or pages into 128-byte-swizzled
//     panels, the ring runs on mbarriers (kNumStages tiles in flight);
//   - attention (any arch, any page size): the computing warps gather rows through the block table
//     with cp.async into padded rows (kNumStages - 1 tiles in flight, a barrier per tile); sm_90's
//     extra warp idles.
//   The computing warps form kRowWarps x kKeyWarps: each owns kWarpRows rows and kWarpKeys keys of
//   a tile and keeps its own online softmax; the key warps' (max, sum, O) are merged in shared
//   memory at the end. With one split the CTA writes O and the LSE. With more, on sm_90 the splits
//   of a row are one thread-block cluster (up to 16 CTAs): each leaves its normalised O and LSE in
//   its shared memory and the cluster merges them through distributed shared memory (no second
//   kernel: at batch 1 the combine's launch was a third of a 1k-token step). Elsewhere, or with
//   more splits than a cluster holds, each writes fp32 partials and the combine entry merges them.
//   Both merge in split order (deterministic). append_kv copies this call's new keys and values
//   into the cache at cache_seqlens first.
//   Grids: attention (num_splits, heads_kv * ceil(seqlen_q * group / kBlockM), batch), clusters of
//   (num_splits, 1, 1) when merging in the cluster; append_kv
//   (ceil(seqlen_new * heads_kv * kChunks / kThreads), batch); combine (ceil(heads_q * seqlen_q /
//   (kThreads / 32)), batch), a warp per row. Threads: (kNumWarps + 1) * 32 on sm_90, kNumWarps *
//   32 on sm_80.
//   Shared memory (bytes): max(2 * R + kBlockM * (kHeadDim + 8) * 2, kKeyWarps * kBlockM *
//   (kHeadDim + 4) * 4 + (2 * kKeyWarps + 1) * kBlockM * 4) with R = kNumStages * kBlockN * (kHeadDim + 8)
//   * 2 rounded up to 1024, plus 16 * kNumStages + 1024 on sm_90 (barriers, alignment).
//   Faults the host cannot see without a synchronisation (a page id outside [0, num_pages), a
//   cache_seqlens entry that is negative or leaves no room, a block table too short) are never
//   read through: those loads are skipped or zero-filled, the batch's rows come out NaN, and the first fault is
//   recorded in flashjit_kvcache_status for Runtime::check_kvcache.
//   Preconditions: kHeadDim % 16 == 0 and >= head_dim; head_dim % 8 == 0; 16-byte aligned bases
//   and strides that are multiples of 8 elements (checked on the host).
#pragma once

#include "common/pipeline.cuh"
#include "common/softmax.cuh"
#include "common/tile_sm80.cuh"

// The first fault of the calls since the last check: {code, batch, index, value}, code 0 = none
// (codes: params.cuh). A module global (C linkage, so the runtime finds it by this name): no
// allocation, and it survives graph replays.
extern "C" __device__ int flashjit_kvcache_status[4];
__device__ int flashjit_kvcache_status[4];

namespace flashjit::kernels {

__device__ __forceinline__ void report_kvcache_fault(int code, int batch, int index, int value) {
  if (atomicCAS(&flashjit_kvcache_status[0], 0, -1) == 0) {  // claim the record, then fill it
    flashjit_kvcache_status[1] = batch;
    flashjit_kvcache_status[2] = index;
    flashjit_kvcache_status[3] = value;
    __threadfence();
    atomicExch(&flashjit_kvcache_status[0], code);
  }
}

// Which ring layout a tile is read from: TMA's swizzled panels or cp.async's padded rows.
template <bool kSwizzledPanels>
struct TileLayout {
  static constexpr bool kSwizzled = kSwizzledPanels;
};

template <class Config>
struct KvCacheShape {
  using Element = typename Config::Element;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kBlockM = Config::kBlockM;  // packed query rows per CTA
  static constexpr int kBlockN = Config::kBlockN;  // keys per tile
  static constexpr int kWarps = Config::kNumWarps;  // the warps that compute
  static constexpr int kStages = Config::kNumStages;
  // sm_90: one more warp, which feeds the ring with TMA copies (attention_tma).
  static constexpr bool kBulkLoads = Config::kArch >= 90;
  static constexpr int kThreads = (kWarps + (kBulkLoads ? 1 : 0)) * 32;
  static constexpr int kRowWarps = Config::kRowWarps;
  static constexpr int kKeyWarps = kWarps / kRowWarps;
  static constexpr int kWarpRows = kBlockM / kRowWarps;
  static constexpr int kWarpKeys = kBlockN / kKeyWarps;
  static constexpr int kMFrags = kWarpRows / 16;
  static constexpr int kSFrags = kWarpKeys / 8;
  static constexpr int kOFrags = kHeadDim / 8;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  // Threads per row when loading a tile: kChunks rounded up to a power of two (head dims 96, 160,
  // 224 leave a few idle rather than wrap rows mid-warp).
  static constexpr int kLoadThreadsPerRow = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  static constexpr int kRowStride = kHeadDim + 8;
  static constexpr int kTileBytes = kBlockN * kRowStride * 2;  // a padded tile, as cp.async writes it
  // TMA writes a tile as copies of kv_tma_rows rows (the whole tile, or a page), each kHeadDim / 64
  // panels of those rows x 128 bytes, 128-byte swizzled (SwizzledTile).
  static constexpr bool kTmaCapable = Config::kTmaCapable != 0;  // codegen's rule (attention_tma)
  static constexpr int kTmaTileBytes = kBlockN * kHeadDim * 2;
  // K's ring, V's ring (each 1024-byte aligned, for the swizzle), then Q.
  static constexpr int kRingBytes = (kStages * kTileBytes + 1023) / 1024 * 1024;
  static constexpr int kQBytes = kBlockM * kRowStride * 2;
  static constexpr int kPipelineBytes = 2 * kRingBytes + kQBytes;
  // The key warps' merge: fp32 O rows padded by 4 floats, then (max, sum) per warp and row, then
  // the CTA's LSE per row for a cluster's merge (its O goes over the first key warp's rows).
  static constexpr int kMergeRowStride = kHeadDim + 4;
  static constexpr int kMergeBytes = kKeyWarps * kBlockM * kMergeRowStride * 4 + (2 * kKeyWarps + 1) * kBlockM * 4;
  static constexpr int kMaxClusterSplits = Config::kMaxClusterSplits;  // 0 below sm_90
  // sm_90: the ring's full and empty barriers past both (the merge never overwrites them), and
  // 1024 bytes to align the base.
  static constexpr int kBarrierOffset = kPipelineBytes > kMergeBytes ? kPipelineBytes : kMergeBytes;
  static constexpr int kSmemBytes = kBarrierOffset + (kBulkLoads ? 2 * kStages * 8 + 1024 : 0);

  static_assert(kWarps % kRowWarps == 0 && kWarpRows % 16 == 0, "warps own whole m16 tiles of rows");
  static_assert(kWarpKeys % 16 == 0, "a warp's keys are whole k16 steps of P V");
  static_assert(kHeadDim % 16 == 0, "QK^T consumes head dims 16 at a time");
  static_assert(kStages >= 2, "a ring of at least two K/V buffers");
  static_assert(kBlockN % (kWarps * 32 / kLoadThreadsPerRow) == 0, "cp.async tile loads in whole passes of rows");
  static_assert(kSmemBytes == Config::kSmemBytes, "the shared-memory layout is the size codegen launches it with");
};

// Where element (row, dim) of a key or value tile lies in TMA's layout: the tile is copies of
// `rows` rows (a power of two: the whole tile, or a page), one per page and tensor, each [panel]
// [row][128 bytes] with 16-byte chunks permuted by row % 8 (the 128-byte swizzle; every copy and
// panel starts on a 1024-byte boundary).
struct SwizzledTile {
  int row_mask;              // rows - 1
  unsigned panel_bytes;      // rows x 128
  template <int kHeadDim>
  __device__ __forceinline__ unsigned offset(int row, int dim) const {
    return (row & ~row_mask) * (kHeadDim * 2) + (dim / 64) * panel_bytes + (row & row_mask) * 128 +
           ((((dim % 64) / 8) ^ (row % 8)) << 4);
  }
};

// Where cache position `pos` of sequence `batch` lives: a page and a row in it. Contiguous caches
// are one page per sequence (page = batch). `valid` is false for a page id outside the cache.
struct CacheSlot {
  long long page;
  int row;
  bool valid;
};

// The block-table column of cache position `pos` (0 for a contiguous cache), pos / page_size by
// the host's reciprocal (a multiply-high and a shift instead of a runtime division).
__device__ __forceinline__ int page_slot(const AttentionKvCacheParams& p, int pos) {
  if (p.block_table == nullptr) return 0;
  return (__umulhi(static_cast<unsigned>(pos), p.page_size_magic) + static_cast<unsigned>(pos)) >> p.page_size_shift;
}

__device__ __forceinline__ CacheSlot cache_slot(const AttentionKvCacheParams& p, int batch, int pos) {
  if (p.block_table == nullptr) return {batch, pos, true};
  const int slot = page_slot(p, pos);
  const int page = p.block_table[batch * p.block_table_batch_stride + slot];
  return {page, pos - slot * p.page_size, page >= 0 && page < p.num_pages};
}

// This sequence's keys (cache plus appended), checked against the cache's capacity; a bad length
// is reported, and clamped so nothing past the cache is read.
struct CacheExtent {
  int seqlen_k;
  bool faulty;
};

__device__ __forceinline__ CacheExtent cache_extent(const AttentionKvCacheParams& p, int batch, bool report) {
  const int cached = p.cache_seqlens != nullptr ? p.cache_seqlens[batch] : p.capacity - p.seqlen_new;
  const long long total = static_cast<long long>(cached) + p.seqlen_new;
  if (cached < 0 || total > p.capacity) {
    if (report) report_kvcache_fault(kKvCacheSeqlenOutOfRange, batch, cached, p.capacity - p.seqlen_new);
    return {cached < 0 ? 0 : p.capacity, true};
  }
  return {static_cast<int>(total), false};
}

// append_kv: k_new / v_new rows into the cache at cache_seqlens[batch] + i, one 16-byte chunk of K
// and of V per thread.
template <class Config>
__device__ void kvcache_append_kv_kernel(const AttentionKvCacheParams& p) {
  using Shape = KvCacheShape<Config>;
  using Element = typename Shape::Element;
  if constexpr (Config::kArch >= 90) {
    wait_for_prerequisite_grids();  // k_new and v_new may come from the kernel before
    allow_dependent_launch();       // the attention entry's launch and prologue overlap these copies
  }
  const int batch = blockIdx.y;
  const long long item = static_cast<long long>(blockIdx.x) * Shape::kThreads + threadIdx.x;
  const int chunks = p.fwd.head_dim / 8;
  if (item >= static_cast<long long>(p.seqlen_new) * p.fwd.num_heads_kv * chunks) return;
  const int chunk = item % chunks;
  const int head = (item / chunks) % p.fwd.num_heads_kv;
  const int row = item / (chunks * p.fwd.num_heads_kv);
  if (cache_extent(p, batch, /*report=*/false).faulty) return;  // the attention entry reports it
  const int cached = p.cache_seqlens[batch];
  const CacheSlot slot = cache_slot(p, batch, cached + row);
  if (!slot.valid) {
    report_kvcache_fault(kKvCachePageOutOfRange, batch, (cached + row) / p.page_size, static_cast<int>(slot.page));
    return;
  }
  const Element* k_src = static_cast<const Element*>(p.k_new) + batch * p.k_new_batch_stride +
                         row * p.k_new_row_stride + head * p.k_new_head_stride + chunk * 8;
  const Element* v_src = static_cast<const Element*>(p.v_new) + batch * p.v_new_batch_stride +
                         row * p.v_new_row_stride + head * p.v_new_head_stride + chunk * 8;
  Element* k_dst = static_cast<Element*>(const_cast<void*>(p.fwd.k)) + slot.page * p.k_page_stride +
                   slot.row * p.fwd.k_row_stride + head * p.fwd.k_head_stride + chunk * 8;
  Element* v_dst = static_cast<Element*>(const_cast<void*>(p.fwd.v)) + slot.page * p.v_page_stride +
                   slot.row * p.fwd.v_row_stride + head * p.fwd.v_head_stride + chunk * 8;
  *reinterpret_cast<uint4*>(k_dst) = *reinterpret_cast<const uint4*>(k_src);
  *reinterpret_cast<uint4*>(v_dst) = *reinterpret_cast<const uint4*>(v_src);
}

// Four dims [dim, dim + 4) of O's row (query, head) and, with dim 0, its LSE: the final result.
template <class Element>
__device__ __forceinline__ void store_output_quad(const AttentionFwdParams& f, int batch, int head, int query, int dim,
                                                  const float (&acc)[4], float lse) {
  if (dim < f.head_dim) {
    Element* gO = static_cast<Element*>(f.o) + batch * f.o_batch_stride + query * f.o_row_stride +
                  head * f.o_head_stride + dim;
    *reinterpret_cast<uint2*>(gO) = make_uint2(pack2<Element>(acc[0], acc[1]), pack2<Element>(acc[2], acc[3]));
  }
  if (dim == 0 && f.lse != nullptr) f.lse[batch * f.lse_batch_stride + head * f.lse_head_stride + query] = lse;
}

// The cluster's merge (sm_90): the splits of a tile's rows are the CTAs of one cluster (rank =
// split), each of which left its normalised O rows (fp32, stride kMergeRowStride) at sO and its LSE
// per row at sLse. After a cluster barrier, CTA c takes every num_splits-th (row, 4 dims) item of
// the tile, merges it from every split's shared memory in split order (the LSEs' loads all issued
// before any is used, then the O quads') and stores O and the LSE. The second barrier keeps each
// CTA's shared memory until its peers have read it. NaN in any split (a fault) makes the row NaN.
template <class Shape>
__device__ void merge_splits_in_cluster(const AttentionKvCacheParams& p, unsigned sO, unsigned sLse, int batch,
                                        int kv_head, int m0) {
  constexpr int kQuads = Shape::kHeadDim / 4, kMaxSplits = Shape::kMaxClusterSplits;
  const AttentionFwdParams& f = p.fwd;
  const int splits = p.num_splits, group = f.num_heads_q / f.num_heads_kv, packed_rows = f.seqlen_q * group;
  const float nan = __int_as_float(0x7fffffff);
  cluster_sync();
  for (int i = cluster_cta_rank() + splits * threadIdx.x; i < Shape::kBlockM * kQuads; i += splits * Shape::kThreads) {
    const int r = i / kQuads, dim = (i % kQuads) * 4, row = m0 + r;
    if (row >= packed_rows) continue;
    float lse[kMaxSplits];
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s)
      lse[s] = s < splits ? load_cluster_f32(cluster_shared_address(sLse + r * 4, s)) : -positive_infinity();
    bool any_nan = false;
    float row_max = -positive_infinity();
#pragma unroll
    for (int s = 0; s < kMaxSplits; ++s) {
      any_nan = any_nan || lse[s] != lse[s];
      row_max = fmaxf(row_max, lse[s]);
    }
    float sum = 0.f;
    if (row_max != -positive_infinity())
#pragma unroll
      for (int s = 0; s < kMaxSplits; ++s) sum += __expf(lse[s] - row_max);
    const float row_lse = any_nan ? nan : sum > 0.f ? row_max + logf(sum) : positive_infinity();
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (sum > 0.f) {
      float4 part[kMaxSplits];
      const unsigned own = sO + (r * Shape::kMergeRowStride + dim) * 4;
#pragma unroll
      for (int s = 0; s < kMaxSplits; ++s)
        part[s] = s < splits ? load_cluster_f32x4(cluster_shared_address(own, s)) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int s = 0; s < kMaxSplits; ++s) {
        const float w = s < splits ? __expf(lse[s] - row_lse) : 0.f;
        acc[0] += w * part[s].x;
        acc[1] += w * part[s].y;
        acc[2] += w * part[s].z;
        acc[3] += w * part[s].w;
      }
    }
    if (any_nan) acc[0] = acc[1] = acc[2] = acc[3] = nan;
    store_output_quad<typename Shape::Element>(f, batch, kv_head * group + row % group, row / group, dim, acc, row_lse);
  }
  cluster_sync();
}

// The attention entry's body; kViaTma: K and V come through the TMA maps (the attention_tma entry,
// sm_90 only), otherwise through cp.async. Two kernels rather than a branch: each path gets its
// own register allocation (together, head dim 256's taller tiles spilled).
template <class Config, bool kViaTma>
__device__ void kvcache_attention(const AttentionKvCacheParams& p) {
  using Shape = KvCacheShape<Config>;
  using Element = typename Shape::Element;
  constexpr int kBlockM = Shape::kBlockM, kBlockN = Shape::kBlockN, kStages = Shape::kStages;
  constexpr MaskKind kMask = Config::kMask;
  constexpr float kLog2e = 1.4426950408889634f;
  const AttentionFwdParams& f = p.fwd;

  extern __shared__ __align__(1024) unsigned char smem_base[];
  require_dynamic_smem(Config::kSmemBytes);
  unsigned char* smem = smem_base;
  if constexpr (kViaTma) smem += (1024 - shared_address(smem_base) % 1024) % 1024;  // the swizzle's alignment
  const unsigned sK = shared_address(smem);  // kStages tiles: padded (kBlockN, kRowStride) or TMA's panels
  const unsigned sV = sK + Shape::kRingBytes;
  const unsigned sQ = sV + Shape::kRingBytes;  // (kBlockM, kRowStride)

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if constexpr (Config::kArch >= 90) {
    // Launched while the stream's previous kernel finishes (StreamOrder::overlapping_tail): up to
    // here nothing is read that it may write; the TMA maps are kernel parameters.
    if constexpr (kViaTma)
      if (tid == 0) {
        prefetch_tma_map(p.k_map);
        prefetch_tma_map(p.v_map);
      }
    wait_for_prerequisite_grids();
  }
  const int split = blockIdx.x, batch = blockIdx.z;
  const int group = f.num_heads_q / f.num_heads_kv;
  const int packed_rows = f.seqlen_q * group;
  const int m_blocks = (packed_rows + kBlockM - 1) / kBlockM;
  const int kv_head = blockIdx.y / m_blocks, m0 = (blockIdx.y % m_blocks) * kBlockM;

  const CacheExtent extent = cache_extent(p, batch, /*report=*/split == 0 && blockIdx.y == 0 && tid == 0);
  const int seqlen_k = extent.seqlen_k;
  // The keys any of this CTA's queries sees, in whole tiles, and this split's share of them.
  const int q_first = m0 / group, q_last = min(f.seqlen_q - 1, (m0 + kBlockM - 1) / group);
  const int q_rows = q_last - q_first + 1;
  const AttentionMask<kMask> mask(f, f.seqlen_q, seqlen_k);
  const KeyRange keys = mask.keys_of(f, q_first, q_rows);
  const int tile_first = keys.begin / kBlockN;
  const int tile_end = keys.end > keys.begin ? (keys.end + kBlockN - 1) / kBlockN : tile_first;
  const int tiles_per_split = (tile_end - tile_first + p.num_splits - 1) / p.num_splits;
  const int split_first = tile_first + split * tiles_per_split;
  const int num_tiles = max(0, min(tile_end, split_first + tiles_per_split) - split_first);

  // Q, by the computing warps: packed row r is query r / group of head kv_head * group + r % group.
  {
    const Element* gQ = static_cast<const Element*>(f.q) + batch * f.q_batch_stride;
    for (int i = tid; i < kBlockM * Shape::kChunks && warp < Shape::kWarps; i += Shape::kWarps * 32) {
      const int r = i / Shape::kChunks, chunk = i % Shape::kChunks, row = m0 + r;
      const bool valid = row < packed_rows && chunk * 8 < f.head_dim;
      const Element* src = valid ? gQ + (row / group) * f.q_row_stride +
                                       (kv_head * group + row % group) * f.q_head_stride + chunk * 8
                                 : gQ;
      cp_async_16(sQ + (r * Shape::kRowStride + chunk * 8) * 2, src, valid);
    }
  }
  RowStatistics<Shape> st;
  st.reset();
  float o[Shape::kMFrags][Shape::kOFrags][4];  // (kWarpRows, kHeadDim)
  zero_fragments(o);
  const float scale_log2 = Config::kHasSoftcap ? kLog2e : f.softmax_scale * kLog2e;
  const float softcap_scale = Config::kHasSoftcap ? f.softmax_scale / f.softcap : 0.f;
  const int row_warp = warp % Shape::kRowWarps, key_warp = warp / Shape::kRowWarps;
  const int warp_row0 = row_warp * Shape::kWarpRows, warp_key0 = key_warp * Shape::kWarpKeys;

  // Softcap, the mask and the online softmax on a warp's S of tile t (P left in s).
  auto mask_and_softmax = [&](int t, float (&s)[Shape::kMFrags][Shape::kSFrags][4]) {
    if constexpr (Config::kHasSoftcap) {
#pragma unroll
      for (int mi = 0; mi < Shape::kMFrags; ++mi)
#pragma unroll
        for (int ni = 0; ni < Shape::kSFrags; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mi][ni][e] = f.softcap * tanh_accurate(s[mi][ni][e] * softcap_scale);
    }
    const int n0 = (split_first + t) * kBlockN + warp_key0;
    if (mask.cuts(f, q_first, q_rows, n0, Shape::kWarpKeys)) {
#pragma unroll
      for (int mi = 0; mi < Shape::kMFrags; ++mi)
#pragma unroll
        for (int ni = 0; ni < Shape::kSFrags; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int query = (m0 + warp_row0 + mi * 16 + lane / 4 + (e / 2) * 8) / group;
            const int key = n0 + ni * 8 + (lane % 4) * 2 + e % 2;
            if (!mask.visible(f, query, key)) s[mi][ni][e] = -positive_infinity();
          }
    }
    online_softmax<Shape>(st, o, s, scale_log2);
  };
  const SwizzledTile swizzled{p.kv_tma_rows - 1, static_cast<unsigned>(p.kv_tma_rows) * 128};  // attention_tma's
  // A computing warp's share of tile t in ring buffer `buffer`, padded (cp.async) or in TMA's
  // swizzled panels: S = Q K^T, the mask, the online softmax, O += P V.
  auto consume_tile = [&](int t, int buffer, auto layout) {
    float s[Shape::kMFrags][Shape::kSFrags][4];  // (kWarpRows, kWarpKeys)
    zero_fragments(s);
    const unsigned sQ_warp = sQ + warp_row0 * Shape::kRowStride * 2;
    if constexpr (decltype(layout)::kSwizzled) {
      const unsigned tile_k = sK + buffer * Shape::kTmaTileBytes, tile_v = sV + buffer * Shape::kTmaTileBytes;
      auto at = [&](unsigned tile, int row, int dim) { return tile + swizzled.offset<Shape::kHeadDim>(row, dim); };
      warp_gemm_sb<Element, Shape::kMFrags, Shape::kSFrags, Shape::kHeadDim / 16>(
          s, sQ_warp, Shape::kRowStride, [&](int key, int dim) { return at(tile_k, warp_key0 + key, dim); }, lane);
      mask_and_softmax(t, s);
      warp_accumulate_pv_at<Element, Shape::kWarpKeys / 16>(
          o, s, [&](int key, int dim) { return at(tile_v, warp_key0 + key, dim); }, lane);
    } else {
      const unsigned tile_k = sK + buffer * Shape::kTileBytes + warp_key0 * Shape::kRowStride * 2;
      const unsigned tile_v = sV + buffer * Shape::kTileBytes + warp_key0 * Shape::kRowStride * 2;
      warp_gemm_ss<Element, Shape::kMFrags, Shape::kSFrags, Shape::kHeadDim / 16, false, false>(
          s, sQ_warp, Shape::kRowStride, tile_k, Shape::kRowStride, lane);
      mask_and_softmax(t, s);
      warp_accumulate_pv<Element, Shape::kWarpKeys / 16>(o, s, tile_v, Shape::kRowStride, lane);
    }
  };
  // A cache row that cannot be read (past the sequence, or on a bad page, which is reported once).
  bool read_bad_page = false;
  auto readable = [&](int pos, int page) {
    const bool page_valid = p.block_table == nullptr || (page >= 0 && page < p.num_pages);
    if (pos < seqlen_k && !page_valid && !read_bad_page) {
      read_bad_page = true;
      report_kvcache_fault(kKvCachePageOutOfRange, batch, pos / p.page_size, page);
    }
    return pos < seqlen_k && page_valid;
  };
  auto page_of = [&](int pos) {  // the page id of cache position pos (batch for a contiguous cache)
    return p.block_table == nullptr || pos >= seqlen_k
               ? batch
               : p.block_table[batch * p.block_table_batch_stride + page_slot(p, pos)];
  };

  if constexpr (kViaTma) {
    static_assert(Shape::kTmaCapable, "the attention_tma entry only calls this where codegen allows TMA");
    // sm_90: the last warp feeds a ring of kStages buffers, each with a full barrier (one
    // arrival carrying the tile's bytes) and an empty one (one arrival per computing warp). Lane
    // c issues copy c of a tile: kv_tma_rows rows (a whole tile, or one page) of K and of V, every
    // panel in one copy (the maps split the head dim into 64-value panels, a dim of their own). The
    // copy engine wants few, large copies: single rows (256 bytes) ran at 1.9 TB/s on the H200, and
    // at pages of 16 a CTA alone streamed 34 GB/s with a copy per panel, 49 with one per page;
    // hence TMA for tiles and pages of 16 rows or more, cp.async for smaller pages.
    using Ring = PipelineRing<kStages, Shape::kBarrierOffset, Shape::kBarrierOffset + 8 * kStages>;
    const Ring ring{sK};
    if (tid == 0) ring.init(1, Shape::kWarps);
    fence_barrier_init();
    __syncthreads();  // the barriers are initialised; Q may still be in flight
    if (warp == Shape::kWarps) {
      // Copies per tile: a power of two, at most 8. (Shifts, not divisions: the first copies wait
      // behind this arithmetic, and at batch 1 x 1k runtime divisions cost 3%.)
      const int rows = p.kv_tma_rows, copy_shift = __ffs(kBlockN) - __ffs(rows), copies = 1 << copy_shift;
      const unsigned copy_bytes = 2 * (Shape::kHeadDim / 64) * rows * 128;  // K and V, every panel
      // The page ids of a window of 32 / copies tiles are one load of the warp (lane l: copy
      // l % copies of the window's tile l / copies), and the next window's load is issued behind a
      // window's first copies, so its latency passes behind a window of copies. Read a tile ahead
      // instead, each read stalled the next tile's copies (pages of 16: a CTA alone streamed 33
      // GB/s, 36 with the window; batch 16 x 1k 3059 GB/s, 3279).
      const int copy = lane & (copies - 1), window = 32 >> copy_shift;
      auto window_pages = [&](int t0) {
        const int t = t0 + (lane >> copy_shift);
        return t < num_tiles ? page_of((split_first + t) * kBlockN + copy * rows) : 0;
      };
      int pages = window_pages(0), next_pages = 0;
      int buffer = 0;
      for (int t = 0, in_window = 0; t < num_tiles; ++t, ++in_window) {
        if (in_window == window) {
          in_window = 0;
          pages = next_pages;
        }
        const int page = __shfl_sync(~0u, pages, (in_window << copy_shift) + copy);
        ring.wait_empty(t);
        const int pos = (split_first + t) * kBlockN + lane * rows;
        const bool issues = lane < copies && readable(pos, page);
        const unsigned full = ring.full_barrier(buffer);
        const unsigned issuing = __ballot_sync(~0u, issues);
        if (lane == 0) mbarrier_arrive_expect_tx(full, __popc(issuing) * copy_bytes);
        __syncwarp();  // the bytes are announced before any copy can complete
        if (issues) {
          const int row = pos - page_slot(p, pos) * p.page_size;
          const unsigned offset = buffer * Shape::kTmaTileBytes + lane * rows * Shape::kHeadDim * 2;
          tma_load_5d(sK + offset, p.k_map, full, 0, row, 0, kv_head, page);
          tma_load_5d(sV + offset, p.v_map, full, 0, row, 0, kv_head, page);
        }
        if (in_window == 0) next_pages = window_pages(t + window);  // behind a window's first copies
        buffer = buffer == kStages - 1 ? 0 : buffer + 1;
      }
    } else {
      // Q's latency passes beside the first tiles' copies, not before them.
      cp_async_commit();
      cp_async_wait<0>();
      named_barrier_sync(1, Shape::kWarps * 32);
      int buffer = 0;
      for (int t = 0; t < num_tiles; ++t) {
        ring.wait_full(t, buffer);
        // Rows past the sequence hold whatever the cache or an earlier tile left (NaN would
        // survive P = 0): the warp zeroes its V rows there (the sequence's last tile only).
        const int n0 = (split_first + t) * kBlockN + warp_key0;
        if (n0 + Shape::kWarpKeys > seqlen_k) {
          for (int i = lane; i < Shape::kWarpKeys * Shape::kChunks; i += 32) {
            const int key = i / Shape::kChunks, chunk = i % Shape::kChunks;
            if (n0 + key >= seqlen_k)
              *reinterpret_cast<uint4*>(smem + Shape::kRingBytes + buffer * Shape::kTmaTileBytes +
                                        swizzled.offset<Shape::kHeadDim>(warp_key0 + key, chunk * 8)) =
                  make_uint4(0, 0, 0, 0);
          }
          fence_proxy_async_shared();  // before any later TMA write of these bytes
          __syncwarp();
        }
        consume_tile(t, buffer, TileLayout<true>{});
        __syncwarp();  // the warp's reads of the buffer are done
        if (lane == 0) mbarrier_arrive(ring.empty_barrier(buffer));
        buffer = buffer == kStages - 1 ? 0 : buffer + 1;
      }
    }
  } else if (warp < Shape::kWarps) {  // sm_90's load warp waits at the end
    // The computing warps (all of them on sm_80): each thread loads one 16-byte column chunk of
    // kLoadPasses rows of each tile with cp.async, kStages - 1 tiles ahead, zero-filling rows it
    // cannot read (garbage could be NaN, and 0 * NaN would reach the output); the page ids of its
    // rows in the next tile are read right after a tile's loads are issued, so their latency passes
    // during the compute.
    constexpr int kThreadsPerRow = Shape::kLoadThreadsPerRow, kRowsPerPass = Shape::kWarps * 32 / kThreadsPerRow;
    constexpr int kLoadPasses = kBlockN / kRowsPerPass;
    const int load_chunk = tid % kThreadsPerRow, load_row0 = tid / kThreadsPerRow;
    const bool loads_column = load_chunk < Shape::kChunks && load_chunk * 8 < f.head_dim;
    int pages[kLoadPasses];
    auto fetch_pages = [&](int t) {
#pragma unroll
      for (int pass = 0; pass < kLoadPasses; ++pass)
        pages[pass] = t < num_tiles ? page_of((split_first + t) * kBlockN + load_row0 + pass * kRowsPerPass) : batch;
    };
    auto load_kv = [&](int t, int buffer) {
      const int n0 = (split_first + t) * kBlockN;
      // Formed here, not held across the loop (two 64-bit registers; head dim 256 spilled).
      const Element* gK = static_cast<const Element*>(f.k) + kv_head * f.k_head_stride + load_chunk * 8;
      const Element* gV = static_cast<const Element*>(f.v) + kv_head * f.v_head_stride + load_chunk * 8;
#pragma unroll
      for (int pass = 0; pass < kLoadPasses; ++pass) {
        const int r = load_row0 + pass * kRowsPerPass, pos = n0 + r;
        const bool valid = readable(pos, pages[pass]) && loads_column;
        const int row = pos - page_slot(p, pos) * p.page_size;  // recomputed: cheaper than a register per pass
        const unsigned offset = (r * Shape::kRowStride + load_chunk * 8) * 2 + buffer * Shape::kTileBytes;
        if (load_chunk < Shape::kChunks) {
          cp_async_16(sK + offset, valid ? gK + pages[pass] * p.k_page_stride + row * f.k_row_stride : gK, valid);
          cp_async_16(sV + offset, valid ? gV + pages[pass] * p.v_page_stride + row * f.v_row_stride : gV, valid);
        }
      }
      fetch_pages(t + 1);
    };
    auto sync_computing_warps = [] {  // sm_90's load warp takes no part
      if constexpr (Shape::kBulkLoads) named_barrier_sync(1, Shape::kWarps * 32);
      else __syncthreads();
    };
    cp_async_commit();  // Q
    fetch_pages(0);
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < num_tiles) load_kv(i, i);
      cp_async_commit();
    }
    int buffer = 0;
    for (int t = 0; t < num_tiles; ++t) {
      cp_async_wait<kStages - 2>();
      sync_computing_warps();  // tile t landed; every warp is done with tile t - 1's buffer
      const int ahead = t + kStages - 1;
      if (ahead < num_tiles) load_kv(ahead, buffer == 0 ? kStages - 1 : buffer - 1);
      cp_async_commit();
      consume_tile(t, buffer, TileLayout<false>{});
      buffer = buffer == kStages - 1 ? 0 : buffer + 1;
    }
    cp_async_wait<0>();
  }
  const bool faulty = __syncthreads_or(read_bad_page || extent.faulty);  // also: every warp is done with the ring
  const bool partial = p.num_splits > 1;
  const bool merge_in_cluster = Config::kArch >= 90 && partial && p.merge_in_cluster;
  // With the combine, its launch overlaps the epilogue. Without, the next kernel may be this entry
  // again, whose CTAs, launched here, would take the free slots early and crowd some SMs (batch 16
  // x 4k ran 4% slower; signalled as the CTA starts, where the grid took at most half the slots,
  // batch 16 x 1k and 4k ran 5% slower): the CTA signals as its last step instead (below), when the
  // grid's other CTAs have mostly left their SMs.
  const bool combine_follows = partial && !merge_in_cluster;
  if constexpr (Config::kArch >= 90)
    if (combine_follows) allow_dependent_launch();

  // Merge the key warps: each stores its unnormalised O and (max, sum) per row, in natural-log
  // units of the scaled scores.
  float* mO = reinterpret_cast<float*>(smem);  // (kKeyWarps, kBlockM, kMergeRowStride)
  float* mMax = mO + Shape::kKeyWarps * kBlockM * Shape::kMergeRowStride;  // (kKeyWarps, kBlockM)
  float* mSum = mMax + Shape::kKeyWarps * kBlockM;
  float* mLse = mSum + Shape::kKeyWarps * kBlockM;  // (kBlockM): the CTA's, for the cluster's merge
#pragma unroll
  for (int mi = 0; mi < Shape::kMFrags; ++mi)
#pragma unroll
    for (int h = 0; h < 2 && warp < Shape::kWarps; ++h) {
      const int r = warp_row0 + mi * 16 + lane / 4 + h * 8;
      float* row = mO + (key_warp * kBlockM + r) * Shape::kMergeRowStride;
#pragma unroll
      for (int nd = 0; nd < Shape::kOFrags; ++nd)
        *reinterpret_cast<float2*>(row + nd * 8 + (lane % 4) * 2) = make_float2(o[mi][nd][2 * h], o[mi][nd][2 * h + 1]);
      const float sum = quad_sum(st.row_sum[mi][h]);
      if (lane % 4 == 0) {
        const float m = st.row_max[mi][h];
        mMax[key_warp * kBlockM + r] = m == -positive_infinity() ? m : (Config::kHasSoftcap ? m : m * f.softmax_scale);
        mSum[key_warp * kBlockM + r] = sum;
      }
    }
  __syncthreads();

  const float nan = __int_as_float(0x7fffffff);
  constexpr int kQuads = Shape::kHeadDim / 4;  // each step: 4 dims of one row
  for (int i = tid; i < kBlockM * kQuads; i += Shape::kThreads) {
    const int r = i / kQuads, dim = (i % kQuads) * 4, row = m0 + r;
    if (row >= packed_rows) continue;
    float row_max = -positive_infinity();
#pragma unroll
    for (int w = 0; w < Shape::kKeyWarps; ++w) row_max = fmaxf(row_max, mMax[w * kBlockM + r]);
    float sum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (row_max != -positive_infinity()) {
#pragma unroll
      for (int w = 0; w < Shape::kKeyWarps; ++w) {
        const float weight = __expf(mMax[w * kBlockM + r] - row_max);
        sum += weight * mSum[w * kBlockM + r];
        const float4 part = *reinterpret_cast<const float4*>(mO + (w * kBlockM + r) * Shape::kMergeRowStride + dim);
        acc[0] += weight * part.x;
        acc[1] += weight * part.y;
        acc[2] += weight * part.z;
        acc[3] += weight * part.w;
      }
    }
    const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
    // A row that saw no key: O = 0, and LSE +inf (final) or -inf (a partial that weighs nothing).
    float lse = sum > 0.f ? row_max + logf(sum) : (partial ? -positive_infinity() : positive_infinity());
    for (int e = 0; e < 4; ++e) acc[e] = faulty ? nan : acc[e] * inv_sum;
    if (faulty) lse = nan;
    if (merge_in_cluster) {
      // Over the first key warp's O: this thread alone read (r, dim .. dim + 3) of every key warp.
      *reinterpret_cast<float4*>(mO + r * Shape::kMergeRowStride + dim) = make_float4(acc[0], acc[1], acc[2], acc[3]);
      if (dim == 0) mLse[r] = lse;
    } else if (partial) {
      const long long row_index = (static_cast<long long>(batch) * f.num_heads_q + kv_head * group + row % group) *
                                      f.seqlen_q + row / group;
      const long long partial_row = static_cast<long long>(split) * f.batch * f.num_heads_q * f.seqlen_q + row_index;
      *reinterpret_cast<float4*>(p.partial_o + partial_row * Shape::kHeadDim + dim) = make_float4(acc[0], acc[1], acc[2], acc[3]);
      if (dim == 0) p.partial_lse[partial_row] = lse;
    } else {
      store_output_quad<Element>(f, batch, kv_head * group + row % group, row / group, dim, acc, lse);
    }
  }
  if constexpr (Config::kArch >= 90) {
    if (merge_in_cluster) merge_splits_in_cluster<Shape>(p, shared_address(mO), shared_address(mLse), batch, kv_head, m0);
    if (!combine_follows) allow_dependent_launch();
  }
}

template <class Config>
__device__ void kvcache_attention_kernel(const AttentionKvCacheParams& p) {
  kvcache_attention<Config, false>(p);
}

// Never launched where TMA cannot serve (the runtime's kv_tma_rows is 0 there): it traps.
template <class Config>
__device__ void kvcache_attention_tma_kernel(const AttentionKvCacheParams& p) {
  if constexpr (KvCacheShape<Config>::kTmaCapable) kvcache_attention<Config, true>(p);
  else __trap();
}

// combine: one warp per (head, query) row merges the num_splits partials in split order. The lanes
// take the splits' LSEs 32 at a time and reduce them across the warp; each lane then sums 4 dims of
// O over a chunk of 32 splits, kLoadsInFlight partial rows' loads issued before any is used (a
// loop of dependent loads took 8.8 us for 33 splits on the H200). The first kLoadsInFlight
// partials do not depend on the LSEs, so they are loaded beside them. On sm_90 it is launched
// while the attention entry finishes (StreamOrder::overlapping_tail) and waits for it here.
// Shuffles and loops run in a fixed order, so the result does not depend on timing.
template <class Config>
__device__ void kvcache_combine_kernel(const AttentionKvCacheParams& p) {
  using Shape = KvCacheShape<Config>;
  using Element = typename Shape::Element;
  constexpr int kLoadsInFlight = 16;
  if constexpr (Config::kArch >= 90) {
    wait_for_prerequisite_grids();  // the attention entry's partials
    allow_dependent_launch();       // the next call's launch and prologue overlap the merge
  }
  const AttentionFwdParams& f = p.fwd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, batch = blockIdx.y;
  const int row = blockIdx.x * (Shape::kThreads / 32) + warp;  // head * seqlen_q + query
  if (row >= f.num_heads_q * f.seqlen_q) return;
  const int head = row / f.seqlen_q, query = row % f.seqlen_q;
  const long long row_index = static_cast<long long>(batch) * f.num_heads_q * f.seqlen_q + row;
  const long long split_rows = static_cast<long long>(f.batch) * f.num_heads_q * f.seqlen_q;
  const int splits = p.num_splits;
  auto partial_lse = [&](int split) { return p.partial_lse[split * split_rows + row_index]; };
  // Splits first .. first + count - 1 of dims [dim, dim + 4) (count <= kLoadsInFlight).
  auto load_partials = [&](int first, int count, int dim, float4 (&part)[kLoadsInFlight]) {
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u)
      part[u] = u < count && dim < f.head_dim ? *reinterpret_cast<const float4*>(
                                                    p.partial_o + ((first + u) * split_rows + row_index) * Shape::kHeadDim + dim)
                                              : make_float4(0.f, 0.f, 0.f, 0.f);
  };
  float4 part[kLoadsInFlight];
  load_partials(0, min(splits, kLoadsInFlight), lane * 4, part);

  float row_max = -positive_infinity();
  bool nan_here = false;
  for (int s = lane; s < splits; s += 32) {
    const float lse = partial_lse(s);
    nan_here = nan_here || lse != lse;
    row_max = fmaxf(row_max, lse);
  }
  const bool any_nan = __any_sync(~0u, nan_here);
  row_max = warp_max(row_max);
  float sum = 0.f;
  if (row_max != -positive_infinity())
    for (int s = lane; s < splits; s += 32) sum += __expf(partial_lse(s) - row_max);
  sum = warp_sum(sum);
  const float nan = __int_as_float(0x7fffffff);
  const float lse = any_nan ? nan : sum > 0.f ? row_max + logf(sum) : positive_infinity();

  Element* gO = static_cast<Element*>(f.o) + batch * f.o_batch_stride + query * f.o_row_stride + head * f.o_head_stride;
  for (int pass = 0; pass * 128 < f.head_dim; ++pass) {  // every lane takes part (the shuffles name all 32)
    const int dim = pass * 128 + lane * 4;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int chunk = 0; chunk < splits && sum > 0.f; chunk += 32) {
      const int count = min(32, splits - chunk);
      const float weight = lane < count ? __expf(partial_lse(chunk + lane) - lse) : 0.f;
      for (int j0 = 0; j0 < count; j0 += kLoadsInFlight) {
        if (pass != 0 || chunk + j0 != 0) load_partials(chunk + j0, min(kLoadsInFlight, count - j0), dim, part);
#pragma unroll
        for (int u = 0; u < kLoadsInFlight; ++u) {
          const float w = __shfl_sync(~0u, weight, (j0 + u) % 32);
          acc[0] += w * part[u].x;
          acc[1] += w * part[u].y;
          acc[2] += w * part[u].z;
          acc[3] += w * part[u].w;
        }
      }
    }
    if (any_nan) acc[0] = acc[1] = acc[2] = acc[3] = nan;
    if (dim < f.head_dim)
      *reinterpret_cast<uint2*>(gO + dim) = make_uint2(pack2<Element>(acc[0], acc[1]), pack2<Element>(acc[2], acc[3]));
  }
  if (lane == 0 && f.lse != nullptr) f.lse[batch * f.lse_batch_stride + head * f.lse_head_stride + query] = lse;
}

}  // namespace flashjit::kernels
