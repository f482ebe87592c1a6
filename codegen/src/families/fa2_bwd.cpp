// Rules of the FlashAttention-2 backward family (templates/fa2_bwd.cuh). block_m is the query step
// of the K/V-outer loop, block_n the keys one CTA owns, num_stages the Q/dO buffers (1 or 2). The
// warp layout and shared-memory arithmetic mirror Fa2BwdShape in the template.
#include <algorithm>
#include <tuple>

#include <fmt/format.h>

#include "../family_rules.hpp"
#include "flashjit/codegen/render.hpp"

namespace flashjit::codegen_detail {
namespace {

// One GEMM output's split over the warps, as WarpGrid in the template: the power-of-two split
// into whole 16 x 16 tiles that minimises each warp's rows + cols (rows == 0: none fits).
struct WarpTile {
  int rows = 0, cols = 0;
};

WarpTile balanced_warp_tile(int rows, int cols, int warps) {
  WarpTile best;
  int best_cost = 1 << 30;
  for (int row_warps = 1; row_warps <= warps; row_warps *= 2) {
    const int col_warps = warps / row_warps;
    if (rows % (16 * row_warps) != 0 || cols % (16 * col_warps) != 0) continue;
    const int cost = rows / row_warps + cols / col_warps;
    if (cost < best_cost) {
      best = {rows / row_warps, cols / col_warps};
      best_cost = cost;
    }
  }
  return best;
}

// The deterministic dq kernel's Q and dO (block_m rows), K and V (block_n rows), single-buffered.
int dq_tile_smem_bytes(const KernelSpec& s, int block_m, int block_n) {
  return 2 * (block_m + block_n) * (s.head_dim + 8) * 2;
}

struct BwdLayout {
  WarpTile scores, kv_grads, dq;  // S^T/dP^T (keys x queries), dK/dV (keys x dims), dQ (queries x dims)
  int dq_chunk_frags;             // n8 tiles of dQ accumulated at a time in dkdv_atomic_dq
  int dq_block_m, dq_block_n;     // the deterministic dq kernel's tile
};

// dQ's n8 tiles per chunk: the largest even divisor of the warp's tiles up to 8 (64 dims; n8 tiles
// are loaded in pairs), halved while dK, dV and the chunk exceed the accumulator budget. Four warps
// keep more per-thread state besides: at 192 (head dim 256, 32 x 32 tiles on the 99 KB archs) ptxas
// spills there, which eight warps do not.
int dq_chunk_frags(const KernelSpec& s, const WarpTile& kv_grads, const WarpTile& dq) {
  const int frags = dq.cols / 8;
  int chunk = frags;
  for (int c = 8; c >= 2; c -= 2)
    if (frags % c == 0) {
      chunk = c;
      break;
    }
  const int budget = s.num_warps == 4 ? 160 : 192;
  const int kv_accumulators = 2 * kv_grads.rows * kv_grads.cols / 32;
  while (chunk % 4 == 0 && kv_accumulators + dq.rows * chunk * 8 / 32 > budget) chunk /= 2;
  return chunk;
}

BwdLayout layout(const KernelSpec& s) {
  BwdLayout l;
  l.scores = balanced_warp_tile(s.block_n, s.block_m, s.num_warps);
  l.kv_grads = balanced_warp_tile(s.block_n, s.head_dim, s.num_warps);
  l.dq = balanced_warp_tile(s.block_m, s.head_dim, s.num_warps);
  l.dq_chunk_frags = dq_chunk_frags(s, l.kv_grads, l.dq);
  l.dq_block_m = 16 * s.num_warps;
  l.dq_block_n = s.head_dim > 192 ? 16 : s.head_dim > 128 ? 32 : 64;
  // Fewer keys per step where Q, dO, K and V would not fit (eight warps on the 99 KB archs).
  while (l.dq_block_n > 16 && dq_tile_smem_bytes(s, l.dq_block_m, l.dq_block_n) > max_smem_per_block(s.arch))
    l.dq_block_n /= 2;
  return l;
}

int dkdv_smem_bytes(const KernelSpec& s) {
  const int row_bytes = (s.head_dim + 8) * 2;
  return 2 * s.block_n * row_bytes + 2 * s.num_stages * s.block_m * row_bytes +
         2 * s.block_n * (s.block_m + 8) * 2 + 2 * s.num_stages * s.block_m * 4;
}

int dq_smem_bytes(const KernelSpec& s) {
  const BwdLayout l = layout(s);
  return dq_tile_smem_bytes(s, l.dq_block_m, l.dq_block_n);
}

int smem_bytes(const KernelSpec& s) { return std::max(dkdv_smem_bytes(s), dq_smem_bytes(s)); }

// Peak fp32 accumulators per thread: dK and dV live through the loop; S^T and dP^T, or the dQ
// tile, come on top. The deterministic dq kernel holds dQ, S and dP for 16 rows.
int accumulator_registers(const KernelSpec& s) {
  const BwdLayout l = layout(s);
  const int dkdv = 2 * l.kv_grads.rows * l.kv_grads.cols / 32;
  const int scores = 2 * l.scores.rows * l.scores.cols / 32;
  const int dq = l.dq.rows * l.dq_chunk_frags * 8 / 32;
  const int dq_kernel = 16 * s.head_dim / 32 + 2 * 16 * l.dq_block_n / 32;
  return std::max(dkdv + std::max(scores, dq), dq_kernel);
}

std::optional<std::string> validate_tiles(const KernelSpec& s) {
  if (s.num_warps != 4 && s.num_warps != 8)
    return fmt::format("num_warps must be 4 or 8 for fa2_bwd, got {}", s.num_warps);
  if (s.block_m != 32 && s.block_m != 64 && s.block_m != 128)
    return fmt::format("block_m must be 32, 64 or 128 for fa2_bwd, got {}", s.block_m);
  if (s.block_n != 32 && s.block_n != 64 && s.block_n != 128)
    return fmt::format("block_n must be 32, 64 or 128 for fa2_bwd, got {}", s.block_n);
  if (s.num_stages > 2) return fmt::format("num_stages must be 1 or 2 for fa2_bwd, got {}", s.num_stages);
  const BwdLayout l = layout(s);
  for (auto [tile, what, rows, cols] : {std::tuple{l.scores, "S^T (block_n x block_m)", s.block_n, s.block_m},
                                        {l.kv_grads, "dK/dV (block_n x head_dim)", s.block_n, s.head_dim},
                                        {l.dq, "dQ (block_m x head_dim)", s.block_m, s.head_dim}})
    if (tile.rows == 0)
      return fmt::format("{} = {} x {} does not split over {} warps into whole 16 x 16 tiles", what, rows,
                         cols, s.num_warps);
  if (accumulator_registers(s) > 200)
    return fmt::format("{} fp32 accumulators per thread (block_m {}, block_n {}, {} warps, head_dim {}) "
                       "cannot fit in 255 registers", accumulator_registers(s), s.block_m, s.block_n,
                       s.num_warps, s.head_dim);
  if (smem_bytes(s) > max_smem_per_block(s.arch))
    return fmt::format("needs {} bytes of shared memory per block, {} allows {}", smem_bytes(s),
                       s.arch.name(), max_smem_per_block(s.arch));
  return std::nullopt;
}

void set_default_tiles(KernelSpec& s) {
  // The fastest spill-free shapes of a sweep on an H200 at seqlen 4096 (bench/results/
  // fa2_bwd_sweep_h200.json): up to head dim 64, four warps over 128 keys with 32-query steps
  // (64-key tiles when masked, where short rows waste the long tile); eight warps over 128 keys
  // at 128, 64 keys above. Hopper's shared memory double-buffers Q and dO (not with softcap at
  // 128, which then spills); sm_80 single-buffers; the 99 KB archs get the smallest tiles, with
  // eight warps from head dim 96 (four spill there). User modifiers and block masks take the masked
  // tiles, and 64 keys at 128 too: their per-element work (side-tensor loads, a score and its
  // derivative) spilled 4-16 bytes in 128-key tiles there (a document mask, a tanh score), and 932
  // in 32 x 128 ones at 64 (ALiBi beside causal).
  const bool modified = s.modifier != nullptr || s.block_sparse;
  const int smem = max_smem_per_block(s.arch);
  const bool hopper_smem = smem >= 200 * 1024, small_smem = smem < 160 * 1024;
  auto set = [&](int block_m, int block_n, int warps, int stages) {
    s.block_m = block_m;
    s.block_n = block_n;
    s.num_warps = warps;
    s.num_stages = stages;
  };
  if (small_smem) {
    s.head_dim <= 64 ? set(64, 64, 4, 1) : s.head_dim <= 128 ? set(64, 64, 8, 1) : set(32, 32, 4, 1);
  } else if (s.head_dim <= 64) {
    s.mask == MaskKind::none && !modified ? set(32, 128, 4, 1) : set(64, 64, 4, 1);
  } else if (s.head_dim <= 96) {
    set(64, 64, 8, hopper_smem ? 2 : 1);
  } else if (s.head_dim <= 128) {
    modified ? set(64, 64, 8, hopper_smem ? 2 : 1) : set(64, 128, 8, hopper_smem && !s.has_softcap ? 2 : 1);
  } else {
    set(64, 64, 8, hopper_smem ? 2 : 1);
  }
}

int threads(const KernelSpec& s) { return 32 * s.num_warps; }

// The row passes (preprocess, convert_dq) use no shared memory; the deterministic dq entry runs
// its own tile (kDqBlockM x kDqBlockN), which the runtime sizes its grid by.
std::vector<KernelConstant> constants(const KernelSpec& s) {
  const BwdLayout l = layout(s);
  return {{"kDkdvSmemBytes", dkdv_smem_bytes(s)},
          {"kDqSmemBytes", dq_smem_bytes(s)},
          {"kDqChunkFrags", l.dq_chunk_frags},
          {"kDqBlockM", l.dq_block_m},
          {"kDqBlockN", l.dq_block_n}};
}

}  // namespace

extern const FamilyRules kFa2BwdRules;
const FamilyRules kFa2BwdRules{
    Family::fa2_bwd,
    "fa2_bwd",
    "fa2_bwd.cuh",
    /*computes_gradients=*/true,
    {{"preprocess", "flashjit::AttentionBwdParams", "flashjit::kernels::fa2_bwd_preprocess_kernel"},
     {"dkdv_atomic_dq", "flashjit::AttentionBwdParams", "flashjit::kernels::fa2_bwd_dkdv_atomic_dq_kernel", false,
      "kDkdvSmemBytes"},
     {"dkdv", "flashjit::AttentionBwdParams", "flashjit::kernels::fa2_bwd_dkdv_kernel", false, "kDkdvSmemBytes"},
     {"dq", "flashjit::AttentionBwdParams", "flashjit::kernels::fa2_bwd_dq_kernel", false, "kDqSmemBytes"},
     {"convert_dq", "flashjit::AttentionBwdParams", "flashjit::kernels::fa2_bwd_convert_dq_kernel"}},
    /*min_sm=*/80,
    /*needs_arch_specific=*/false,
    /*head_dims=*/{32, 64, 96, 128, 160, 192, 224, 256},
    validate_tiles,
    set_default_tiles,
    threads,
    constants,
    /*config_members=*/nullptr,
    /*min_blocks_per_sm=*/nullptr,
    /*takes_modifiers=*/true,
    /*takes_block_mask=*/true,
};

}  // namespace flashjit::codegen_detail
