// The persistent tile scheduler of the Hopper families: work tiles (query block, head, batch) in
// sections of (batch, head) pairs whose K/V share the L2, longest query blocks first; the last
// num_split_tiles tiles optionally split into `splits` items over shares of their key blocks; a
// CTA starts with item blockIdx.x and claims the next from a global counter (gridDim.x +
// atomicAdd), and the producer publishes each item to the consumers in shared memory.
//   Params provides num_m_blocks, section_pairs, num_split_tiles and splits, and fwd.num_heads_q and
//   fwd.batch (AttentionSm90FwdParams does); the host fills them (runtime/src/families/sm90_fwd.cpp).
#pragma once

#include "common/types.cuh"

namespace flashjit::kernels {

// A work item of the persistent schedule: a work tile (query block, head, batch), or with `split`
// >= 0 split item `split` (tile split / splits, key share split % splits) of the tail splits.
struct Sm90WorkTile {
  int m_block, head, batch, split;
};
// The work item the producer publishes with a Q slot (32 bytes of shared memory): its index (-1:
// the end) and its coordinates, so that the consumers need not decode the index again (a decode is
// five integer divisions, some 100 instructions on the consumers' busy issue slots).
struct PublishedTile {
  int index;
  Sm90WorkTile work;
};
__device__ __forceinline__ void publish_tile(unsigned address, int index, const Sm90WorkTile& work) {
  asm volatile(
      "st.volatile.shared.v4.s32 [%0], {%1, %2, %3, %4};\n"
      "st.volatile.shared.s32 [%0 + 16], %5;\n" ::"r"(address),
      "r"(index), "r"(work.m_block), "r"(work.head), "r"(work.batch), "r"(work.split)
      : "memory");
}
__device__ __forceinline__ PublishedTile read_published_tile(unsigned address) {
  PublishedTile t;
  asm volatile(
      "ld.volatile.shared.v4.s32 {%0, %1, %2, %3}, [%5];\n"
      "ld.volatile.shared.s32 %4, [%5 + 16];\n"
      : "=r"(t.index), "=r"(t.work.m_block), "=r"(t.work.head), "=r"(t.work.batch), "=r"(t.work.split)
      : "r"(address)
      : "memory");
  return t;
}
// Work tile `index`: sections of `section_pairs` (batch, head) pairs, query blocks from the last
// (longest when causal) to the first, pairs fastest within a block.
// (Unsigned: every count and index here is non-negative, and an unsigned division is half the
// instructions of a signed one.)
template <class Params>
__device__ __forceinline__ Sm90WorkTile sm90_work_tile(const Params& params, int index) {
  const unsigned heads = params.fwd.num_heads_q, pairs = heads * params.fwd.batch;
  const unsigned section_pairs = params.section_pairs, section_tiles = section_pairs * params.num_m_blocks;
  const unsigned section = static_cast<unsigned>(index) / section_tiles, within = index - section * section_tiles;
  const unsigned section_begin = section * section_pairs;
  const unsigned pairs_here = min(section_pairs, pairs - section_begin);
  const unsigned pair = section_begin + within % pairs_here;
  return {params.num_m_blocks - 1 - static_cast<int>(within / pairs_here), static_cast<int>(pair % heads),
          static_cast<int>(pair / heads), -1};
}
// Work item `index`: the tiles in order, the last num_split_tiles of them replaced by `splits` items
// each (a tile's items one after another). A kernel compiled without tail splits (kTailSplits false:
// the host then splits none) has the tiles alone, and no split code.
template <class Params>
__device__ __forceinline__ int sm90_whole_tiles(const Params& params) {
  return params.num_m_blocks * params.fwd.num_heads_q * params.fwd.batch - params.num_split_tiles;
}
template <bool kTailSplits, class Params>
__device__ __forceinline__ int sm90_work_items(const Params& params) {
  return sm90_whole_tiles(params) + (kTailSplits ? params.num_split_tiles * params.splits : 0);
}
template <bool kTailSplits, class Params>
__device__ __forceinline__ Sm90WorkTile sm90_work_item(const Params& params, int index) {
  // One decode of the tile either way (two inlined decodes made a tenth of a split spec's code).
  const int whole_tiles = sm90_whole_tiles(params), split = index - whole_tiles;
  const bool is_split = kTailSplits && split >= 0;
  const int tile = is_split ? whole_tiles + static_cast<int>(static_cast<unsigned>(split) / params.splits) : index;
  Sm90WorkTile work = sm90_work_tile(params, tile);
  work.split = is_split ? split : -1;
  return work;
}

}  // namespace flashjit::kernels
