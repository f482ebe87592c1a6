#include "dispatch.hpp"

#include "flashjit/dispatch.hpp"

#include <algorithm>
#include <map>
#include <mutex>

#include <fmt/format.h>

namespace flashjit {
namespace detail {

int kernel_head_dim(Family family, int head_dim) {
  const auto kernel_head_dim = family_kernel_head_dim(family, head_dim);
  if (!kernel_head_dim)
    throw Error(ErrorCode::unsupported, "dispatch", fmt::format("head_dim {} is over 256", head_dim));
  return *kernel_head_dim;
}

namespace {

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::automatic: return "auto";
    case Backend::reference: return "reference";
    case Backend::fa2: return "fa2";
    case Backend::sm90: return "sm90";
  }
  return "?";
}

Arch checked_arch(const DeviceProperties& device) {
  const Arch arch = device.arch();
  if (arch.sm < 80)
    throw Error(ErrorCode::unsupported, "dispatch",
                fmt::format("device {} ({}) is sm_{}; flashjit needs sm_80 or newer", device.ordinal,
                            device.name, arch.sm));
  return arch;
}

// Why `family` cannot run the problem here: its own reason, or no kernel head dim of its own at or
// above the problem's (it rounds up to its next one, as the forward does).
std::optional<std::string> unusable_reason(const RuntimeFamily& family, const PassProblem& problem, const Arch& arch) {
  if (problem.forward.modifier != nullptr && !family_takes_modifiers(family.family))
    return fmt::format("{} does not compile user modifiers (mod)", to_string(family.family));
  if (problem.forward.block_sparse && !family_takes_block_mask(family.family))
    return fmt::format("{} does not walk block masks", to_string(family.family));
  if (problem.forward.seqused && !family_takes_seqused(family.family))
    return fmt::format("{} does not read seqused_q/seqused_k (sm90_fwd and sm90_bwd do, on sm_90)",
                       to_string(family.family));
  if (problem.forward.dtype == DType::e4m3 && !family_takes_fp8(family.family))
    return fmt::format("{} has no FP8 kernels (float8_e4m3 runs forward on sm90_fwd, an sm_90 device)",
                       to_string(family.family));
  if (problem.forward.continues && !family_takes_continuation(family.family))
    return fmt::format("{} does not continue running results (continuation needs sm90_fwd, an sm_90 device)",
                       to_string(family.family));
  if (auto reason = family.unusable_reason(problem, arch)) return reason;
  const int head_dim = kernel_head_dim(family.family, problem.forward.head_dim);
  if (!family_covers(family.family, arch, head_dim))
    return fmt::format("{} has no kernel for head_dim {}", to_string(family.family), problem.forward.head_dim);
  return std::nullopt;
}

// The families of the problem's backend that can run it, in preference order (the first is the
// choice); throws naming why when there is none (each family's reason, where several were asked).
std::vector<const RuntimeFamily*> usable_families(const PassProblem& problem, const Arch& arch) {
  const Backend backend = problem.forward.backend;
  std::vector<const RuntimeFamily*> usable;
  std::vector<std::pair<Family, std::string>> reasons;
  bool any_allowed = false;
  for (const RuntimeFamily* family : runtime_families()) {
    if (family->pass != problem.pass || (backend == Backend::automatic ? !family->automatic : family->backend != backend))
      continue;
    any_allowed = true;
    if (auto reason = unusable_reason(*family, problem, arch)) {
      reasons.emplace_back(family->family, *reason);
    } else {
      usable.push_back(family);
    }
  }
  if (!any_allowed)
    throw Error(ErrorCode::unsupported, problem.operation(),
                fmt::format("there is no {} {} kernel (backend={})", backend_name(backend), problem.operation(),
                            backend_name(backend)));
  if (usable.empty()) {
    if (backend != Backend::automatic)
      throw Error(ErrorCode::invalid_argument, problem.operation(),
                  fmt::format("backend {}: {}", backend_name(backend), reasons.front().second));
    if (reasons.size() == 1) throw Error(ErrorCode::unsupported, problem.operation(), reasons.front().second);
    std::string all;
    for (const auto& [family, reason] : reasons)
      all += fmt::format("{}{}: {}", all.empty() ? "" : "; ", to_string(family), reason);
    throw Error(ErrorCode::unsupported, problem.operation(), fmt::format("no kernel family can run it ({})", all));
  }
  return usable;
}

// What a spec compiles in of the call beyond its tiles: a continuation, and in deterministic mode
// ordered dQ adds (where the family orders them).
void add_call_modes(KernelSpec& spec, const PassProblem& problem) {
  spec.continues = problem.forward.continues;
  spec.ordered_dq = problem.deterministic() && family_takes_ordered_dq(spec.family);
}

// A masked call that asks for tail splits (num_splits > 1) gets a spec that has them; other specs
// keep their default (unmasked specs have them, the others are smaller without).
void add_requested_tail_splits(KernelSpec& spec, const ForwardProblem& problem) {
  if (problem.num_splits > 1 && family_takes_tail_splits(spec.family)) spec.tail_splits = true;
}

KernelSpec heuristic_spec(const RuntimeFamily& family, const PassProblem& problem, const Arch& arch) {
  const ForwardProblem& f = problem.forward;
  KernelSpec spec = default_spec(family.family, arch, f.dtype, kernel_head_dim(family.family, f.head_dim), f.mask,
                                 f.has_softcap, f.modifier, f.block_sparse);
  add_call_modes(spec, problem);
  add_requested_tail_splits(spec, f);
  if (family.fit_to_problem != nullptr) family.fit_to_problem(spec, problem);
  if (auto reason = spec.validate())
    throw Error(ErrorCode::unsupported, problem.operation(),
                fmt::format("no {} kernel for head_dim {} on {}: {}", problem.operation(), f.head_dim, arch.name(),
                            *reason));
  return spec;
}

// A caller's forced spec must compute this problem on this device.
void check_forced_kernel(const KernelSpec& spec, const PassProblem& problem, const Arch& arch) {
  const ForwardProblem& f = problem.forward;
  auto bad = [&](const std::string& what) {
    return Error(ErrorCode::invalid_argument, problem.operation(),
                 fmt::format("options.kernel {} does not fit the problem: {}", spec.name(), what));
  };
  const RuntimeFamily& family = runtime_family(spec.family);
  if (family.pass != problem.pass)
    throw bad(fmt::format("family {} is not a {} family", to_string(spec.family), problem.operation()));
  if (spec.dtype != f.dtype)
    throw bad(fmt::format("dtype {} but the tensors are {}", to_string(spec.dtype), to_string(f.dtype)));
  if (spec.mask != f.mask)
    throw bad(fmt::format("mask {} but the options ask for {}", to_string(spec.mask), to_string(f.mask)));
  if (spec.has_softcap != f.has_softcap)
    throw bad(spec.has_softcap ? "it applies a softcap and the options have none"
                               : "the options ask for a softcap and it has none");
  const bool same_modifier = spec.modifier == f.modifier ||
                             (spec.modifier != nullptr && f.modifier != nullptr && *spec.modifier == *f.modifier);
  if (!same_modifier) throw bad("its modifier is not the options' mod");
  if (spec.block_sparse != f.block_sparse)
    throw bad(spec.block_sparse ? "it walks a block mask and the options have none" : "it cannot walk the options' block mask");
  if (spec.continues != f.continues)
    throw bad(spec.continues ? "it continues a running result and the options have no continuation"
                             : "it cannot continue the options' running result");
  if (family_takes_ordered_dq(spec.family) && spec.ordered_dq != problem.deterministic())
    throw bad(spec.ordered_dq ? "it orders its dQ adds (ordered_dq) and the options are not deterministic"
                              : "the options ask for deterministic mode and its dQ adds are unordered (ordered_dq)");
  if (f.num_splits > 1 && family_takes_tail_splits(spec.family) && !spec.tail_splits)
    throw bad(fmt::format("options.num_splits is {} and it has no tail splits (tail_splits)", f.num_splits));
  if (spec.head_dim < f.head_dim)
    throw bad(fmt::format("head_dim {} is smaller than the problem's {}", spec.head_dim, f.head_dim));
  if (spec.arch != arch) throw bad(fmt::format("arch {} but the device is {}", spec.arch.name(), arch.name()));
  if (auto reason = spec.validate()) throw bad(*reason);
  if (auto reason = unusable_reason(family, problem, arch)) throw bad(*reason);
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

// A tuned spec for this problem on this device, if one is recorded, still legal here and of a family
// that can run the problem under the chosen one's key.
std::optional<KernelSpec> tuned_spec(const TuningSources* tuning, const PassProblem& problem, const DeviceProperties& device,
                                     const std::vector<const RuntimeFamily*>& usable) {
  if (tuning == nullptr || tuning->empty()) return std::nullopt;
  // Tuning entries hold plain specs: a user's modifier or block mask runs the heuristic's tiles.
  if (problem.forward.modifier != nullptr || problem.forward.block_sparse) return std::nullopt;
  const Family key_family = usable.front()->tuning_key;
  auto spec = tuning->lookup_spec(device_stamp(device), problem_key(problem.forward, key_family));
  if (!spec || spec->arch != device.arch() || spec->validate()) return std::nullopt;
  const bool runs_here = std::any_of(usable.begin(), usable.end(), [&](const RuntimeFamily* f) {
    return f->family == spec->family && f->tuning_key == key_family;
  });
  return runs_here ? spec : std::nullopt;
}

}  // namespace

ProblemKey problem_key(const ForwardProblem& problem, Family key_family) {
  ProblemKey key;
  key.family = key_family;
  key.dtype = problem.dtype;
  key.head_dim = kernel_head_dim(key_family, problem.head_dim);
  key.mask = problem.mask;
  key.softcap = problem.has_softcap;
  key.seqlen_bucket = ProblemKey::bucket(std::max(problem.seqlen_q, problem.seqlen_k));
  key.batch_heads_bucket = ProblemKey::bucket(int64_t(problem.batch) * problem.heads_q);
  // Varlen's packed rows are sequence-major; otherwise the order of q's head and row strides.
  key.head_major = !problem.is_varlen && problem.heads_q > 1 && problem.params.q_head_stride > problem.params.q_row_stride;
  if (key_family == Family::kvcache_fwd)
    key.query_rows_bucket = ProblemKey::query_rows(int64_t(problem.seqlen_q) * (problem.heads_q / std::max(1, problem.heads_kv)));
  return key;
}

KernelSpec select_kernel(const PassProblem& problem, const DeviceProperties& device, const TuningSources* tuning) {
  const Arch arch = checked_arch(device);
  if (const auto& forced = problem.forward.forced_kernel) {
    check_forced_kernel(*forced, problem, arch);
    return *forced;
  }
  const std::vector<const RuntimeFamily*> usable = usable_families(problem, arch);
  if (auto tuned = tuned_spec(tuning, problem, device, usable)) {
    // The dense tuned tiles serve a continuing or deterministic call, or one that asks for tail
    // splits, too (where they can: three stages leave sm90_bwd no room for ordered dQ adds).
    KernelSpec spec = *tuned;
    add_call_modes(spec, problem);
    add_requested_tail_splits(spec, problem.forward);
    if (spec == *tuned || !spec.validate()) return spec;  // (validated once where unchanged)
  }
  return heuristic_spec(*usable.front(), problem, arch);
}

KernelSpec select_forward_kernel(const ForwardProblem& problem, const DeviceProperties& device,
                                 const TuningSources* tuning) {
  return select_kernel(PassProblem{Pass::forward, problem}, device, tuning);
}

KernelSpec select_backward_kernel(const BackwardProblem& problem, const DeviceProperties& device,
                                  const TuningSources* tuning) {
  return select_kernel(PassProblem{Pass::backward, problem.forward, &problem}, device, tuning);
}

TuningPlan tuning_plan(const PassProblem& problem, const Arch& arch) {
  ForwardProblem automatic = problem.forward;
  automatic.backend = Backend::automatic;
  automatic.forced_kernel.reset();
  const PassProblem planned{problem.pass, automatic, problem.backward, problem.kvcache};
  const std::vector<const RuntimeFamily*> usable = usable_families(planned, arch);
  const Family key_family = usable.front()->tuning_key;
  TuningPlan plan{usable.front()->family, problem_key(automatic, key_family), {}};
  for (const RuntimeFamily* family : usable) {
    if (family->tuning_key != key_family) continue;
    KernelSpec base = default_spec(family->family, arch, automatic.dtype, kernel_head_dim(family->family, automatic.head_dim),
                                   automatic.mask, automatic.has_softcap);
    add_requested_tail_splits(base, automatic);  // (candidates a masked call with num_splits > 1 can run)
    base.ordered_dq = planned.deterministic() && family_takes_ordered_dq(base.family);  // (legal ones only)
    for (const KernelSpec& s : family->tuning_candidates(base)) plan.candidates.push_back(s);
  }
  return plan;
}

}  // namespace detail

