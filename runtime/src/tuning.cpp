#include "flashjit/tuning.hpp"

namespace flashjit {

std::vector<KernelSpec> candidate_specs(Family family, const Arch& arch, DType dtype, int head_dim,
                                           MaskKind mask, bool has_softcap) {
  std::vector<KernelSpec> candidates;
  const KernelSpec base = default_spec(family, arch, dtype, head_dim, mask, has_softcap);
  if (family == Family::reference_fwd) return {base};
  for (int block_m : {32, 64, 128, 256})
    for (int block_n : {32, 64, 128})
      for (int warps : {4, 8})
        for (int stages : {1, 2, 3}) {
          KernelSpec s = base;
          s.block_m = block_m;
          s.block_n = block_n;
          s.num_warps = warps;
          s.num_stages = stages;
          if (!s.validate()) candidates.push_back(s);
        }
  return candidates;
}

}  // namespace flashjit
