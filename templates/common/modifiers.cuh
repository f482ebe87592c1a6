// User modifiers and block masks, the device side: the Config::Modifiers codegen renders for a spec
// with a modifier or a block mask (or NoModifiers), the walk of a query tile's key tiles through a
// block mask's lists, and the element pass that applies a score modifier and a mask modifier to a
// score tile. Indices given to the user's functions are within the sequence, and only for elements
// inside it (q_idx < seqlen_q, kv_idx < seqlen_k), so a side tensor of the sequence's length is
// never read past its end.
#pragma once

#include "common/types.cuh"

namespace flashjit::kernels {

struct NoModifiers {
  static constexpr bool kHasMask = false, kHasScore = false, kBlockSparse = false;
  static __device__ __forceinline__ bool mask(const AttentionFwdParams&, int, int, int, int) { return true; }
  static __device__ __forceinline__ float score(const AttentionFwdParams&, float s, int, int, int, int) { return s; }
};
template <class T>
struct VoidOf {
  using type = void;
};
// Config::Modifiers where codegen rendered one, else NoModifiers.
template <class Config, class = void>
struct ModifiersOf {
  using type = NoModifiers;
};
template <class Config>
struct ModifiersOf<Config, typename VoidOf<typename Config::Modifiers>::type> {
  using type = typename Config::Modifiers;
};

// The key tiles a query tile visits under a block mask, as steps 0 .. count - 1: its row's fully
// visible blocks, then the partly visible ones, each block kv_tiles_per_block kernel tiles in turn.
// sm90_fwd walks the steps from the last, so the partly visible tiles come first (where the
// built-in causal mask puts its diagonal tile), each list from its highest id. (The row is the
// query block holding the tile: block_m divides q_block_size.)
struct SparseKeyTiles {
  // The row's lists as element offsets into kv_indices and full_kv_indices (32-bit, to spare the
  // producer thread's few registers: with 64-bit pointers it spilled).
  int partial_offset, full_offset;
  int full_steps, count;
};
__device__ __forceinline__ SparseKeyTiles sparse_key_tiles(const BlockSparseParams& b, int batch, int head, int m0) {
  const int row = m0 / b.q_block_size;
  auto clamped = [&](int n) { return min(max(n, 0), b.list_capacity); };
  SparseKeyTiles t;
  const int partial_blocks = clamped(__ldg(b.kv_num_blocks + batch * b.num_batch_stride + head * b.num_head_stride + row));
  t.partial_offset = static_cast<int>(batch * b.indices_batch_stride + head * b.indices_head_stride + row * b.indices_row_stride);
  int full_blocks = 0;
  t.full_offset = 0;
  if (b.full_kv_num_blocks != nullptr) {
    full_blocks = clamped(__ldg(b.full_kv_num_blocks + batch * b.full_num_batch_stride + head * b.full_num_head_stride + row));
    t.full_offset = static_cast<int>(batch * b.full_indices_batch_stride + head * b.full_indices_head_stride +
                                     row * b.full_indices_row_stride);
  }
  t.full_steps = full_blocks * b.kv_tiles_per_block;
  t.count = t.full_steps + partial_blocks * b.kv_tiles_per_block;
  return t;
}
// Step `step`'s first key and whether the mask modifier decides its elements. An id outside the
// key blocks yields a tile past the keys, which the element mask hides whole.
struct KeyTileInfo {
  int n0;
  int partial;
};
template <int kBlockN>
__device__ __forceinline__ KeyTileInfo sparse_key_tile(const BlockSparseParams& b, const SparseKeyTiles& t, int step) {
  const bool partial = step >= t.full_steps;
  const int within = partial ? step - t.full_steps : step;
  const int entry = within / b.kv_tiles_per_block, sub = within - entry * b.kv_tiles_per_block;
  const int id = __ldg(partial ? b.kv_indices + t.partial_offset + entry : b.full_kv_indices + t.full_offset + entry);
  if (id < 0 || id >= b.num_kv_blocks) return {0x40000000, 1};
  return {id * b.kv_block_size + sub * kBlockN, partial ? 1 : 0};
}

// The modifiers on one score tile in the mma.sync C layout (Shape::kMFrags m16 tiles of rows from
// thread_row0, kSFrags n8 tiles of keys from n0), after q.k: with a score modifier every score
// becomes score(q.k * scale); with `hide`, elements past the sequence become -inf, and with
// `ask_mask` too those the mask modifier hides. Elements outside the sequence are never given to
// the user's functions.
template <class Mods, class Shape>
__device__ __forceinline__ void modify_scores(float (&s)[Shape::kMFrags][Shape::kSFrags][4], const AttentionFwdParams& p,
                                              int batch, int head, int seqlen_q, int seqlen_k, int thread_row0, int n0,
                                              int lane, bool hide, bool ask_mask) {
#pragma unroll
  for (int mi = 0; mi < Shape::kMFrags; ++mi)
#pragma unroll
    for (int ni = 0; ni < Shape::kSFrags; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = thread_row0 + mi * 16 + (e / 2) * 8;
        const int col = n0 + ni * 8 + (lane % 4) * 2 + e % 2;
        const bool inside = row < seqlen_q && col < seqlen_k;
        if constexpr (Mods::kHasScore) {
          if (inside) s[mi][ni][e] = Mods::score(p, s[mi][ni][e] * p.softmax_scale, batch, head, row, col);
        }
        if (hide) {
          bool visible = inside;
          if constexpr (Mods::kHasMask) visible = visible && (!ask_mask || Mods::mask(p, batch, head, row, col));
          if (!visible) s[mi][ni][e] = -positive_infinity();
        }
      }
}

}  // namespace flashjit::kernels
