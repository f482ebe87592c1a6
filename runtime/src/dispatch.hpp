// runtime/dispatch: ForwardProblem + device -> KernelSpec. Never times anything; a heuristic
// answer always exists for a supported problem.
#pragma once

#include "flashjit/device.hpp"
#include "problem.hpp"

namespace flashjit::detail {

// The smallest kernel head dim of `family` that holds `head_dim`.
int kernel_head_dim(Family family, int head_dim);

KernelSpec select_forward_kernel(const ForwardProblem& problem, const DeviceProperties& device);

// The fa2_bwd spec for a backward problem (`problem` is the backward's forward part).
KernelSpec select_backward_kernel(const ForwardProblem& problem, const DeviceProperties& device);

}  // namespace flashjit::detail
