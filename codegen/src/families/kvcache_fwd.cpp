// Rules of the KV-cache attention family (templates/kvcache_fwd.cuh): decode, speculative
// verification and prefill against a contiguous or paged cache, split over keys. block_m is the
// packed query rows of one KV head per CTA (queries x the heads of its group), block_n the keys per
// tile, num_stages the K/V ring's buffers. The warps split the rows first, in m16 tiles, and the
// keys with what is left over (a decode tile of 16 rows gives every warp a quarter of each tile).
#include <algorithm>

#include <fmt/format.h>

#include "../family_rules.hpp"
#include "flashjit/codegen/render.hpp"

namespace flashjit::codegen_detail {
namespace {

int row_warps(const KernelSpec& s) { return std::max(1, std::min(s.num_warps, s.block_m / 16)); }

// K's ring and V's ring, each rounded up to 1024 bytes (TMA's swizzle), then Q; rows padded by 8.
int pipeline_bytes(const KernelSpec& s) {
  const int ring = (s.num_stages * s.block_n * (s.head_dim + 8) * 2 + 1023) / 1024 * 1024;
  return 2 * ring + s.block_m * (s.head_dim + 8) * 2;
}

// The key warps' fp32 O rows (padded by 4) and (max, sum) per row, then the CTA's LSE per row (a
// cluster's merge reads it there).
int merge_bytes(const KernelSpec& s) {
  const int key_warps = s.num_warps / row_warps(s);
  return key_warps * s.block_m * (s.head_dim + 4) * 4 + (2 * key_warps + 1) * s.block_m * 4;
}

// sm_90 has one more warp, which feeds the ring with TMA copies (mbarriers, and a base aligned to
// 1024 bytes); sm_80 loads with cp.async from the computing warps.
bool bulk_loads(const KernelSpec& s) { return s.arch.sm >= 90; }

int smem_bytes(const KernelSpec& s) {
  return std::max(pipeline_bytes(s), merge_bytes(s)) + (bulk_loads(s) ? 2 * s.num_stages * 8 + 1024 : 0);
}

// fp32 accumulators per thread: O and S of the warp's rows.
int accumulator_registers(const KernelSpec& s) {
  const int m_frags = s.block_m / row_warps(s) / 16;
  const int warp_keys = s.block_n / (s.num_warps / row_warps(s));
  return m_frags * (s.head_dim / 8) * 4 + m_frags * (warp_keys / 8) * 4;
}

std::optional<std::string> validate_tiles(const KernelSpec& s) {
  if (s.num_warps != 4 && s.num_warps != 8)
    return fmt::format("num_warps must be 4 or 8 for kvcache_fwd, got {}", s.num_warps);
  if (s.block_m != 16 && s.block_m != 32 && s.block_m != 64 && s.block_m != 128)
    return fmt::format("block_m must be 16, 32, 64 or 128 for kvcache_fwd, got {}", s.block_m);
  if (s.block_n != 32 && s.block_n != 64 && s.block_n != 128)
    return fmt::format("block_n must be 32, 64 or 128 for kvcache_fwd, got {}", s.block_n);
  const int most_stages = bulk_loads(s) ? 8 : 4;
  if (s.num_stages < 2 || s.num_stages > most_stages)
    return fmt::format("num_stages must be 2 to {} for kvcache_fwd on {}, got {}", most_stages, s.arch.name(),
                       s.num_stages);
  const int key_warps = s.num_warps / row_warps(s);
  if (s.block_m % (16 * row_warps(s)) != 0 || (s.block_n / key_warps) % 16 != 0)
    return fmt::format("block_m {} x block_n {} does not split over {} warps into m16 rows and k16 keys",
                       s.block_m, s.block_n, s.num_warps);
  // 160 spilled in the cp.async entry (head dim 256 at 64 x 64 with a window, 255 registers).
  if (accumulator_registers(s) > 152)
    return fmt::format("{} fp32 accumulators per thread (block_m {}, block_n {}, {} warps, head_dim {}) "
                       "leave too few of 255 registers (at most 152)", accumulator_registers(s), s.block_m,
                       s.block_n, s.num_warps, s.head_dim);
  if (smem_bytes(s) > max_smem_per_block(s.arch))
    return fmt::format("needs {} bytes of shared memory per block, {} allows {}", smem_bytes(s),
                       s.arch.name(), max_smem_per_block(s.arch));
  return std::nullopt;
}

// The decode tile: 16 packed rows (one query of a group of up to 16 heads, or a few queries of a
// smaller group), four warps over 64-key tiles, three buffers: two CTAs per SM on Hopper and sm_80
// up to head dim 128. Where shared memory is short, fewer buffers, then 32-key tiles (over two key
// warps, so 32 rows). Dispatch widens block_m for longer queries (runtime/src/families).
void set_default_tiles(KernelSpec& s) {
  s.num_warps = 4;
  for (int block_m : {16, 32})
    for (auto [block_n, stages] : {std::pair{64, 3}, {64, 2}, {32, 4}, {32, 3}, {32, 2}}) {
      s.block_m = block_m;
      s.block_n = block_n;
      s.num_stages = stages;
      if (!validate_tiles(s)) return;
    }
}

int threads(const KernelSpec& s) { return 32 * (s.num_warps + (bulk_loads(s) ? 1 : 0)); }

// Whether the attention_tma entry serves: sm_90, head dims in whole 128-byte panels, and room in
// the registers for the swizzled addressing: O plus S counted twice (scores, then P) at most 144
// fp32 per thread (head dim 256 at 32 or 64 rows and 192 at 64 spilled beyond; they keep cp.async).
bool tma_capable(const KernelSpec& s) {
  const int key_warps = s.num_warps / row_warps(s);
  const int m_frags = s.block_m / row_warps(s) / 16;
  return bulk_loads(s) && s.head_dim % 64 == 0 &&
         m_frags * (s.head_dim / 8 + 2 * (s.block_n / key_warps / 8)) * 4 <= 144;
}

// Two CTAs per SM where shared memory holds two and the accumulators leave room (the decode tile up
// to head dim 128 on Hopper), so the registers are held to what two leave: sm_90's five warps at
// 169 registers ran one CTA per SM. 32 rows at head dim 128 (80 accumulators) spilled at that cap.
int min_blocks_per_sm(const KernelSpec& s) {
  const int per_cta = smem_bytes(s) + max_smem_per_sm(s.arch) - max_smem_per_block(s.arch);
  return 2 * per_cta <= max_smem_per_sm(s.arch) && accumulator_registers(s) <= 72 ? 2 : 1;
}

// sm_90 merges up to 16 splits of a row in one thread-block cluster (the non-portable cluster
// size; the runtime asks the driver whether this kernel's clusters of that many fit).
int max_cluster_splits(const KernelSpec& s) { return s.arch.sm >= 90 ? 16 : 0; }

std::vector<KernelConstant> constants(const KernelSpec& s) {
  return {{"kSmemBytes", smem_bytes(s)},
          {"kRowWarps", row_warps(s)},
          {"kTmaCapable", tma_capable(s) ? 1 : 0},
          {"kMaxClusterSplits", max_cluster_splits(s)}};
}

}  // namespace

extern const FamilyRules kKvCacheFwdRules;
const FamilyRules kKvCacheFwdRules{
    Family::kvcache_fwd,
    "kvcache_fwd",
    "kvcache_fwd.cuh",
    /*computes_gradients=*/false,
    {{"append_kv", "flashjit::AttentionKvCacheParams", "flashjit::kernels::kvcache_append_kv_kernel"},
     {"attention", "flashjit::AttentionKvCacheParams", "flashjit::kernels::kvcache_attention_kernel", false,
      "kSmemBytes", "kMaxClusterSplits"},
     {"attention_tma", "flashjit::AttentionKvCacheParams", "flashjit::kernels::kvcache_attention_tma_kernel", true,
      "kSmemBytes", "kMaxClusterSplits"},
     {"combine", "flashjit::AttentionKvCacheParams", "flashjit::kernels::kvcache_combine_kernel"}},
    /*min_sm=*/80,
    /*needs_arch_specific=*/false,
    /*head_dims=*/{32, 64, 96, 128, 160, 192, 224, 256},
    validate_tiles,
    set_default_tiles,
    threads,
    constants,
    /*config_members=*/nullptr,
    min_blocks_per_sm,
};

}  // namespace flashjit::codegen_detail
