// AttentionModifier: user code compiled into a kernel, FlexAttention's mask_mod and score_mod
// written as CUDA C++ function bodies, with the read-only side tensors they read by name. It is part
// of a KernelSpec (and so of the cache key and the tuning DB's), compared and hashed by content.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace flashjit {

// The element type of a side tensor as the modifier code sees it: `const <type>* __restrict__ name`.
enum class ModifierTensorType { int32, int64, float32 };

struct ModifierTensor {
  std::string name;  // a C++ identifier the bodies use
  ModifierTensorType type = ModifierTensorType::int32;
  bool operator==(const ModifierTensor& o) const { return name == o.name && type == o.type; }
};

// The most side tensors one modifier may read (the kernels' parameter block has this many slots).
constexpr int kMaxModifierTensors = 8;

struct AttentionModifier {
  // Body of `bool mask(int batch, int head, int q_idx, int kv_idx)`: whether query q_idx may see key
  // kv_idx (indices within the sequence, head a query head). Empty: every key is visible.
  std::string mask;
  // Body of `float score(float score, int batch, int head, int q_idx, int kv_idx)`: the score to use
  // instead of `score` (q.k times the softmax scale). Empty: the score is kept.
  std::string score;
  // Body of `float score_grad(float score, int batch, int head, int q_idx, int kv_idx)`: the
  // derivative of the score body with respect to `score`, for the backward. Empty: the backward
  // derives it, running the score body on dual numbers (templates/common/modifiers.cuh), which
  // takes the arithmetic operators and the usual math functions (expf, tanhf, logf, fabsf, ...).
  std::string score_grad;
  std::vector<ModifierTensor> tensors;  // side tensors, in the order their pointers are passed

  bool has_mask() const { return !mask.empty(); }
  bool has_score() const { return !score.empty(); }
  bool has_score_grad() const { return !score_grad.empty(); }
  // Why the modifier cannot be rendered (no body, a bad or reserved tensor name, too many tensors).
  std::optional<std::string> validate() const;
  // 16 hex digits over every field: what spec names carry (FNV-1a, 64 bits).
  std::string hash() const;

  nlohmann::json to_json() const;
  static AttentionModifier from_json(const nlohmann::json& j);  // strict, as KernelSpec::from_json

  bool operator==(const AttentionModifier& o) const {
    return mask == o.mask && score == o.score && score_grad == o.score_grad && tensors == o.tensors;
  }
  bool operator!=(const AttentionModifier& o) const { return !(*this == o); }
};

std::string_view to_string(ModifierTensorType t);
ModifierTensorType parse_modifier_tensor_type(std::string_view text);

// The names NVRTC reports for the bodies' lines (#line directives), so a compile error points at
// the user's own line numbers.
constexpr std::string_view kMaskModFile = "mask_mod";
constexpr std::string_view kScoreModFile = "score_mod";
constexpr std::string_view kScoreGradFile = "score_grad";

}  // namespace flashjit
