// What the autotuner chooses among: every legal spec of a family for one problem class.
#pragma once

#include <vector>

#include "flashjit/codegen/kernel_spec.hpp"

namespace flashjit {

// Legal forward specs (validate() passes) for this arch, dtype, kernel head dim, mask and softcap,
// over the family's tile grid. Specs whose compiled kernel spills are still listed: the caller
// compiles and drops them (only ptxas knows).
std::vector<KernelSpec> forward_candidates(Family family, const Arch& arch, DType dtype, int head_dim,
                                           MaskKind mask, bool has_softcap);

}  // namespace flashjit
