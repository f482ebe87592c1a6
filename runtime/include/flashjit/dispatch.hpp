// What dispatch would choose without timing anything, for tools that prepare kernels ahead of
// time (flashjit-warm's presets) on machines with no GPU.
#pragma once

#include <vector>

#include "flashjit/codegen/kernel_spec.hpp"

namespace flashjit {

// The forward spec the heuristic picks on `arch` for this dtype, problem head dim and mask.
KernelSpec heuristic_forward_spec(const Arch& arch, DType dtype, int head_dim, MaskKind mask,
                                  bool has_softcap = false);

// The same for the backward: sm90_bwd where it has a kernel of the head dim on sm_90a, else fa2_bwd;
// `deterministic` for deterministic mode's (sm90_bwd's with ordered dQ adds, or fa2_bwd).
KernelSpec heuristic_backward_spec(const Arch& arch, DType dtype, int head_dim, MaskKind mask,
                                   bool has_softcap = false, bool deterministic = false);

// The kvcache_fwd specs forward_kvcache's heuristic picks on `arch`: the decode tile (up to 16
// packed query rows per KV head), and the taller ones of longer queries or larger GQA groups (32,
// then 64 rows: speculative verification, chunked prefill). Each spec once.
std::vector<KernelSpec> heuristic_kvcache_specs(const Arch& arch, DType dtype, int head_dim, MaskKind mask,
                                                bool has_softcap = false);

// The bundled tuning database's winners of the same kind as `heuristic` (family, arch, dtype,
// kernel head dim, mask, softcap): what dispatch runs instead of it on the GPUs the database was
// tuned on, for some sequence lengths and batch sizes. Each spec once, in database order.
std::vector<KernelSpec> bundled_tuned_specs(const KernelSpec& heuristic);

}  // namespace flashjit