namespace {

// A problem with rows, in a layout TMA can read (null bases and zero strides are aligned): the
// common case, where every family is eligible.
detail::ForwardProblem common_problem(DType dtype, int head_dim, MaskKind mask, bool has_softcap) {
  detail::ForwardProblem problem;
  problem.dtype = dtype;
  problem.head_dim = head_dim;
  problem.mask = mask;
  problem.has_softcap = has_softcap;
  problem.batch = problem.heads_q = problem.heads_kv = 1;
  problem.seqlen_q = problem.seqlen_k = 1;
  problem.params.batch = problem.params.num_heads_q = problem.params.num_heads_kv = 1;
  problem.params.seqlen_q = problem.params.seqlen_k = 1;
  return problem;
}

KernelSpec heuristic_spec_of(detail::Pass pass, const Arch& arch, DType dtype, int head_dim, MaskKind mask,
                             bool has_softcap) {
  // The family dispatch would choose, and its default spec (no tuning candidates are built).
  const detail::ForwardProblem problem = common_problem(dtype, head_dim, mask, has_softcap);
  const detail::PassProblem planned{pass, problem};
  return detail::heuristic_spec(*detail::usable_families(planned, arch).front(), planned, arch);
}

}  // namespace

KernelSpec heuristic_forward_spec(const Arch& arch, DType dtype, int head_dim, MaskKind mask, bool has_softcap) {
  return heuristic_spec_of(detail::Pass::forward, arch, dtype, head_dim, mask, has_softcap);
}

