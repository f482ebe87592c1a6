#include "flashjit/codegen/modifier.hpp"

#include <algorithm>
#include <cctype>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "flashjit/error.hpp"

namespace flashjit {

using nlohmann::json;

namespace {

constexpr std::string_view kTypeNames[] = {"int32", "int64", "float32"};

// The functions' own parameters and the names the rendered code declares beside the tensors.
constexpr std::string_view kReservedNames[] = {"batch", "head", "q_idx", "kv_idx", "score", "flashjit_params"};

bool is_identifier(std::string_view name) {
  if (name.empty() || !(std::isalpha(static_cast<unsigned char>(name[0])) || name[0] == '_')) return false;
  return std::all_of(name.begin(), name.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

}  // namespace

std::string_view to_string(ModifierTensorType t) { return kTypeNames[static_cast<int>(t)]; }

ModifierTensorType parse_modifier_tensor_type(std::string_view text) {
  for (size_t i = 0; i < std::size(kTypeNames); ++i)
    if (kTypeNames[i] == text) return static_cast<ModifierTensorType>(i);
  throw Error(ErrorCode::invalid_argument, "modifier",
              fmt::format("unknown side tensor type '{}' (expected one of: {})", text, fmt::join(kTypeNames, ", ")));
}

std::optional<std::string> AttentionModifier::validate() const {
  if (!has_mask() && !has_score()) return std::string("a modifier needs a mask body, a score body or both");
  if (has_score_grad() && !has_score()) return std::string("a score gradient body needs the score body it is the derivative of");
  if (tensors.size() > static_cast<size_t>(kMaxModifierTensors))
    return fmt::format("a modifier reads at most {} side tensors, got {}", kMaxModifierTensors, tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string& name = tensors[i].name;
    if (!is_identifier(name)) return fmt::format("side tensor name '{}' is not a C++ identifier", name);
    if (std::find(std::begin(kReservedNames), std::end(kReservedNames), name) != std::end(kReservedNames))
      return fmt::format("side tensor name '{}' is taken by the modifier functions' parameters ({})", name,
                         fmt::join(kReservedNames, ", "));
    for (size_t j = 0; j < i; ++j)
      if (tensors[j].name == name) return fmt::format("side tensor name '{}' is given twice", name);
  }
  return std::nullopt;
}

std::string AttentionModifier::hash() const {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&](std::string_view text) {
    for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
    h = (h ^ 0xff) * 0x100000001b3ull;  // a separator, so that fields cannot run into each other
  };
  mix(mask);
  mix(score);
  // (Only when given, so that modifiers without one keep their names and cache entries.)
  if (has_score_grad()) mix("score_grad:" + score_grad);
  for (const ModifierTensor& t : tensors) {
    mix(t.name);
    mix(to_string(t.type));
  }
  return fmt::format("{:016x}", h);
}

json AttentionModifier::to_json() const {
  json list = json::array();
  for (const ModifierTensor& t : tensors) list.push_back({{"name", t.name}, {"type", to_string(t.type)}});
  json j{{"mask", mask}, {"score", score}, {"tensors", list}};
  if (has_score_grad()) j["score_grad"] = score_grad;
  return j;
}

AttentionModifier AttentionModifier::from_json(const json& j) {
  auto fail = [](const std::string& message) { return Error(ErrorCode::invalid_argument, "modifier JSON", message); };
  if (!j.is_object()) throw fail(fmt::format("a modifier must be a JSON object, got {}", j.dump()));
  for (const auto& [key, value] : j.items())
    if (key != "mask" && key != "score" && key != "score_grad" && key != "tensors")
      throw fail(fmt::format("unknown field '{}' (known: mask, score, score_grad, tensors)", key));
  auto text = [&](const char* key) {
    auto it = j.find(key);
    if (it == j.end() || !it->is_string()) throw fail(fmt::format("field '{}' must be a string", key));
    return it->get<std::string>();
  };
  AttentionModifier m;
  m.mask = text("mask");
  m.score = text("score");
  if (j.contains("score_grad")) m.score_grad = text("score_grad");  // optional
  auto tensors = j.find("tensors");
  if (tensors == j.end() || !tensors->is_array()) throw fail("field 'tensors' must be an array");
  for (const json& t : *tensors) {
    if (!t.is_object() || !t.contains("name") || !t.contains("type") || !t["name"].is_string() ||
        !t["type"].is_string() || t.size() != 2)
      throw fail(fmt::format("a side tensor is {{\"name\": string, \"type\": string}}, got {}", t.dump()));
    m.tensors.push_back({t["name"].get<std::string>(), parse_modifier_tensor_type(t["type"].get<std::string>())});
  }
  if (auto reason = m.validate()) throw fail(*reason);
  return m;
}

}  // namespace flashjit
