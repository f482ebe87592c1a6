#include "dispatch.hpp"

#include "flashjit/dispatch.hpp"

#include <fmt/format.h>

namespace flashjit {
namespace detail {

int kernel_head_dim(Family family, int head_dim) {
  // Every family's kernels come in multiples of 32 up to 256.
  (void)family;
  const int rounded = (head_dim + 31) / 32 * 32;
  if (rounded > 256)
    throw Error(ErrorCode::unsupported, "dispatch", fmt::format("head_dim {} is over 256", head_dim));
  return rounded;
}

namespace {

KernelSpec select_for_arch(const ForwardProblem& problem, const Arch& arch) {
  Family family = Family::reference_fwd;  // the only forward family so far
  switch (problem.backend) {
    case Backend::automatic: break;
    case Backend::reference: family = Family::reference_fwd; break;
  }
  return default_spec(family, arch, problem.dtype, kernel_head_dim(family, problem.head_dim),
                      problem.mask, problem.has_softcap);
}

}  // namespace

KernelSpec select_forward_kernel(const ForwardProblem& problem, const DeviceProperties& device) {
  const Arch arch = device.arch();
  if (arch.sm < 80)
    throw Error(ErrorCode::unsupported, "dispatch",
                fmt::format("device {} ({}) is sm_{}; flashjit needs sm_80 or newer", device.ordinal,
                            device.name, arch.sm));
  return select_for_arch(problem, arch);
}

}  // namespace detail

KernelSpec heuristic_forward_spec(const Arch& arch, DType dtype, int head_dim, MaskKind mask,
                                  bool has_softcap) {
  detail::ForwardProblem problem;
  problem.dtype = dtype;
  problem.head_dim = head_dim;
  problem.mask = mask;
  problem.has_softcap = has_softcap;
  return detail::select_for_arch(problem, arch);
}

}  // namespace flashjit
