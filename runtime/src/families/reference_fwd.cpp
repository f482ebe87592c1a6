// reference_fwd at run time: the fp32-math oracle, one CTA per block_m query rows. Only asked for by
// name (Backend::reference); nothing to tune, as its tile is fixed.
#include "../family.hpp"

namespace flashjit::detail {
namespace {

std::optional<std::string> unusable_reason(const PassProblem&, const Arch&) { return std::nullopt; }

std::vector<KernelSpec> tuning_candidates(const KernelSpec& base) { return {base}; }

void run(const FamilyCall& call) {
  call.launch("forward", query_block_grid(call.forward(), call.spec.block_m), call.forward().params);
}

}  // namespace

extern const RuntimeFamily kReferenceFwdFamily;
const RuntimeFamily kReferenceFwdFamily{Family::reference_fwd, Pass::forward, Backend::reference, /*automatic=*/false,
                                        Family::reference_fwd, unusable_reason, tuning_candidates, run};

}  // namespace flashjit::detail
