// User modifiers and block masks without a GPU: the modifier's validation and JSON, specs that
// carry one (names, keys, rules), the rendered functions and their #line numbering, a compile error
// quoted at the user's own line, the C API's modifier handle, and bad block masks named before
// anything runs.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include "compiler.hpp"
#include "flashjit/codegen/kernel_spec.hpp"
#include "flashjit/codegen/render.hpp"
#include "flashjit/error.hpp"
#include "flashjit/flashjit.h"
#include "flashjit/flashjit.hpp"
#include "support/fake_tensors.hpp"

using namespace flashjit;

namespace {

std::shared_ptr<const AttentionModifier> document_mask(std::string body = "return doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx;") {
  auto m = std::make_shared<AttentionModifier>();
  m->mask = std::move(body);
  m->tensors = {{"doc", ModifierTensorType::int32}};
  return m;
}

KernelSpec sparse_spec(std::shared_ptr<const AttentionModifier> modifier, int head_dim = 128) {
  return default_spec(Family::sm90_fwd, Arch::parse("sm_90a"), DType::bf16, head_dim, MaskKind::none, false,
                      std::move(modifier), true);
}

}  // namespace

TEST_CASE("modifiers: validation names what is wrong", "[modifiers]") {
  AttentionModifier m;
  CHECK_THAT(*m.validate(), Catch::Contains("needs a mask body, a score body or both"));
  m.mask = "return true;";
  CHECK_FALSE(m.validate().has_value());
  m.tensors = {{"q_idx", ModifierTensorType::int32}};
  CHECK_THAT(*m.validate(), Catch::Contains("taken by the modifier functions' parameters"));
  m.tensors = {{"2doc", ModifierTensorType::int32}};
  CHECK_THAT(*m.validate(), Catch::Contains("not a C++ identifier"));
  m.tensors = {{"doc", ModifierTensorType::int32}, {"doc", ModifierTensorType::float32}};
  CHECK_THAT(*m.validate(), Catch::Contains("given twice"));
  m.tensors.assign(9, {"t", ModifierTensorType::int32});
  for (int i = 0; i < 9; ++i) m.tensors[i].name = "t" + std::to_string(i);
  CHECK_THAT(*m.validate(), Catch::Contains("at most 8 side tensors"));
  m.tensors.clear();
  m.score_grad = "return 1.f;";
  CHECK_THAT(*m.validate(), Catch::Contains("needs the score body it is the derivative of"));
}

TEST_CASE("modifiers: a score gradient body is part of the hash and the JSON, optional in both", "[modifiers]") {
  AttentionModifier m;
  m.score = "return 2.f * score;";
  const std::string without = m.hash();
  CHECK(AttentionModifier::from_json(m.to_json()) == m);
  CHECK_FALSE(m.to_json().contains("score_grad"));  // modifiers without one keep their JSON and names
  m.score_grad = "return 2.f;";
  CHECK(m.hash() != without);
  CHECK(AttentionModifier::from_json(m.to_json()) == m);
}

TEST_CASE("modifiers: specs carry them in names, JSON, equality and hashes", "[modifiers]") {
  const KernelSpec a = sparse_spec(document_mask());
  const KernelSpec b = sparse_spec(document_mask("return doc[q_idx] == doc[kv_idx];"));
  CHECK_FALSE(a.validate().has_value());
  CHECK_THAT(a.name(), Catch::Contains("_mod" + a.modifier->hash().substr(0, 12) + "_sparse_sm90a"));
  CHECK(a != b);
  CHECK(a.name() != b.name());
  CHECK(KernelSpecHash{}(a) != KernelSpecHash{}(b));
  // An equal modifier in another object is the same spec (the in-memory cache keys on content).
  CHECK(a == sparse_spec(document_mask()));
  CHECK(KernelSpecHash{}(a) == KernelSpecHash{}(sparse_spec(document_mask())));
  const KernelSpec round_trip = KernelSpec::from_json(a.to_json());
  CHECK(round_trip == a);
  CHECK(round_trip.modifier->tensors[0].name == "doc");
  // Plain specs keep the JSON they always had.
  const KernelSpec plain = default_spec(Family::sm90_fwd, Arch::parse("sm_90a"), DType::bf16, 128);
  CHECK_FALSE(plain.to_json().contains("modifier"));
  CHECK_FALSE(plain.to_json().contains("block_sparse"));
  nlohmann::json bad = a.to_json();
  bad["modifier"]["tensors"][0]["type"] = "int8";
  CHECK_THROWS_WITH(KernelSpec::from_json(bad), Catch::Contains("unknown side tensor type 'int8'"));
}

