// fa2_bwd at run time: preprocess (delta, the zeroed dQ accumulator) -> dkdv with atomic dQ ->
// convert dQ; or, in deterministic mode, preprocess -> dkdv -> the query-outer dq entry. All on the
// caller's stream. Any layout, any sm_80+ arch, both dQ modes, user modifiers and block masks.
#include "../family.hpp"

namespace flashjit::detail {
namespace {

// Every problem the layers above accept: user modifiers and block masks too, in both dQ modes (their
// GPU tests passed on an H100 at stop 57: the mask examples, ALiBi and softcap with derived
// gradients at head dims 64/128/256, a wrong gradient caught). On sm_90 automatic dispatch prefers
// sm90_bwd where it runs.
std::optional<std::string> unusable_reason(const PassProblem&, const Arch&) { return std::nullopt; }

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
