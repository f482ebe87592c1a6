// Block mask builder: FlexAttention's block lists from a mask modifier, on the GPU.
//   classify: one warp per (query block, key block) tile evaluates the mask on its elements, 32
//   keys at a time (one per lane), 8 rows at a time, and stops as soon as the tile has both a
//   visible and a hidden element (partly visible); else it is empty or fully visible. Elements past the
//   sequence do not count (the attention kernels hide them anyway).
//   rows / columns: one warp per map row (column) compacts its tiles, 32 at a time with ballots,
//   into ascending id lists of the partly and the fully visible ones, with their counts.
//   Grid: classify (ceil(kv_blocks / warps), q_blocks, batch * heads); rows (ceil(q_blocks /
//   warps), batch * heads); columns (ceil(kv_blocks / warps), batch * heads). No shared memory.
//   Preconditions: the extents in BlockMaskParams; tile_map written before rows and columns read it.
#pragma once

#include "common/modifiers.cuh"

namespace flashjit::kernels {

template <class Config>
__device__ void block_mask_classify_kernel(const BlockMaskParams& params) {
  using Mods = typename ModifiersOf<Config>::type;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN;
  const AttentionFwdParams& p = params.fwd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kv_block = blockIdx.x * Config::kNumWarps + warp, q_block = blockIdx.y;
  if (kv_block >= params.kv_blocks) return;
  const int batch = blockIdx.z / p.num_heads_q, head = blockIdx.z % p.num_heads_q;
  const int q_end = min(p.seqlen_q, (q_block + 1) * kBlockM), kv_end = min(p.seqlen_k, (kv_block + 1) * kBlockN);
  // Rows in chunks of kRowChunk, each lane's columns (lane + 32 j) across the chunk: what the mask
  // loads per key (a document id, say) is loaded once per chunk, not once per row.
  constexpr int kRowChunk = 8;
  bool any_visible = false, any_hidden = false;
  for (int q0 = q_block * kBlockM; q0 < q_end; q0 += kRowChunk) {
#pragma unroll 4
    for (int kv_idx = kv_block * kBlockN + lane; kv_idx < kv_end; kv_idx += 32) {
#pragma unroll
      for (int r = 0; r < kRowChunk; ++r) {
        if (q0 + r >= q_end) break;
        const bool visible = Mods::mask(p, batch, head, q0 + r, kv_idx);
        any_visible = any_visible || visible;
        any_hidden = any_hidden || !visible;
      }
    }
    if (__any_sync(0xffffffffu, any_visible) && __any_sync(0xffffffffu, any_hidden)) break;
  }
  any_visible = __any_sync(0xffffffffu, any_visible);
  any_hidden = __any_sync(0xffffffffu, any_hidden);
  if (lane == 0)
    params.tile_map[(static_cast<long long>(blockIdx.z) * params.q_blocks + q_block) * params.kv_blocks + kv_block] =
        !any_visible ? 0 : any_hidden ? kTilePartial : kTileFull;
}

// One warp compacts `count` states (`stride` apart from `states`) into the partial and full lists.
__device__ __forceinline__ void compact_tile_states(const unsigned char* states, long long stride, int count, int lane,
                                                    int* partial_count, int* partial_ids, int* full_count,
                                                    int* full_ids) {
  int partial = 0, full = 0;
  for (int base = 0; base < count; base += 32) {
    const int id = base + lane;
    const int state = id < count ? states[id * stride] : 0;
    const unsigned partial_votes = __ballot_sync(0xffffffffu, state == kTilePartial);
    const unsigned full_votes = __ballot_sync(0xffffffffu, state == kTileFull);
    const unsigned below = (1u << lane) - 1u;
    if (state == kTilePartial) partial_ids[partial + __popc(partial_votes & below)] = id;
    if (state == kTileFull) full_ids[full + __popc(full_votes & below)] = id;
    partial += __popc(partial_votes);
    full += __popc(full_votes);
  }
  if (lane == 0) {
    *partial_count = partial;
    *full_count = full;
  }
}

template <class Config>
__device__ void block_mask_rows_kernel(const BlockMaskParams& params) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int q_block = blockIdx.x * Config::kNumWarps + warp;
  if (q_block >= params.q_blocks) return;
  const long long row = static_cast<long long>(blockIdx.y) * params.q_blocks + q_block;
  compact_tile_states(params.tile_map + row * params.kv_blocks, 1, params.kv_blocks, lane, params.kv_num_blocks + row,
                      params.kv_indices + row * params.kv_blocks, params.full_kv_num_blocks + row,
                      params.full_kv_indices + row * params.kv_blocks);
}

template <class Config>
__device__ void block_mask_columns_kernel(const BlockMaskParams& params) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kv_block = blockIdx.x * Config::kNumWarps + warp;
  if (kv_block >= params.kv_blocks) return;
  const long long column = static_cast<long long>(blockIdx.y) * params.kv_blocks + kv_block;
  const unsigned char* states = params.tile_map + static_cast<long long>(blockIdx.y) * params.q_blocks * params.kv_blocks +
                                kv_block;
  compact_tile_states(states, params.kv_blocks, params.q_blocks, lane, params.q_num_blocks + column,
                      params.q_indices + column * params.q_blocks, params.full_q_num_blocks + column,
                      params.full_q_indices + column * params.q_blocks);
}

}  // namespace flashjit::kernels