TEST_CASE("modifiers: the rules say which specs may carry them", "[modifiers]") {
  KernelSpec kvcache = default_spec(Family::kvcache_fwd, Arch::parse("sm_80"), DType::bf16, 128);
  kvcache.modifier = document_mask();
  CHECK_THAT(*kvcache.validate(), Catch::Contains("does not compile user modifiers"));
  kvcache.modifier = nullptr;
  kvcache.block_sparse = true;
  CHECK_THAT(*kvcache.validate(), Catch::Contains("does not walk block masks"));
  KernelSpec fa2_forward = default_spec(Family::fa2_fwd, Arch::parse("sm_80"), DType::bf16, 128, MaskKind::none, false,
                                        document_mask(), true);
  CHECK_FALSE(fa2_forward.validate().has_value());
  KernelSpec causal = sparse_spec(document_mask());
  causal.mask = MaskKind::causal;
  CHECK_THAT(*causal.validate(), Catch::Contains("a block mask replaces the causal mask"));
  auto softcap_score = std::make_shared<AttentionModifier>();
  softcap_score->score = "return score;";
  KernelSpec both = default_spec(Family::sm90_fwd, Arch::parse("sm_90a"), DType::bf16, 128, MaskKind::none, true,
                                 softcap_score);
  CHECK_THAT(*both.validate(), Catch::Contains("a softcap and a score modifier do not combine"));
  // A block mask's tiles divide FlexAttention's 128 x 128 blocks at every head dim.
  for (int d : {64, 96, 128, 192, 256}) {
    const KernelSpec s = sparse_spec(document_mask(), d);
    INFO(s.name());
    CHECK_FALSE(s.validate().has_value());
    CHECK(128 % s.block_m == 0);
    CHECK(128 % s.block_n == 0);
  }
  // fa2_bwd's too (the backward on sm_80, and in deterministic mode under a block mask on sm_90),
  // its deterministic dq entry's tile included; 64 keys at head dim 128 (128 spilled there).
  for (const char* arch : {"sm_80", "sm_86", "sm_90a"})
    for (int d : {32, 64, 96, 128, 160, 192, 224, 256}) {
      const KernelSpec s = default_spec(Family::fa2_bwd, Arch::parse(arch), DType::bf16, d, MaskKind::none, false,
                                        document_mask(), true);
      INFO(s.name());
      CHECK_FALSE(s.validate().has_value());
      const KernelLayout layout = kernel_layout(s);
      for (int tile : {s.block_m, s.block_n, layout.constant("kDqBlockM"), layout.constant("kDqBlockN")})
        CHECK(128 % tile == 0);
      if (d == 128) CHECK(s.block_n == 64);
    }
}

TEST_CASE("modifiers: rendered as functions numbered with the user's lines", "[modifiers]") {
  const Source source = render(sparse_spec(document_mask("return doc[q_idx] == doc[kv_idx] &&\n  q_idx >= kv_idx;")));
  const std::string& text = source.text;
  CHECK_THAT(text, Catch::Contains("static constexpr bool kBlockSparse = true;"));
  CHECK_THAT(text, Catch::Contains("const int* __restrict__ doc = static_cast<const int*>(flashjit_params.modifier_tensors[0]);"));
  CHECK_THAT(text, Catch::Contains("#line 1 \"mask_mod\"\nreturn doc[q_idx] == doc[kv_idx] &&\n  q_idx >= kv_idx;\n#line "));
  // After each body the numbering returns to the file's own: the line after the directive is that line.
  size_t pos = 0;
  int directives = 0;
  while ((pos = text.find("#line ", pos)) != std::string::npos) {
    const size_t end = text.find('\n', pos);
    const std::string directive = text.substr(pos, end - pos);
    if (directive.find(source.file_name) != std::string::npos) {
      ++directives;
      const int said = std::stoi(directive.substr(6));
      const int actual = 2 + static_cast<int>(std::count(text.begin(), text.begin() + pos, '\n'));
      CHECK(said == actual);
    }
    pos = end;
  }
  CHECK(directives == 1);  // the mask's body (the score function is the default `return score;`)
  REQUIRE(source.user_files.size() == 1);
  CHECK(source.user_files[0].first == "mask_mod");
}

