#include "flashjit/codegen/kernel_spec.hpp"

#include <algorithm>
#include <cctype>
#include <functional>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "family_rules.hpp"
#include "flashjit/error.hpp"

namespace flashjit {

using codegen_detail::family_rules;
using nlohmann::json;

namespace {

constexpr std::string_view kDTypeNames[] = {"fp16", "bf16", "e4m3"};
constexpr std::string_view kMaskNames[] = {"none", "causal", "window"};

template <class Enum, size_t N>
Enum parse_enum(std::string_view text, const std::string_view (&names)[N], const char* what) {
  for (size_t i = 0; i < N; ++i)
    if (names[i] == text) return static_cast<Enum>(i);
  throw Error(ErrorCode::invalid_argument, "spec",
              fmt::format("unknown {} '{}' (expected one of: {})", what, text,
                          fmt::join(names, ", ")));
}

}  // namespace

std::string_view to_string(Family f) { return family_rules(f).name; }
std::string_view to_string(DType d) { return kDTypeNames[static_cast<int>(d)]; }
int element_bytes(DType d) { return d == DType::e4m3 ? 1 : 2; }
std::string_view to_string(MaskKind m) { return kMaskNames[static_cast<int>(m)]; }
Family parse_family(std::string_view t) {
  std::vector<std::string_view> names;
  for (const auto* rules : codegen_detail::all_family_rules()) {
    if (rules->name == t) return rules->family;
    names.push_back(rules->name);
  }
  throw Error(ErrorCode::invalid_argument, "spec",
              fmt::format("unknown family '{}' (expected one of: {})", t, fmt::join(names, ", ")));
}
DType parse_dtype(std::string_view t) { return parse_enum<DType>(t, kDTypeNames, "dtype"); }
MaskKind parse_mask(std::string_view t) { return parse_enum<MaskKind>(t, kMaskNames, "mask"); }

const std::vector<Family>& all_families() {
  static const std::vector<Family> families = [] {
    std::vector<Family> all;
    for (const auto* rules : codegen_detail::all_family_rules()) all.push_back(rules->family);
    return all;
  }();
  return families;
}

bool is_forward_family(Family family) { return !family_rules(family).computes_gradients; }

bool family_takes_modifiers(Family family) { return family_rules(family).takes_modifiers; }
bool family_takes_block_mask(Family family) { return family_rules(family).takes_block_mask; }
bool family_takes_continuation(Family family) { return family_rules(family).takes_continuation; }
bool family_takes_ordered_dq(Family family) { return family_rules(family).takes_ordered_dq; }
bool family_takes_seqused(Family family) { return family_rules(family).takes_seqused; }
bool family_takes_fp8(Family family) { return family_rules(family).takes_fp8; }
bool family_takes_tail_splits(Family family) { return family_rules(family).takes_tail_splits; }
bool default_tail_splits(Family family, MaskKind mask, bool block_sparse) {
  return family_takes_tail_splits(family) && mask == MaskKind::none && !block_sparse;
}

bool family_covers(Family family, const Arch& arch, int head_dim) {
  const auto& rules = family_rules(family);
  return arch.sm >= rules.min_sm && (!rules.needs_arch_specific || arch.arch_specific) &&
         std::find(rules.head_dims.begin(), rules.head_dims.end(), head_dim) != rules.head_dims.end();
}

std::optional<int> family_kernel_head_dim(Family family, int head_dim) {
  for (int kernel_head_dim : family_rules(family).head_dims)  // ascending
    if (kernel_head_dim >= head_dim) return kernel_head_dim;
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Arch

Arch Arch::parse(std::string_view text) {
  auto fail = [&] {
    return Error(ErrorCode::invalid_argument, "arch",
                 fmt::format("'{}' is not a CUDA arch name (expected sm_<major><minor>[a], such "
                             "as sm_80 or sm_90a)", text));
  };
  if (text.substr(0, 3) != "sm_") throw fail();
  std::string_view digits = text.substr(3);
  Arch arch;
  if (!digits.empty() && digits.back() == 'a') {
    arch.arch_specific = true;
    digits.remove_suffix(1);
  }
  if (digits.size() < 2 || digits.size() > 3 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return std::isdigit(c) != 0; }))
    throw fail();
  arch.sm = std::stoi(std::string(digits));
  if (arch.sm < 50) throw fail();
  return arch;
}

std::string Arch::name() const { return fmt::format("sm_{}{}", sm, arch_specific ? "a" : ""); }

// ---------------------------------------------------------------------------------------------
// KernelSpec

