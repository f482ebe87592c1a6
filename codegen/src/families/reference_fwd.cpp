// Rules of the reference forward family (templates/reference_fwd.cuh): one query row per warp,
// keys in chunks of 32 (one per lane), so block_m == num_warps and block_n == 32 always.
#include <fmt/format.h>

#include "../family_rules.hpp"

namespace flashjit::codegen_detail {
namespace {

std::optional<std::string> validate_tiles(const KernelSpec& s) {
  if (s.num_warps != 1 && s.num_warps != 2 && s.num_warps != 4 && s.num_warps != 8)
    return fmt::format("num_warps must be 1, 2, 4 or 8 for reference_fwd, got {}", s.num_warps);
  if (s.block_m != s.num_warps)
    return fmt::format("reference_fwd computes one query row per warp, so block_m must equal "
                       "num_warps ({}), got {}", s.num_warps, s.block_m);
  if (s.block_n != 32)
    return fmt::format("reference_fwd scores 32 keys per step (one per lane), so block_n must be "
                       "32, got {}", s.block_n);
  if (s.num_stages != 1)
    return fmt::format("reference_fwd has no shared-memory pipeline, so num_stages must be 1, "
                       "got {}", s.num_stages);
  return std::nullopt;
}

void set_default_tiles(KernelSpec& s) {
  s.num_warps = 4;
  s.block_m = 4;
  s.block_n = 32;
  s.num_stages = 1;
}

int threads(const KernelSpec& s) { return 32 * s.num_warps; }

// The query rows live in static shared memory (fp32, one row per warp): no dynamic smem.
std::vector<KernelConstant> constants(const KernelSpec&) { return {}; }

}  // namespace

extern const FamilyRules kReferenceFwdRules;
const FamilyRules kReferenceFwdRules{
    Family::reference_fwd,
    "reference_fwd",
    "reference_fwd.cuh",
    /*computes_gradients=*/false,
    {{"forward", "flashjit::AttentionFwdParams", "flashjit::kernels::reference_fwd_kernel"}},
    /*min_sm=*/80,
    /*needs_arch_specific=*/false,
    /*head_dims=*/{32, 64, 96, 128, 160, 192, 224, 256},
    validate_tiles,
    set_default_tiles,
    threads,
    constants,
};

}  // namespace flashjit::codegen_detail
