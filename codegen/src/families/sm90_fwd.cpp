// Rules of the Hopper forward family (templates/sm90_fwd.cuh): 128-row query tiles over three
// warpgroups (a TMA producer and two wgmma consumers), K/V tiles of block_n keys in a ring of
// num_stages stages. The shared-memory arithmetic mirrors Sm90FwdShape in the template.
#include <fmt/format.h>

#include "../family_rules.hpp"
#include "flashjit/codegen/render.hpp"

namespace flashjit::codegen_detail {
namespace {

int smem_bytes(const KernelSpec& s) {
  const int panels = s.head_dim / 64;
  const int q_bytes = panels * s.block_m * 128, kv_tile_bytes = panels * s.block_n * 128;
  return 1024 + q_bytes + 2 * s.num_stages * kv_tile_bytes + 8 * (1 + 2 * s.num_stages);
}

std::optional<std::string> validate_tiles(const KernelSpec& s) {
  if (s.num_warps != 12)
    return fmt::format("sm90_fwd runs three warpgroups (a producer and two consumers): num_warps must be 12, got {}",
                       s.num_warps);
  if (s.block_m != 128)
    return fmt::format("sm90_fwd's two consumer warpgroups own 64 rows each: block_m must be 128, got {}", s.block_m);
  if (s.block_n != 64 && s.block_n != 128)
    return fmt::format("block_n must be 64 or 128 for sm90_fwd, got {}", s.block_n);
  if (s.head_dim > 128 && s.block_n != 64)
    return fmt::format("head_dim {} keeps {} fp32 O accumulators per thread; with block_n {} the scores do not fit "
                       "as well (block_n must be 64 above head dim 128)", s.head_dim, s.head_dim / 2, s.block_n);
  if (s.num_stages < 1 || s.num_stages > 4) return fmt::format("num_stages must be 1 to 4, got {}", s.num_stages);
  if (smem_bytes(s) > max_smem_per_block(s.arch))
    return fmt::format("needs {} bytes of shared memory per block, {} allows {}", smem_bytes(s), s.arch.name(),
                       max_smem_per_block(s.arch));
  return std::nullopt;
}

void set_default_tiles(KernelSpec& s) {
  s.num_warps = 12;
  s.block_m = 128;
  s.block_n = s.head_dim <= 128 ? 128 : 64;
  s.num_stages = 2;
}

int threads(const KernelSpec& s) { return 32 * s.num_warps; }

}  // namespace

extern const FamilyRules kSm90FwdRules;
const FamilyRules kSm90FwdRules{
    Family::sm90_fwd,
    "sm90_fwd",
    "sm90_fwd.cuh",
    {{"flashjit_sm90_fwd", "flashjit::AttentionSm90FwdParams", "flashjit::kernels::sm90_fwd_kernel", true}},
    /*min_sm=*/90,
    /*needs_arch_specific=*/true,
    /*head_dims=*/{64, 128, 192, 256},
    /*min_blocks_per_sm=*/1,
    validate_tiles,
    set_default_tiles,
    threads,
    smem_bytes,
};

}  // namespace flashjit::codegen_detail
