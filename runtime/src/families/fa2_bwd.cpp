// fa2_bwd at run time: preprocess (delta, the zeroed dQ accumulator) -> dkdv with atomic dQ ->
// convert dQ; or, in deterministic mode, preprocess -> dkdv -> the query-outer dq entry. All on the
// caller's stream. Any layout, any sm_80+ arch, both dQ modes, user modifiers and block masks.
#include "../family.hpp"

namespace flashjit::detail {
namespace {

// User modifiers and block masks compile into fa2_bwd and pass the CPU's checks (no spills) but
// have not yet run on a device: backend=fa2 (or a forced spec) runs them, as the GPU tests do, and
// automatic dispatch leaves them to sm90_bwd (sm_90) until a device run has passed.
std::optional<std::string> unusable_reason(const PassProblem& problem, const Arch&) {
  const ForwardProblem& f = problem.forward;
  const bool automatic = f.backend == Backend::automatic && !f.forced_kernel;
  if (automatic && (f.modifier != nullptr || f.block_sparse))
    return std::string("fa2_bwd's kernels with user modifiers and block masks await a device run: backend=fa2 runs "
                       "them; automatic dispatch runs the backward of mod and block_mask on sm90_bwd (an sm_90 device, "
                       "in deterministic mode without a block mask)");
  return std::nullopt;
}

// Under a block mask, its lists fitted to the entries' tiles: dkdv walks the transposed lists (key
// tiles of block_n, query steps of block_m), the deterministic dq entry the forward's (query tiles
// of kDqBlockM, key tiles of kDqBlockN).
AttentionBwdParams with_fitted_block_mask(const FamilyCall& call, AttentionBwdParams params) {
  if (!call.forward().block_sparse) return params;
  const KernelSpec& spec = call.spec;
  fit_block_mask_to_tiles(params.transposed_block_mask, spec, /*rows_are_queries=*/false, spec.block_n, spec.block_m,
                          "backward");
  if (call.backward().deterministic)
    fit_block_mask_to_tiles(params.fwd.block_mask, spec, /*rows_are_queries=*/true, call.layout().constant("kDqBlockM"),
                            call.layout().constant("kDqBlockN"), "backward");
  return params;
}

void run(const FamilyCall& call) {
  const BackwardLaunch b(call, call.backward().deterministic ? DqAccumulation::separate : DqAccumulation::atomic);
  const AttentionBwdParams params = with_fitted_block_mask(call, b.params);
  if (b.has_queries) call.launch("preprocess", b.query_rows, params);
  if (call.backward().deterministic) {
    // Keys no query sees still get dK = dV = 0 from the dkdv entry.
    if (b.has_keys) call.launch("dkdv", b.key_tiles, params);
    if (b.has_queries) {
      const Grid query_tiles{blocks(call.forward().seqlen_q, call.layout().constant("kDqBlockM")), b.query_rows.y,
                             b.query_rows.z};
      call.launch("dq", query_tiles, params);
    }
  } else {
    if (b.has_keys) call.launch("dkdv_atomic_dq", b.key_tiles, params);
    if (b.has_queries) call.launch("convert_dq", b.query_rows, params);
  }
}

}  // namespace

extern const RuntimeFamily kFa2BwdFamily;
const RuntimeFamily kFa2BwdFamily{Family::fa2_bwd, Pass::backward, Backend::fa2, /*automatic=*/true, Family::fa2_bwd,
                                  unusable_reason, mma_sync_tile_candidates, run};

}  // namespace flashjit::detail