std::optional<std::string> KernelSpec::validate() const {
  const auto& rules = family_rules(family);
  if (arch.sm < rules.min_sm)
    return fmt::format("{} needs sm_{} or newer, arch is {}", rules.name, rules.min_sm,
                       arch.name());
  if (rules.needs_arch_specific && !arch.arch_specific)
    return fmt::format("{} uses arch-specific instructions (wgmma, setmaxnreg) and needs an "
                       "'a' target such as sm_90a, arch is {}", rules.name, arch.name());
  if (std::find(rules.head_dims.begin(), rules.head_dims.end(), head_dim) == rules.head_dims.end())
    return fmt::format("{} has no kernel for head_dim {} (kernel head dims: {})", rules.name,
                       head_dim, fmt::join(rules.head_dims, ", "));
  if (block_m <= 0 || block_n <= 0 || num_warps <= 0 || num_stages <= 0)
    return fmt::format("block_m, block_n, num_warps and num_stages must be positive, got "
                       "{}, {}, {}, {}", block_m, block_n, num_warps, num_stages);
  if (modifier != nullptr) {
    if (!rules.takes_modifiers) return fmt::format("{} does not compile user modifiers", rules.name);
    if (auto reason = modifier->validate()) return *reason;
    if (has_softcap && modifier->has_score())
      return std::string("a softcap and a score modifier do not combine: write the softcap into the score modifier");
  }
  if (block_sparse) {
    if (!rules.takes_block_mask) return fmt::format("{} does not walk block masks", rules.name);
    if (mask != MaskKind::none)
      return fmt::format("a block mask replaces the {} mask: write it into the block mask and its mask modifier",
                         to_string(mask));
  }
  if (continues && !rules.takes_continuation)
    return fmt::format("{} does not continue partial results (ring attention's steps run on sm90_fwd and sm90_bwd)",
                       rules.name);
  if (ordered_dq && !rules.takes_ordered_dq)
    return fmt::format("{} does not order its dQ adds (sm90_bwd's deterministic mode does)", rules.name);
  if (tail_splits && !rules.takes_tail_splits)
    return fmt::format("{} does not split tails (the persistent sm90_fwd does)", rules.name);
  if (v_pretransposed && (family != Family::sm90_fwd || dtype != DType::e4m3))
    return std::string("v_pretransposed (V transposed before the forward) is an FP8 sm90_fwd mode");
  if (dtype == DType::e4m3) {
    if (!rules.takes_fp8) return fmt::format("{} has no FP8 kernels (e4m3 runs forward on sm90_fwd)", rules.name);
    if (modifier != nullptr || block_sparse || continues)
      return std::string("FP8 specs take no user modifiers, block masks or continuations");
  }
  return rules.validate_tiles(*this);
}

std::string KernelSpec::name() const {
  std::string mask_part = mask == MaskKind::none ? "" : fmt::format("_{}", to_string(mask));
  const std::string modifier_part = modifier != nullptr ? "_mod" + modifier->hash().substr(0, 12) : "";
  const char* split_part =
      tail_splits == default_tail_splits(family, mask, block_sparse) ? "" : tail_splits ? "_split" : "_nosplit";
  return fmt::format("{}_{}_d{}_m{}n{}w{}s{}{}{}{}{}{}{}{}{}_sm{}{}", to_string(family), to_string(dtype),
                     head_dim, block_m, block_n, num_warps, num_stages, mask_part,
                     has_softcap ? "_softcap" : "", modifier_part, block_sparse ? "_sparse" : "",
                     continues ? "_cont" : "", ordered_dq ? "_ordered" : "", split_part,
                     v_pretransposed ? "_vt" : "", arch.sm,
                     arch.arch_specific ? "a" : "");
}

json KernelSpec::to_json() const {
  json j{{"family", to_string(family)}, {"arch", arch.name()},
         {"dtype", to_string(dtype)},   {"head_dim", head_dim},
         {"block_m", block_m},          {"block_n", block_n},
         {"num_warps", num_warps},      {"num_stages", num_stages},
         {"mask", to_string(mask)},     {"softcap", has_softcap}};
  // Only where set, so plain specs keep the JSON they always had.
  if (modifier != nullptr) j["modifier"] = modifier->to_json();
  if (block_sparse) j["block_sparse"] = true;
  if (continues) j["continues"] = true;
  if (ordered_dq) j["ordered_dq"] = true;
  if (tail_splits != default_tail_splits(family, mask, block_sparse)) j["tail_splits"] = tail_splits;
  if (v_pretransposed) j["v_pretransposed"] = true;
  return j;
}

