// fa2_bwd at run time: preprocess (delta, the zeroed dQ accumulator) -> dkdv with atomic dQ ->
// convert dQ; or, in deterministic mode, preprocess -> dkdv -> the query-outer dq entry. All on the
// caller's stream. Any layout, any sm_80+ arch, both dQ modes.
#include "../family.hpp"

namespace flashjit::detail {
namespace {

std::optional<std::string> unusable_reason(const PassProblem&, const Arch&) { return std::nullopt; }

void run(const FamilyCall& call) {
  const BackwardLaunch b(call, call.backward().deterministic ? DqAccumulation::separate : DqAccumulation::atomic);
  if (b.has_queries) call.launch("preprocess", b.query_rows, b.params);
  if (call.backward().deterministic) {
    // Keys no query sees still get dK = dV = 0 from the dkdv entry.
    if (b.has_keys) call.launch("dkdv", b.key_tiles, b.params);
    if (b.has_queries) {
      const Grid query_tiles{blocks(call.forward().seqlen_q, call.layout().constant("kDqBlockM")), b.query_rows.y,
                             b.query_rows.z};
      call.launch("dq", query_tiles, b.params);
    }
  } else {
    if (b.has_keys) call.launch("dkdv_atomic_dq", b.key_tiles, b.params);
    if (b.has_queries) call.launch("convert_dq", b.query_rows, b.params);
  }
}

}  // namespace

extern const RuntimeFamily kFa2BwdFamily;
const RuntimeFamily kFa2BwdFamily{Family::fa2_bwd, Pass::backward, Backend::fa2, /*automatic=*/true, Family::fa2_bwd,
                                  unusable_reason, mma_sync_tile_candidates, run};

}  // namespace flashjit::detail
