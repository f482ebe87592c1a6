#include "flashjit/tuning.hpp"

namespace flashjit {

std::vector<KernelSpec> candidate_specs(Family family, const Arch& arch, DType dtype, int head_dim,
                                           MaskKind mask, bool has_softcap) {
  std::vector<KernelSpec> candidates;
  const KernelSpec base = default_spec(family, arch, dtype, head_dim, mask, has_softcap);
  if (family == Family::reference_fwd) return {base};
  if (family == Family::sm90_bwd) {  // the tile is fixed by the head dim (see sm90_bwd.cuh); the ring's depth varies
    for (int stages : {2, 3}) {
      KernelSpec s = base;
      s.num_stages = stages;
      if (!s.validate()) candidates.push_back(s);
    }
    return candidates;
  }
  if (family == Family::sm90_fwd) {
    // 64-row consumer warpgroups (two or three), key tiles in 16-key steps; validate() drops what
    // the registers or shared memory cannot hold.
    for (int block_m : {128, 192})
      for (int block_n = 64; block_n <= 256; block_n += 16)
        for (int stages : {2, 3}) {
          KernelSpec s = base;
          s.block_m = block_m;
          s.block_n = block_n;
          s.num_warps = 4 * (1 + block_m / 64);
          s.num_stages = stages;
          if (!s.validate()) candidates.push_back(s);
        }
    return candidates;
  }
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

std::vector<KernelSpec> backward_candidate_specs(const Arch& arch, DType dtype, int head_dim, MaskKind mask,
                                                 bool has_softcap) {
  std::vector<KernelSpec> candidates = candidate_specs(Family::fa2_bwd, arch, dtype, head_dim, mask, has_softcap);
  if (family_covers(Family::sm90_bwd, arch, head_dim))
    for (const KernelSpec& s : candidate_specs(Family::sm90_bwd, arch, dtype, head_dim, mask, has_softcap))
      candidates.push_back(s);
  return candidates;
}

}  // namespace flashjit