KernelSpec KernelSpec::from_json(const json& j) {
  static const std::vector<std::string> kFields{"family",  "arch",      "dtype",      "head_dim",
                                                "block_m", "block_n",   "num_warps",  "num_stages",
                                                "mask",    "softcap",   "modifier",   "block_sparse",
                                                "continues", "ordered_dq", "tail_splits", "v_pretransposed"};
  auto fail = [](const std::string& message) {
    return Error(ErrorCode::invalid_argument, "spec JSON", message);
  };
  if (!j.is_object()) throw fail(fmt::format("a kernel spec must be a JSON object, got {}", j.dump()));
  for (const auto& [key, value] : j.items())
    if (std::find(kFields.begin(), kFields.end(), key) == kFields.end())
      throw fail(fmt::format("unknown field '{}' (known: {})", key, fmt::join(kFields, ", ")));
  auto field = [&](const char* key) -> const json& {
    auto it = j.find(key);
    if (it == j.end()) throw fail(fmt::format("missing field '{}'", key));
    return *it;
  };
  auto text = [&](const char* key) {
    const json& v = field(key);
    if (!v.is_string()) throw fail(fmt::format("field '{}' must be a string, got {}", key, v.dump()));
    return v.get<std::string>();
  };
  auto integer = [&](const char* key) {
    const json& v = field(key);
    if (!v.is_number_integer())
      throw fail(fmt::format("field '{}' must be an integer, got {}", key, v.dump()));
    auto value = v.get<int64_t>();
    if (value < 0 || value > 65536)
      throw fail(fmt::format("field '{}' is out of range: {}", key, value));
    return static_cast<int>(value);
  };
  KernelSpec s;
  s.family = parse_family(text("family"));
  s.arch = Arch::parse(text("arch"));
  s.dtype = parse_dtype(text("dtype"));
  s.head_dim = integer("head_dim");
  s.block_m = integer("block_m");
  s.block_n = integer("block_n");
  s.num_warps = integer("num_warps");
  s.num_stages = integer("num_stages");
  s.mask = parse_mask(text("mask"));
  const json& softcap = field("softcap");
  if (!softcap.is_boolean())
    throw fail(fmt::format("field 'softcap' must be true or false, got {}", softcap.dump()));
  s.has_softcap = softcap.get<bool>();
  if (auto it = j.find("modifier"); it != j.end())
    s.modifier = std::make_shared<const AttentionModifier>(AttentionModifier::from_json(*it));
  if (auto it = j.find("block_sparse"); it != j.end()) {
    if (!it->is_boolean()) throw fail(fmt::format("field 'block_sparse' must be true or false, got {}", it->dump()));
    s.block_sparse = it->get<bool>();
  }
  if (auto it = j.find("continues"); it != j.end()) {
    if (!it->is_boolean()) throw fail(fmt::format("field 'continues' must be true or false, got {}", it->dump()));
    s.continues = it->get<bool>();
  }
  if (auto it = j.find("ordered_dq"); it != j.end()) {
    if (!it->is_boolean()) throw fail(fmt::format("field 'ordered_dq' must be true or false, got {}", it->dump()));
    s.ordered_dq = it->get<bool>();
  }
  s.tail_splits = default_tail_splits(s.family, s.mask, s.block_sparse);
  if (auto it = j.find("tail_splits"); it != j.end()) {
    if (!it->is_boolean()) throw fail(fmt::format("field 'tail_splits' must be true or false, got {}", it->dump()));
    s.tail_splits = it->get<bool>();
  }
  if (auto it = j.find("v_pretransposed"); it != j.end()) {
    if (!it->is_boolean())
      throw fail(fmt::format("field 'v_pretransposed' must be true or false, got {}", it->dump()));
    s.v_pretransposed = it->get<bool>();
  }
  return s;
}

bool KernelSpec::operator==(const KernelSpec& o) const {
  return family == o.family && arch == o.arch && dtype == o.dtype && head_dim == o.head_dim &&
         block_m == o.block_m && block_n == o.block_n && num_warps == o.num_warps &&
         num_stages == o.num_stages && mask == o.mask && has_softcap == o.has_softcap &&
         block_sparse == o.block_sparse && continues == o.continues && ordered_dq == o.ordered_dq &&
         tail_splits == o.tail_splits && v_pretransposed == o.v_pretransposed &&
         (modifier == o.modifier || (modifier != nullptr && o.modifier != nullptr && *modifier == *o.modifier));
}

size_t KernelSpecHash::operator()(const KernelSpec& s) const noexcept {
  // Every field fits in a few bits; pack them, then mix.
  uint64_t packed = static_cast<uint64_t>(s.family);
  for (uint64_t v : {uint64_t(s.arch.sm), uint64_t(s.arch.arch_specific), uint64_t(s.dtype),
                     uint64_t(s.head_dim), uint64_t(s.block_m), uint64_t(s.block_n),
                     uint64_t(s.num_warps), uint64_t(s.num_stages), uint64_t(s.mask),
                     uint64_t(s.has_softcap), uint64_t(s.block_sparse), uint64_t(s.continues),
                     uint64_t(s.ordered_dq), uint64_t(s.tail_splits), uint64_t(s.v_pretransposed)})
    packed = packed * 0x100000001b3ull ^ v;
  if (s.modifier != nullptr) packed = packed * 0x100000001b3ull ^ std::hash<std::string>{}(s.modifier->hash());
  return std::hash<uint64_t>{}(packed);
}

KernelSpec default_spec(Family family, Arch arch, DType dtype, int head_dim, MaskKind mask,
                        bool has_softcap, std::shared_ptr<const AttentionModifier> modifier, bool block_sparse) {
  KernelSpec s;
  s.family = family;
  s.arch = arch;
  s.dtype = dtype;
  s.head_dim = head_dim;
  s.mask = mask;
  s.has_softcap = has_softcap;
  s.modifier = std::move(modifier);
  s.block_sparse = block_sparse;
  s.tail_splits = default_tail_splits(family, mask, block_sparse);
  family_rules(family).set_default_tiles(s);
  return s;
}

}  // namespace flashjit
