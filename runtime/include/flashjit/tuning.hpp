// What the autotuner chooses among: every legal spec of a family for one problem class.
#pragma once

#include <vector>

#include "flashjit/codegen/kernel_spec.hpp"

namespace flashjit {

// Legal specs of a family (validate() passes) for this arch, dtype, kernel head dim, mask and
// softcap, over the tile grid block_m 32..256, block_n 32..128, 4 or 8 warps, 1 to 3 stages. Specs
// whose compiled kernel spills are still listed: the caller compiles and drops them (only ptxas
// knows).
std::vector<KernelSpec> candidate_specs(Family family, const Arch& arch, DType dtype, int head_dim,
                                           MaskKind mask, bool has_softcap);

}  // namespace flashjit
