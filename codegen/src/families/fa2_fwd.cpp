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
  // Before tuning: shapes that compile without spills on every arch and fit its shared memory.
  const bool big_smem = max_smem_per_block(s.arch) >= 160 * 1024;
  s.block_m = 128;
  s.block_n = 64;
  s.num_warps = 4;
  s.num_stages = 2;
  if (s.head_dim <= 64) return;
  s.num_warps = 8;  // 16 rows per warp: 4 warps x 32 rows spills at head_dim 128
  if (s.head_dim <= 128) {
    if (!big_smem) s.num_stages = 1;
    return;
  }
  s.num_stages = 1;
  if (!big_smem) {
    s.block_m = 64;
    s.block_n = 32;
    s.num_warps = 4;
  }
}

int threads(const KernelSpec& s) { return 32 * s.num_warps; }

}  // namespace

extern const FamilyRules kFa2FwdRules;
const FamilyRules kFa2FwdRules{
    Family::fa2_fwd,
    "fa2_fwd",
    "fa2_fwd.cuh",
    {{"flashjit_fa2_fwd", "flashjit::AttentionFwdParams", "flashjit::kernels::fa2_fwd_kernel", false}},
    /*min_sm=*/80,
    /*needs_arch_specific=*/false,
    /*head_dims=*/{32, 64, 96, 128, 160, 192, 224, 256},
    /*min_blocks_per_sm=*/1,
    validate_tiles,
    set_default_tiles,
    threads,
    smem_bytes,
};

}  // namespace flashjit::codegen_detail