KernelSpec heuristic_backward_spec(const Arch& arch, DType dtype, int head_dim, MaskKind mask, bool has_softcap,
                                   bool deterministic) {
  // The common case's choice (a layout TMA can read), in the mode asked for.
  detail::BackwardProblem backward;
  backward.forward = common_problem(dtype, head_dim, mask, has_softcap);
  backward.deterministic = deterministic;
  const detail::PassProblem planned{detail::Pass::backward, backward.forward, &backward};
  return detail::heuristic_spec(*detail::usable_families(planned, arch).front(), planned, arch);
}

std::vector<KernelSpec> heuristic_kvcache_specs(const Arch& arch, DType dtype, int head_dim, MaskKind mask,
                                                bool has_softcap) {
  std::vector<KernelSpec> specs;
  for (int packed_rows : {16, 32, 64}) {  // one query token of a group of this many heads
    detail::KvCacheProblem kvcache;
    kvcache.forward = common_problem(dtype, head_dim, mask, has_softcap);
    kvcache.forward.heads_q = packed_rows;
    const detail::PassProblem planned{detail::Pass::kvcache, kvcache.forward, nullptr, &kvcache};
    const KernelSpec spec = detail::heuristic_spec(*detail::usable_families(planned, arch).front(), planned, arch);
    if (std::find(specs.begin(), specs.end(), spec) == specs.end()) specs.push_back(spec);
  }
  return specs;
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
