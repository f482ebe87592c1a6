// fa2_fwd at run time: one CTA per block_m query rows of each (head, batch). It runs any layout on
// any sm_80+ arch: the forward wherever a faster family cannot (sm_80/sm_89, or tensors TMA cannot
// read on sm_90), user modifiers and block masks included.
#include "../family.hpp"

namespace flashjit::detail {
namespace {

std::optional<std::string> unusable_reason(const PassProblem&, const Arch&) { return std::nullopt; }

void run(const FamilyCall& call) {
  if (!call.forward().block_sparse) {
    call.launch("forward", query_block_grid(call.forward(), call.spec.block_m), call.forward().params);
    return;
  }
  AttentionFwdParams params = call.forward().params;
  fit_block_mask_to_tiles(params.block_mask, call.spec, /*rows_are_queries=*/true, call.spec.block_m, call.spec.block_n,
                          "forward");
  call.launch("forward", query_block_grid(call.forward(), call.spec.block_m), params);
}

}  // namespace

extern const RuntimeFamily kFa2FwdFamily;
const RuntimeFamily kFa2FwdFamily{Family::fa2_fwd, Pass::forward, Backend::fa2, /*automatic=*/true, Family::fa2_fwd,
                                  unusable_reason, mma_sync_tile_candidates, run};

}  // namespace flashjit::detail