// The backward's score functions: the user's gradient body, or the score body run on dual numbers
// (which compiles for arithmetic and math functions, and says why where a float holds the score).
TEST_CASE("modifiers: the backward's score gradient, given or derived", "[modifiers][compile]") {
  auto backward_spec = [](std::string score, std::string score_grad) {
    auto m = std::make_shared<AttentionModifier>();
    m->score = std::move(score);
    m->score_grad = std::move(score_grad);
    return default_spec(Family::sm90_bwd, Arch::parse("sm_90a"), DType::bf16, 64, MaskKind::none, false, m);
  };
  const Source given = render(backward_spec("return 2.f * score;", "return 2.f;"));
  CHECK_THAT(given.text, Catch::Contains("#line 1 \"score_grad\"\nreturn 2.f;"));
  CHECK_THAT(given.text, Catch::Contains("gradient = score_grad(p, s, batch, head, q_idx, kv_idx);"));
  const Source derived = render(backward_spec("return q_idx >= kv_idx ? 30.f * tanhf(score / 30.f) : -INFINITY;", ""));
  CHECK_THAT(derived.text, Catch::Contains("flashjit::kernels::ScoreDual(s, 1.f)"));
  CHECK_NOTHROW(detail::compile_source(derived, Arch::parse("sm_90a")));
  try {
    detail::compile_source(render(backward_spec("float t = score * 2.f;\nreturn t;", "")), Arch::parse("sm_90a"));
    FAIL("a float holding the score compiled on dual numbers");
  } catch (const Error& e) {
    const std::string message = e.what();
    CHECK_THAT(message, Catch::Contains("score_mod(1): error"));
    CHECK_THAT(message, Catch::Contains("dual numbers"));
  }
}

TEST_CASE("modifiers: a body that does not compile is quoted at the user's line", "[modifiers][compile]") {
  const Source source = render(sparse_spec(document_mask("return doc[q_idx] == doc[kv_idx] &&\n  q_idx >= kv_idx + undefined_name;")));
  try {
    detail::compile_source(source, Arch::parse("sm_90a"));
    FAIL("the broken modifier compiled");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::compile_failed);
    const std::string message = e.what();
    CHECK_THAT(message, Catch::Contains("mask_mod(2): error: identifier \"undefined_name\" is undefined"));
    CHECK_THAT(message, Catch::Contains(">     2 |   q_idx >= kv_idx + undefined_name;"));
    CHECK_THAT(message, Catch::Contains("      1 | return doc[q_idx] == doc[kv_idx] &&"));
  }
}

