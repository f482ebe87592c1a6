#include "flashjit/tuning.hpp"

#include "family.hpp"

namespace flashjit {

std::vector<KernelSpec> candidate_specs(Family family, const Arch& arch, DType dtype, int head_dim,
                                        MaskKind mask, bool has_softcap) {
  return detail::runtime_family(family).tuning_candidates(
      default_spec(family, arch, dtype, head_dim, mask, has_softcap));
}

}  // namespace flashjit
