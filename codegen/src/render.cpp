#include "flashjit/codegen/render.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "family_rules.hpp"
#include "flashjit/error.hpp"

namespace flashjit {

using codegen_detail::family_rules;

namespace {

std::string_view element_type(DType d) {
  switch (d) {
    case DType::fp16: return "flashjit::kernels::half_t";
    case DType::bf16: return "flashjit::kernels::bfloat16_t";
    case DType::e4m3: return "flashjit::kernels::float8_e4m3_t";
  }
  return "";
}

std::string_view mask_constant(MaskKind m) {
  switch (m) {
    case MaskKind::none: return "flashjit::kernels::MaskKind::kNone";
    case MaskKind::causal: return "flashjit::kernels::MaskKind::kCausal";
    case MaskKind::window: return "flashjit::kernels::MaskKind::kWindow";
  }
  return "";
}

std::string_view tensor_element_type(ModifierTensorType t) {
  switch (t) {
    case ModifierTensorType::int32: return "int";
    case ModifierTensorType::int64: return "long long";
    case ModifierTensorType::float32: return "float";
  }
  return "";
}

// The spec's modifier and block-mask walk as Config::Modifiers (templates/common/modifiers.cuh
// reads it; specs with neither render none). Each body becomes a function whose side tensors are
// restrict pointers from the kernel parameters; #line directives number the body's lines as the
// user wrote them, then return to the generated file's own numbering. The score body is a template
// over the score's type; families that compute gradients also get score_and_gradient, from the
// user's gradient body or by running the score body on dual numbers.
std::string modifiers_struct(const KernelSpec& spec, bool gradients, Source& source, int first_line) {
  std::string out;
  int line = first_line;  // the generated file's line the next text starts on
  auto emit = [&](std::string_view text) {
    out += text;
    line += static_cast<int>(std::count(text.begin(), text.end(), '\n'));
  };
  const AttentionModifier* m = spec.modifier.get();
  emit(fmt::format("  struct Modifiers {{\n"
                   "    static constexpr bool kHasMask = {};\n"
                   "    static constexpr bool kHasScore = {};\n"
                   "    static constexpr bool kBlockSparse = {};\n",
                   m != nullptr && m->has_mask(), m != nullptr && m->has_score(), spec.block_sparse));
  auto function = [&](std::string_view signature, std::string_view file, const std::string& body, std::string_view fallback) {
    emit(fmt::format("    {} {{\n", signature));
    if (body.empty()) {
      emit(fmt::format("      {}\n    }}\n", fallback));
      return;
    }
    for (size_t i = 0; i < m->tensors.size(); ++i)
      emit(fmt::format("      const {}* __restrict__ {} = static_cast<const {}*>(flashjit_params.modifier_tensors[{}]); "
                       "(void){};\n",
                       tensor_element_type(m->tensors[i].type), m->tensors[i].name,
                       tensor_element_type(m->tensors[i].type), i, m->tensors[i].name));
    emit(fmt::format("#line 1 \"{}\"\n", file));
    emit(body);
    if (body.back() != '\n') emit("\n");
    emit(fmt::format("#line {} \"{}\"\n    }}\n", line + 1, source.file_name));
    source.user_files.emplace_back(std::string(file), body);
  };
  function("static __device__ __forceinline__ bool mask(const flashjit::AttentionFwdParams& flashjit_params, int batch, "
           "int head, int q_idx, int kv_idx)",
           kMaskModFile, m != nullptr ? m->mask : std::string(), "return true;");
  function("template <class Score> static __device__ __forceinline__ Score score(const flashjit::AttentionFwdParams& "
           "flashjit_params, Score score, int batch, int head, int q_idx, int kv_idx)",
           kScoreModFile, m != nullptr ? m->score : std::string(), "return score;");
  if (gradients) {
    const bool given = m != nullptr && m->has_score_grad();
    if (given)
      function("static __device__ __forceinline__ float score_grad(const flashjit::AttentionFwdParams& flashjit_params, "
               "float score, int batch, int head, int q_idx, int kv_idx)",
               kScoreGradFile, m->score_grad, "");
    emit("    static __device__ __forceinline__ float score_and_gradient(const flashjit::AttentionFwdParams& p, float s, "
         "int batch, int head, int q_idx, int kv_idx, float& gradient) {\n");
    if (given)
      emit("      gradient = score_grad(p, s, batch, head, q_idx, kv_idx);\n"
           "      return score(p, s, batch, head, q_idx, kv_idx);\n");
    else
      emit("      const flashjit::kernels::ScoreDual d = score(p, flashjit::kernels::ScoreDual(s, 1.f), batch, head, q_idx, "
           "kv_idx);\n"
           "      gradient = d.derivative;\n"
           "      return d.value;\n");
    emit("    }\n");
  }
  emit("  };\n");
  return out;
}

std::string entry_symbol(const codegen_detail::FamilyRules& rules, const codegen_detail::EntryPoint& entry) {
  return fmt::format("flashjit_{}_{}", rules.name, entry.name);
}

}  // namespace

Source render(const KernelSpec& spec) {
  if (auto reason = spec.validate())
    throw Error(ErrorCode::invalid_argument, "render",
                fmt::format("illegal kernel spec {}: {}", spec.name(), *reason));
  const auto& rules = family_rules(spec.family);

  Source source;
  source.spec_name = spec.name();
  source.file_name = source.spec_name + ".cu";

  // Fixed include block first, then every configuration value as a C++ declaration: all variants
  // of a family share the same preprocessed prefix and the same NVRTC options.
  std::string constants;
  for (const KernelConstant& c : rules.constants(spec))
    fmt::format_to(std::back_inserter(constants), "  static constexpr int {} = {};\n", c.name, c.value);
  std::string& out = source.text;
  fmt::format_to(std::back_inserter(out),
                 "// Generated by flashjit from kernel spec {}. Do not edit.\n"
                 "#include \"{}\"\n\n"
                 "namespace flashjit_generated {{\n"
                 "struct Config {{\n"
                 "  using Element = {};\n"
                 "  static constexpr int kHeadDim = {};\n"
                 "  static constexpr int kBlockM = {};\n"
                 "  static constexpr int kBlockN = {};\n"
                 "  static constexpr int kNumWarps = {};\n"
                 "  static constexpr int kNumStages = {};\n"
                 "  static constexpr flashjit::kernels::MaskKind kMask = {};\n"
                 "  static constexpr bool kHasSoftcap = {};\n"
                 "  static constexpr int kArch = {};\n"
                 "{}"
                 "{}",
                 source.spec_name, rules.template_include, element_type(spec.dtype),
                 spec.head_dim, spec.block_m, spec.block_n, spec.num_warps, spec.num_stages,
                 mask_constant(spec.mask), spec.has_softcap ? "true" : "false", spec.arch.sm, constants,
                 rules.config_members ? rules.config_members(spec) : std::string());
  if (spec.continues) out += "  static constexpr bool kContinues = true;\n";
  if (spec.ordered_dq) out += "  static constexpr bool kOrderedDq = true;\n";
  if (spec.modifier != nullptr || spec.block_sparse)
    out += modifiers_struct(spec, rules.computes_gradients, source,
                            1 + static_cast<int>(std::count(out.begin(), out.end(), '\n')));
  out += "};\n}  // namespace flashjit_generated\n";

  const KernelLayout layout = kernel_layout(spec);
  for (const auto& entry : rules.entries) {
    const std::string symbol = entry_symbol(rules, entry);
    fmt::format_to(std::back_inserter(out),
                   "\nextern \"C\" __global__ void __launch_bounds__({}, {})\n"
                   "{}({} {} params) {{\n"
                   "  {}<flashjit_generated::Config>(params);\n"
                   "}}\n",
                   layout.threads, layout.min_blocks_per_sm, symbol,
                   entry.grid_constant ? "const __grid_constant__" : "const", entry.params_type,
                   entry.device_function);
    source.entry_names.push_back(symbol);
  }
  return source;
}

KernelLayout kernel_layout(const KernelSpec& spec) {
  if (auto reason = spec.validate())
    throw Error(ErrorCode::invalid_argument, "kernel layout",
                fmt::format("illegal kernel spec {}: {}", spec.name(), *reason));
  const auto& rules = family_rules(spec.family);
  KernelLayout layout;
  layout.family = rules.name;
  layout.threads = rules.threads(spec);
  layout.min_blocks_per_sm = rules.min_blocks_per_sm ? rules.min_blocks_per_sm(spec) : 1;
  layout.constants = rules.constants(spec);
  for (const auto& entry : rules.entries)
    layout.entries.push_back(
        {entry.name, entry_symbol(rules, entry), entry.smem_constant.empty() ? 0 : layout.constant(entry.smem_constant),
         entry.cluster_constant.empty() ? 0 : layout.constant(entry.cluster_constant)});
  return layout;
}

const KernelEntry& KernelLayout::entry(std::string_view name) const { return entries[entry_index(name)]; }

size_t KernelLayout::entry_index(std::string_view name) const {
  for (size_t i = 0; i < entries.size(); ++i)
    if (entries[i].name == name) return i;
  throw Error(ErrorCode::internal, "kernel layout", fmt::format("family {} has no entry '{}'", family, name));
}

int KernelLayout::constant(std::string_view name) const {
  for (const KernelConstant& c : constants)
    if (c.name == name) return c.value;
  throw Error(ErrorCode::internal, "kernel layout", fmt::format("family {} renders no constant {}", family, name));
}

int KernelLayout::max_dynamic_smem_bytes() const {
  int bytes = 0;
  for (const KernelEntry& e : entries) bytes = std::max(bytes, e.dynamic_smem_bytes);
  return bytes;
}

int threads_per_block(const KernelSpec& spec) { return family_rules(spec.family).threads(spec); }

int dynamic_smem_bytes(const KernelSpec& spec) { return kernel_layout(spec).max_dynamic_smem_bytes(); }

int max_smem_per_sm(const Arch& arch) { return max_smem_per_block(arch) + 1024; }  // the driver keeps 1 KB per CTA

int max_smem_per_block(const Arch& arch) {
  switch (arch.sm) {
    case 80: case 87: return 163 * 1024;
    case 90: case 100: case 103: return 227 * 1024;
    default: return 99 * 1024;  // sm_86, sm_89, sm_120 and anything not known to have more
  }
}

namespace codegen_detail {

extern const FamilyRules kReferenceFwdRules;
extern const FamilyRules kFa2FwdRules;
extern const FamilyRules kFa2BwdRules;
extern const FamilyRules kSm90FwdRules;
extern const FamilyRules kSm90BwdRules;
extern const FamilyRules kKvCacheFwdRules;
extern const FamilyRules kBlockMaskRules;

// The family table: every family's rules, in the order of the Family enum (a new family is a line
// here and its enum value).
const std::vector<const FamilyRules*>& all_family_rules() {
  static const std::vector<const FamilyRules*> table{&kReferenceFwdRules, &kFa2FwdRules, &kFa2BwdRules,
                                                     &kSm90FwdRules, &kSm90BwdRules, &kKvCacheFwdRules,
                                                     &kBlockMaskRules};
  return table;
}

const FamilyRules& family_rules(Family family) {
  const auto& table = all_family_rules();
  const auto index = static_cast<size_t>(family);
  if (index >= table.size() || table[index]->family != family)
    throw Error(ErrorCode::internal, "codegen", "the family table is out of the Family enum's order");
  return *table[index];
}

}  // namespace codegen_detail
}  // namespace flashjit