TEST_CASE("modifiers: the C API's handle and bad block masks, before anything runs", "[modifiers][api]") {
  flashjit_modifier* modifier = nullptr;
  const char* names[] = {"doc"};
  const int32_t dtypes[] = {FLASHJIT_INT32};
  CHECK(flashjit_modifier_create(nullptr, nullptr, nullptr, 0, nullptr, nullptr, &modifier) == FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("needs a mask body"));
  const int32_t bad_dtypes[] = {FLASHJIT_BFLOAT16};
  CHECK(flashjit_modifier_create("return true;", nullptr, nullptr, 1, names, bad_dtypes, &modifier) == FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("is not int32, int64 or float32"));
  REQUIRE(flashjit_modifier_create("return doc[q_idx] == doc[kv_idx];", nullptr, nullptr, 1, names, dtypes, &modifier) == FLASHJIT_OK);
  REQUIRE(modifier != nullptr);

  // Host memory stands in for device memory: every check below comes before the driver is asked.
  auto tensor = [](int dtype, std::vector<int64_t> shape) { return test::FakeTensors::tensor(dtype, std::move(shape)); };
  unsigned char* arena = test::FakeTensors::arena;
  const flashjit_tensor q = tensor(FLASHJIT_BFLOAT16, {1, 256, 2, 64}), out = q;
  const flashjit_tensor doc = tensor(FLASHJIT_INT32, {256});
  const flashjit_tensor lse_tensor = tensor(FLASHJIT_FLOAT32, {1, 2, 256});
  flashjit_attention_options options;
  flashjit_attention_options_init(&options);
  CHECK(flashjit_forward_mod(&q, &q, &q, &out, nullptr, modifier, nullptr, 0, nullptr, &options) ==
        FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("the code reads 1 side tensors, 0 were given"));
  const flashjit_tensor doc64 = tensor(FLASHJIT_INT64, {256});
  CHECK(flashjit_forward_mod(&q, &q, &q, &out, nullptr, modifier, &doc64, 1, nullptr, &options) ==
        FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("mod tensor 'doc': expected dtype int32, got int64"));

  flashjit_block_mask mask{};
  mask.kv_num_blocks = tensor(FLASHJIT_INT32, {1, 1, 3});  // 256 rows make 2 query blocks of 128
  mask.kv_indices = tensor(FLASHJIT_INT32, {1, 1, 3, 2});
  mask.q_block_size = mask.kv_block_size = 128;
  CHECK(flashjit_forward_mod(&q, &q, &q, &out, nullptr, modifier, &doc, 1, &mask, &options) ==
        FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("block_mask.kv_num_blocks: 3 query blocks, but seqlen_q 256 in blocks of 128 makes 2"));
  mask.kv_num_blocks = tensor(FLASHJIT_INT32, {1, 3, 2});
  mask.kv_indices = tensor(FLASHJIT_INT32, {1, 3, 2, 2});
  CHECK(flashjit_forward_mod(&q, &q, &q, &out, nullptr, modifier, &doc, 1, &mask, &options) ==
        FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("heads extent 3 must be 1 or heads_q 2"));
  mask.kv_num_blocks = tensor(FLASHJIT_INT32, {1, 1, 2});
  mask.kv_indices = tensor(FLASHJIT_INT32, {1, 1, 2, 2});
  options.causal = 1;
  CHECK(flashjit_forward_mod(&q, &q, &q, &out, nullptr, modifier, &doc, 1, &mask, &options) ==
        FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("replaces causal and window_size"));
  options.causal = 0;
  // The backward walks the transposed lists, and says so when they are missing.
  CHECK(flashjit_backward_mod(&q, &q, &q, &out, &out, &lse_tensor, &q, &q, &q, modifier, &doc, 1, &mask, &options) ==
        FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("needs its transposed lists q_num_blocks and q_indices"));
  mask.q_num_blocks = tensor(FLASHJIT_INT32, {1, 1, 3});  // 256 keys make 2 key blocks
  mask.q_indices = tensor(FLASHJIT_INT32, {1, 1, 3, 2});
  CHECK(flashjit_backward_mod(&q, &q, &q, &out, &out, &lse_tensor, &q, &q, &q, modifier, &doc, 1, &mask, &options) ==
        FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("block_mask.q_num_blocks: 3 key blocks, but seqlen_k 256 in blocks of 128 makes 2"));
  // forward_kvcache says it does not take them yet.
  flashjit::AttentionMod mod{std::make_shared<AttentionModifier>(*document_mask()), {}};
  flashjit::AttentionOptions cpp_options;
  cpp_options.mod = &mod;
  const flashjit::TensorView view = flashjit::TensorView::contiguous(arena, flashjit::ScalarType::bfloat16, {1, 256, 2, 64});
  flashjit::KvCache cache;
  cache.k_cache = cache.v_cache = view;
  CHECK_THROWS_WITH(flashjit::Runtime::global().forward_kvcache(view, cache, view, nullptr, cpp_options),
                    Catch::Contains("forward_kvcache does not take user modifiers or block masks yet"));

  flashjit_block_mask_buffers buffers{};
  buffers.kv_num_blocks = tensor(FLASHJIT_INT32, {1, 1, 2});
  buffers.kv_indices = tensor(FLASHJIT_INT32, {1, 1, 2, 3});  // 256 keys make 2 key blocks
  buffers.full_kv_num_blocks = buffers.kv_num_blocks;
  buffers.full_kv_indices = buffers.kv_indices;
  buffers.q_block_size = buffers.kv_block_size = 128;
  CHECK(flashjit_create_block_mask(modifier, &doc, 1, 1, 1, 256, 256, &buffers, nullptr) == FLASHJIT_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(flashjit_last_error(), Catch::Contains("kv_indices: expected shape (1, 1, 2, 2)"));
  flashjit_modifier_destroy(modifier);
}
