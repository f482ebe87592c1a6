// runtime/dispatch: a problem + device -> KernelSpec, over the family table (family.hpp). Never
// times anything; a heuristic answer always exists for a supported problem.
//
// For a pass, the families the backend allows (the automatic backend: those that take part in it,
// in the table's order of preference; a named backend: its families) are tried in order; the first
// that can run the problem here is chosen. A tuning entry keyed by its tuning-key family applies
// when its spec belongs to one of the allowed families that can run the problem; else the chosen
// family's default spec runs. A forced spec (options.kernel) must fit the problem.
#pragma once

#include <vector>

#include "family.hpp"
#include "flashjit/device.hpp"
#include "flashjit/tuning.hpp"
#include "problem.hpp"

namespace flashjit::detail {

// The smallest kernel head dim of `family` that holds `head_dim`.
int kernel_head_dim(Family family, int head_dim);

// The tuning key of a problem for `key_family` (a family's tuning_key).
ProblemKey problem_key(const ForwardProblem& problem, Family key_family);

// Forced spec, else the tuned one (when `tuning` has an entry for this device and problem), else
// the heuristic's. Throws Error naming why when no family of the backend can run the problem.
KernelSpec select_kernel(const PassProblem& problem, const DeviceProperties& device,
                         const TuningSources* tuning = nullptr);
KernelSpec select_forward_kernel(const ForwardProblem& problem, const DeviceProperties& device,
                                 const TuningSources* tuning = nullptr);
KernelSpec select_backward_kernel(const BackwardProblem& problem, const DeviceProperties& device,
                                  const TuningSources* tuning = nullptr);

// What the tuner times for a problem on `arch` (the automatic backend's choice): the candidates of
// every family that can run it and shares the chosen family's tuning key, and the key their winner
// is recorded under.
struct TuningPlan {
  Family family;  // the family dispatch would choose
  ProblemKey key;
  std::vector<KernelSpec> candidates;
};
TuningPlan tuning_plan(const PassProblem& problem, const Arch& arch);

}  // namespace flashjit::detail
