// Rules of the FlashAttention-2 forward family (templates/fa2_fwd.cuh).
#include <fmt/format.h>

#include "../family_rules.hpp"
#include "flashjit/codegen/render.hpp"

namespace flashjit::codegen_detail {
namespace {

int smem_bytes(const KernelSpec& s) {
  const int kv_buffers = s.num_stages > 1 ? s.num_stages : 1;
  return (s.block_m + 2 * kv_buffers * s.block_n) * (s.head_dim + 8) * 2;
}

// fp32 accumulator registers per thread: O, S and the running statistics. Above ~200 the rest of
// the kernel (fragments, addresses) no longer fits in 255 registers and ptxas spills.
int accumulator_registers(const KernelSpec& s) {
  const int m_frags = s.block_m / s.num_warps / 16;
  return m_frags * (s.head_dim / 8) * 4 + m_frags * (s.block_n / 8) * 4 + m_frags * 4;
}

std::optional<std::string> validate_tiles(const KernelSpec& s) {
  if (s.num_warps != 4 && s.num_warps != 8)
    return fmt::format("num_warps must be 4 or 8 for fa2_fwd, got {}", s.num_warps);
  if (s.block_m % (16 * s.num_warps) != 0 || s.block_m > 256)
    return fmt::format("block_m must be a multiple of 16 x num_warps ({}) up to 256, got {}",
                       16 * s.num_warps, s.block_m);
  if (s.block_n != 32 && s.block_n != 64 && s.block_n != 128)
    return fmt::format("block_n must be 32, 64 or 128 for fa2_fwd, got {}", s.block_n);
  if (s.num_stages > 3) return fmt::format("num_stages must be 1 to 3, got {}", s.num_stages);
  if (accumulator_registers(s) > 200)
    return fmt::format("{} fp32 accumulators per thread (block_m {} / {} warps, block_n {}, head_dim "
                       "{}) cannot fit in 255 registers", accumulator_registers(s), s.block_m,
                       s.num_warps, s.block_n, s.head_dim);
  if (smem_bytes(s) > max_smem_per_block(s.arch))
    return fmt::format("needs {} bytes of shared memory per block, {} allows {}", smem_bytes(s),
                       s.arch.name(), max_smem_per_block(s.arch));
  return std::nullopt;
}

void set_default_tiles(KernelSpec& s) {
  // Before tuning: the fastest shapes of a sweep on an H200 at seqlen 4096 among those that compile
  // without spills for every mask and softcap (bench/results/fa2_sweep_h200.json). Up to head dim
  // 128, four warps of 32 query rows beat eight warps of 16 rows by 10-30%: each warp re-reads the
  // whole K/V tile from shared memory, so more rows per warp means fewer bytes per FLOP. At 256,
  // 64-row tiles win: two CTAs fit per SM and hide each other's softmax. sm_80 (163 KB) and the
  // 99 KB archs get shapes cut to fit, and to stay spill-free there.
  const int smem = max_smem_per_block(s.arch);
  const bool hopper_smem = smem >= 200 * 1024, small_smem = smem < 160 * 1024;
  auto set = [&](int block_m, int block_n, int warps, int stages) {
    s.block_m = block_m;
    s.block_n = block_n;
    s.num_warps = warps;
    s.num_stages = stages;
  };
  // User modifiers on Hopper's shared memory take eight warps of 16 rows from head dim 128: at four
  // warps of 32 rows (d128) or 16 (d256) a document mask spilled 176 and 20 bytes on sm_90a.
  const bool modified = s.modifier != nullptr || s.block_sparse;
  if (s.head_dim <= 96) {
    set(128, 64, 4, 1);
  } else if (s.head_dim <= 128) {
    hopper_smem ? (modified ? set(128, 64, 8, 2) : set(128, 64, 4, 2)) : set(128, 32, 4, 2);
  } else if (s.head_dim <= 192) {
    small_smem ? set(64, 32, 4, 1) : set(128, 64, 8, 1);
  } else if (hopper_smem) {
    // A window's mask without a softcap spills at 64 keys (ptxas; with the softcap it does not).
    if (modified) set(128, 64, 8, 1);
    else s.mask == MaskKind::window && !s.has_softcap ? set(64, 32, 4, 1) : set(64, 64, 4, 1);
  } else {
    small_smem ? set(64, 32, 4, 1) : set(128, 64, 8, 1);
  }
}

int threads(const KernelSpec& s) { return 32 * s.num_warps; }

std::vector<KernelConstant> constants(const KernelSpec& s) { return {{"kSmemBytes", smem_bytes(s)}}; }

}  // namespace

extern const FamilyRules kFa2FwdRules;
const FamilyRules kFa2FwdRules{
    Family::fa2_fwd,
    "fa2_fwd",
    "fa2_fwd.cuh",
    /*computes_gradients=*/false,
    {{"forward", "flashjit::AttentionFwdParams", "flashjit::kernels::fa2_fwd_kernel", false, "kSmemBytes"}},
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
