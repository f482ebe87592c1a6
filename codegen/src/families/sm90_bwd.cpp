// Rules of the Hopper backward family (templates/sm90_bwd.cuh): 128 keys per CTA over a producer
// warpgroup and two wgmma consumer warpgroups, query steps of block_m = 64 in a ring of num_stages.
// The shared-memory arithmetic mirrors Sm90BwdShape in the template.
#include <fmt/format.h>

#include "../family_rules.hpp"
#include "../wgmma.hpp"
#include "flashjit/codegen/render.hpp"

namespace flashjit::codegen_detail {
namespace {

int consumers(const KernelSpec& s) { return s.block_n / 64; }
int panels(const KernelSpec& s) { return s.head_dim / 64; }

int smem_bytes(const KernelSpec& s) {
  const int kv_tile = panels(s) * s.block_n * 128, step_tile = panels(s) * s.block_m * 128;
  const int ds = s.block_n * s.block_m * 2, rows = s.num_stages * s.block_m * 4;
  return 1024 + 2 * kv_tile + 2 * s.num_stages * step_tile + 2 * ds + 2 * rows + 8 * (1 + 2 * s.num_stages);
}

std::optional<std::string> validate_tiles(const KernelSpec& s) {
  if (s.block_m != 64)
    return fmt::format("sm90_bwd walks the queries in steps of 64 (one swizzled row of dS^T): block_m must be 64, "
                       "got {}", s.block_m);
  if (s.block_n != 128)
    return fmt::format("sm90_bwd runs two consumer warpgroups of 64 keys: block_n must be 128, got {}", s.block_n);
  if (s.num_warps != 4 * (1 + consumers(s)))
    return fmt::format("sm90_bwd runs a producer warpgroup and {} consumers for block_n {}: num_warps must be {}, "
                       "got {}", consumers(s), s.block_n, 4 * (1 + consumers(s)), s.num_warps);
  if (s.num_stages < 2 || s.num_stages > 3)
    return fmt::format("num_stages must be 2 or 3 for sm90_bwd (one query step computes while the next loads), "
                       "got {}", s.num_stages);
  if (smem_bytes(s) > max_smem_per_block(s.arch))
    return fmt::format("needs {} bytes of shared memory per block, {} allows {}", smem_bytes(s), s.arch.name(),
                       max_smem_per_block(s.arch));
  return std::nullopt;
}

void set_default_tiles(KernelSpec& s) {
  s.block_m = 64;
  s.block_n = 128;
  s.num_warps = 4 * (1 + consumers(s));
  s.num_stages = 2;
}

int threads(const KernelSpec& s) { return 32 * s.num_warps; }

// S^T and dP^T (64 keys x block_m queries, both operands K-major in shared memory); dK and dV
// (64 keys x head_dim, P^T and dS^T from registers); dQ (block_m queries x 64 columns, dS^T and K
// both MN-major in shared memory).
std::string config_members(const KernelSpec& s) {
  return wgmma_member_function("wgmma_scores", s.block_m, s.dtype, WgmmaOperands::ss_k_major) +
         wgmma_member_function("wgmma_key_gradient", s.head_dim, s.dtype, WgmmaOperands::rs_b_mn_major) +
         wgmma_member_function("wgmma_dq", 64, s.dtype, WgmmaOperands::ss_mn_major);
}

}  // namespace

extern const FamilyRules kSm90BwdRules;
const FamilyRules kSm90BwdRules{
    Family::sm90_bwd,
    "sm90_bwd",
    "sm90_bwd.cuh",
    {{"flashjit_sm90_bwd_preprocess", "flashjit::AttentionSm90BwdParams", "flashjit::kernels::sm90_bwd_preprocess_kernel", true},
     {"flashjit_sm90_bwd_dkdv_atomic_dq", "flashjit::AttentionSm90BwdParams",
      "flashjit::kernels::sm90_bwd_dkdv_atomic_dq_kernel", true},
     {"flashjit_sm90_bwd_convert_dq", "flashjit::AttentionSm90BwdParams", "flashjit::kernels::sm90_bwd_convert_dq_kernel",
      true}},
    /*min_sm=*/90,
    /*needs_arch_specific=*/true,
    /*head_dims=*/{64, 128},
    /*min_blocks_per_sm=*/1,
    validate_tiles,
    set_default_tiles,
    threads,
    smem_bytes,
    /*entry_smem_bytes=*/nullptr,
    config_members,
};

}  // namespace flashjit::codegen_detail
