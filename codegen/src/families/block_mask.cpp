// Rules of the block mask builder (templates/block_mask.cuh): block_m x block_n are the block
// mask's query and key block sizes, num_warps the tiles (rows, columns) a CTA takes at once. It
// reads no attention tensors: dtype is unused and head_dim is 0.
#include <fmt/format.h>

#include "../family_rules.hpp"

namespace flashjit::codegen_detail {
namespace {

std::optional<std::string> validate_tiles(const KernelSpec& s) {
  if (s.block_m < 1 || s.block_m > 4096 || s.block_n < 1 || s.block_n > 4096)
    return fmt::format("block mask block sizes must be 1 to 4096, got ({}, {})", s.block_m, s.block_n);
  if (s.num_warps != 4 && s.num_warps != 8)
    return fmt::format("num_warps must be 4 or 8 for block_mask, got {}", s.num_warps);
  if (s.num_stages != 1) return fmt::format("num_stages must be 1 for block_mask, got {}", s.num_stages);
  if (s.mask != MaskKind::none || s.has_softcap || s.block_sparse)
    return std::string("block_mask takes its mask from the modifier alone (no mask kind, softcap or block mask)");
  return std::nullopt;
}

void set_default_tiles(KernelSpec& s) {
  s.block_m = s.block_n = 128;  // FlexAttention's default block; callers set their own
  s.num_warps = 8;
  s.num_stages = 1;
}

int threads(const KernelSpec& s) { return 32 * s.num_warps; }

std::vector<KernelConstant> constants(const KernelSpec&) { return {}; }

}  // namespace

extern const FamilyRules kBlockMaskRules;
const FamilyRules kBlockMaskRules{
    Family::block_mask,
    "block_mask",
    "block_mask.cuh",
    /*computes_gradients=*/false,
    {{"classify", "flashjit::BlockMaskParams", "flashjit::kernels::block_mask_classify_kernel"},
     {"rows", "flashjit::BlockMaskParams", "flashjit::kernels::block_mask_rows_kernel"},
     {"columns", "flashjit::BlockMaskParams", "flashjit::kernels::block_mask_columns_kernel"}},
    /*min_sm=*/80,
    /*needs_arch_specific=*/false,
    /*head_dims=*/{0},
    validate_tiles,
    set_default_tiles,
    threads,
    constants,
    /*config_members=*/nullptr,
    /*min_blocks_per_sm=*/nullptr,
    /*takes_modifiers=*/true,
    /*takes_block_mask=*/false,
};

}  // namespace flashjit::codegen_detail
