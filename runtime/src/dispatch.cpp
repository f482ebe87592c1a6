#include "dispatch.hpp"

#include "flashjit/dispatch.hpp"

#include <algorithm>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "tma.hpp"

namespace flashjit {
namespace detail {

int kernel_head_dim(Family family, int head_dim) {
  const auto kernel_head_dim = family_kernel_head_dim(family, head_dim);
  if (!kernel_head_dim)
    throw Error(ErrorCode::unsupported, "dispatch", fmt::format("head_dim {} is over 256", head_dim));
  return *kernel_head_dim;
}

Family forward_family(const ForwardProblem& problem, const Arch& arch) {
  const bool hopper = arch.arch_specific && arch.sm == 90;
  switch (problem.backend) {
    case Backend::automatic:
      // The Hopper family reads q, k and v through TMA maps; layouts TMA cannot describe fall back.
      return hopper && !tma_unusable_reason(problem) ? Family::sm90_fwd : Family::fa2_fwd;
    case Backend::reference: return Family::reference_fwd;
    case Backend::fa2: return Family::fa2_fwd;
    case Backend::sm90:
      if (!hopper)
        throw Error(ErrorCode::unsupported, "dispatch",
                    fmt::format("sm90_fwd needs an sm_90 device, this one is {}", arch.name()));
      if (auto reason = tma_unusable_reason(problem))
        throw Error(ErrorCode::invalid_argument, "forward", fmt::format("backend sm90: {}", *reason));
      return Family::sm90_fwd;
  }
  return Family::fa2_fwd;
}

namespace {

KernelSpec heuristic_spec(const ForwardProblem& problem, const Arch& arch, Family family) {
  return default_spec(family, arch, problem.dtype, kernel_head_dim(family, problem.head_dim),
                      problem.mask, problem.has_softcap);
}

// A caller's forced spec must compute this problem on this device.
void check_forced_kernel(const KernelSpec& spec, const ForwardProblem& problem, const Arch& arch,
                         bool backward) {
  const char* operation = backward ? "backward" : "forward";
  auto bad = [&](const std::string& what) {
    return Error(ErrorCode::invalid_argument, operation,
                 fmt::format("options.kernel {} does not fit the problem: {}", spec.name(), what));
  };
  if (is_forward_family(spec.family) == backward)
    throw bad(fmt::format("family {} is not a {} family", to_string(spec.family), operation));
  if (spec.dtype != problem.dtype)
    throw bad(fmt::format("dtype {} but the tensors are {}", to_string(spec.dtype), to_string(problem.dtype)));
  if (spec.mask != problem.mask)
    throw bad(fmt::format("mask {} but the options ask for {}", to_string(spec.mask), to_string(problem.mask)));
  if (spec.has_softcap != problem.has_softcap)
    throw bad(spec.has_softcap ? "it applies a softcap and the options have none"
                               : "the options ask for a softcap and it has none");
  if (spec.head_dim < problem.head_dim)
    throw bad(fmt::format("head_dim {} is smaller than the problem's {}", spec.head_dim, problem.head_dim));
  if (spec.arch != arch)
    throw bad(fmt::format("arch {} but the device is {}", spec.arch.name(), arch.name()));
  if (auto reason = spec.validate()) throw bad(*reason);
  if (spec.family == Family::sm90_fwd)
    if (auto reason = tma_unusable_reason(problem)) throw bad(*reason);
}

Arch checked_arch(const DeviceProperties& device) {
  const Arch arch = device.arch();
  if (arch.sm < 80)
    throw Error(ErrorCode::unsupported, "dispatch",
                fmt::format("device {} ({}) is sm_{}; flashjit needs sm_80 or newer", device.ordinal,
                            device.name, arch.sm));
  return arch;
}

// Stamps are built once per device: NVRTC's version and the formatting stay off the call path.
const DeviceStamp& device_stamp(const DeviceProperties& device) {
  static std::mutex mutex;
  static std::map<int, DeviceStamp> stamps;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = stamps.find(device.ordinal);
  if (it == stamps.end() || it->second.name != device.name) it = stamps.insert_or_assign(device.ordinal, DeviceStamp::of(device)).first;
  return it->second;
}

// A tuned spec for this problem on this device, if one is recorded and still legal here.
std::optional<KernelSpec> tuned_spec(const TuningSources* tuning, const ForwardProblem& problem,
                                     const DeviceProperties& device, Family family) {
  if (tuning == nullptr || tuning->empty()) return std::nullopt;
  const auto entry = tuning->lookup(device_stamp(device), detail::problem_key(problem, family));
  if (!entry || entry->spec.arch != device.arch() || entry->spec.validate()) return std::nullopt;
  return entry->spec;
}

}  // namespace

ProblemKey problem_key(const ForwardProblem& problem, Family family) {
  ProblemKey key;
  key.family = family;
  key.dtype = problem.dtype;
  key.head_dim = kernel_head_dim(family, problem.head_dim);
  key.mask = problem.mask;
  key.softcap = problem.has_softcap;
  key.seqlen_bucket = ProblemKey::bucket(std::max(problem.seqlen_q, problem.seqlen_k));
  key.batch_heads_bucket = ProblemKey::bucket(int64_t(problem.batch) * problem.heads_q);
  // Varlen's packed rows are sequence-major; otherwise the order of q's head and row strides.
  key.head_major = !problem.is_varlen && problem.heads_q > 1 && problem.params.q_head_stride > problem.params.q_row_stride;
  return key;
}

KernelSpec select_forward_kernel(const ForwardProblem& problem, const DeviceProperties& device,
                                 const TuningSources* tuning) {
  const Arch arch = checked_arch(device);
  if (problem.forced_kernel) {
    check_forced_kernel(*problem.forced_kernel, problem, arch, /*backward=*/false);
    return *problem.forced_kernel;
  }
  const Family family = forward_family(problem, arch);
  if (problem.backend != Backend::reference)
    if (auto spec = tuned_spec(tuning, problem, device, family)) return *spec;
  return heuristic_spec(problem, arch, family);
}

KernelSpec select_backward_kernel(const ForwardProblem& problem, const DeviceProperties& device,
                                  const TuningSources* tuning) {
  const Arch arch = checked_arch(device);
  if (problem.forced_kernel) {
    check_forced_kernel(*problem.forced_kernel, problem, arch, /*backward=*/true);
    return *problem.forced_kernel;
  }
  // Backward entries are keyed by fa2_bwd but may hold the sm90_bwd spec the tuner kept; this path
  // runs fa2_bwd (deterministic mode, backend=fa2, layouts TMA cannot read), so only an fa2_bwd
  // entry applies.
  if (problem.backend != Backend::reference)
    if (auto spec = tuned_spec(tuning, problem, device, Family::fa2_bwd); spec && spec->family == Family::fa2_bwd)
      return *spec;
  if (problem.backend == Backend::reference)
    throw Error(ErrorCode::unsupported, "backward",
                "there is no reference backward kernel (backend=reference); the tests use the float64 "
                "CPU oracle");
  KernelSpec spec = default_spec(Family::fa2_bwd, arch, problem.dtype, kernel_head_dim(Family::fa2_bwd, problem.head_dim),
                                 problem.mask, problem.has_softcap);
  if (auto reason = spec.validate())
    throw Error(ErrorCode::unsupported, "backward",
                fmt::format("no backward kernel for head_dim {} on {}: {}", problem.head_dim, arch.name(), *reason));
  return spec;
}

namespace {

// Why sm90_bwd cannot run this backward problem here, or nothing when it can.
std::optional<std::string> sm90_backward_unusable_reason(const BackwardProblem& problem, const Arch& arch) {
  const ForwardProblem& f = problem.forward;
  if (!arch.arch_specific || arch.sm != 90)
    return fmt::format("sm90_bwd needs an sm_90 device, this one is {}", arch.name());
  if (problem.deterministic) return std::string("deterministic mode runs fa2_bwd's fixed-order dQ");
  // Only where no compute is wasted on padding: the problem's fa2_bwd kernel head dim must be one of sm90_bwd's.
  if (!family_covers(Family::sm90_bwd, arch, kernel_head_dim(Family::fa2_bwd, f.head_dim)))
    return fmt::format("sm90_bwd has no kernel for head_dim {}", f.head_dim);
  return tma_unusable_reason(problem);
}

}  // namespace

KernelSpec select_backward_kernel(const BackwardProblem& problem, const DeviceProperties& device,
                                  const TuningSources* tuning) {
  const ForwardProblem& f = problem.forward;
  const Arch arch = checked_arch(device);
  const auto reason = sm90_backward_unusable_reason(problem, arch);
  if (f.forced_kernel && f.forced_kernel->family == Family::sm90_bwd && reason)
    throw Error(ErrorCode::invalid_argument, "backward",
                fmt::format("options.kernel {} does not fit the problem: {}", f.forced_kernel->name(), *reason));
  if (f.forced_kernel || f.backend == Backend::reference || f.backend == Backend::fa2)
    return select_backward_kernel(f, device, tuning);
  if (f.backend == Backend::sm90) {
    if (reason) throw Error(ErrorCode::invalid_argument, "backward", fmt::format("backend sm90: {}", *reason));
    return heuristic_spec(f, arch, Family::sm90_bwd);
  }
  // A tuned sm90_bwd spec applies only where sm90_bwd can run this problem.
  if (auto spec = tuned_spec(tuning, f, device, Family::fa2_bwd); spec && (spec->family == Family::fa2_bwd || !reason))
    return *spec;
  return reason ? select_backward_kernel(f, device, tuning) : heuristic_spec(f, arch, Family::sm90_bwd);
}

TailSplit choose_tail_split(long long tiles, int ctas, int key_blocks, int requested_splits) {
  const long long remainder = tiles % ctas;
  if (requested_splits == 1 || remainder == 0) return {};
  if (requested_splits > 1) {
    const int splits = std::min(requested_splits, key_blocks);
    return splits > 1 ? TailSplit{remainder, splits} : TailSplit{};
  }
  // The last round of whole tiles takes one tile's time however few CTAs it has work for. Split in
  // k, it takes ceil(remainder k / ctas) rounds of items, each 1 / k of a tile plus an item's own
  // cost: its pipeline's start and drain, the partial O's write and merge, about 8 key blocks' steps
  // (fitted on the H200 at head dim 128: thirds of 26-block tiles lost 3%, halves of 103-block tiles
  // gained 3%). Split only where that saves a fifth of a tile or more, in 4+ key blocks per item.
  constexpr double kItemCostInKeyBlocks = 8.0, kMinimumSaving = 0.2;
  TailSplit best;
  double best_time = 1.0 - kMinimumSaving;
  for (int k = 2; k <= std::min(4, key_blocks / 4); ++k) {
    const long long rounds = (remainder * k + ctas - 1) / ctas;
    const double time = static_cast<double>(rounds) * (1.0 / k + kItemCostInKeyBlocks / key_blocks);
    if (time < best_time) {
      best_time = time;
      best = {remainder, k};
    }
  }
  return best;
}

}  // namespace detail

KernelSpec heuristic_forward_spec(const Arch& arch, DType dtype, int head_dim, MaskKind mask,
                                  bool has_softcap) {
  // A problem with rows, in a layout TMA can read (null bases and zero strides are aligned): the
  // choice for the common case, where the Hopper family is eligible.
  detail::ForwardProblem problem;
  problem.dtype = dtype;
  problem.head_dim = head_dim;
  problem.mask = mask;
  problem.has_softcap = has_softcap;
  problem.batch = problem.heads_q = problem.heads_kv = 1;
  problem.seqlen_q = problem.seqlen_k = 1;
  problem.params.batch = problem.params.num_heads_q = problem.params.num_heads_kv = 1;
  problem.params.seqlen_q = problem.params.seqlen_k = 1;
  return detail::heuristic_spec(problem, arch, detail::forward_family(problem, arch));
}

KernelSpec heuristic_backward_spec(const Arch& arch, DType dtype, int head_dim, MaskKind mask,
                                   bool has_softcap) {
  // The common case's choice (atomic dQ, a layout TMA can read), as select_backward_kernel makes it.
  const int kernel_head_dim = detail::kernel_head_dim(Family::fa2_bwd, head_dim);
  const Family family = family_covers(Family::sm90_bwd, arch, kernel_head_dim) ? Family::sm90_bwd : Family::fa2_bwd;
  return default_spec(family, arch, dtype, kernel_head_dim, mask, has_softcap);
}

std::vector<KernelSpec> bundled_tuned_specs(const KernelSpec& heuristic) {
  std::vector<KernelSpec> specs;
  for (const TunedEntry& e : bundled_tuning_db().entries()) {
    const KernelSpec& s = e.spec;
    const bool same_kind = s.family == heuristic.family && s.arch == heuristic.arch && s.dtype == heuristic.dtype &&
                           s.head_dim == heuristic.head_dim && s.mask == heuristic.mask &&
                           s.has_softcap == heuristic.has_softcap;
    if (same_kind && std::find(specs.begin(), specs.end(), s) == specs.end()) specs.push_back(s);
  }
  return specs;
}

}  // namespace flashjit
