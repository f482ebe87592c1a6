// User modifiers and block masks on sm90_fwd, against the float64 reference with the same mask and
// score functions applied densely: FlexAttention's examples (document masking, prefix-LM, sliding
// window with sinks, ALiBi, tanh softcap), causal written as a user mask beside the built-in one,
// random block masks at densities 0, 5%, 50% and 100% (with a random element mask in their partial
// tiles), rows that see no key, head dims 64/128/256 and GQA. The block mask builder's lists are
// compared with lists computed on the host.
#include <catch2/catch.hpp>

#include <algorithm>
#include <memory>
#include <random>

#include "support/attention_checks.hpp"

using namespace flashjit;
using namespace flashjit::test;

namespace {

bool hopper_or_skip() {
  if (device_properties(0).arch().name() == "sm_90a") return true;
  CaseLedger::get().skipped(Catch::getResultCapture().getCurrentTestName(), "sm90_fwd needs an sm_90 device");
  return false;
}

std::shared_ptr<const AttentionModifier> modifier(std::string mask, std::string score,
                                                  std::vector<ModifierTensor> tensors = {}) {
  auto m = std::make_shared<AttentionModifier>();
  m->mask = std::move(mask);
  m->score = std::move(score);
  m->tensors = std::move(tensors);
  return m;
}

// A block mask on the device in FlexAttention's layout, with every array the builder writes.
struct DeviceBlockMask {
  int batch, heads, q_blocks, kv_blocks;
  DeviceBuffer kv_num, kv_ids, full_num, full_ids, q_num, q_ids, full_q_num, full_q_ids;
  BlockMaskBuffers buffers;
  BlockMask mask;

  DeviceBlockMask(int batch_, int heads_, int seqlen_q, int seqlen_k, int block = 128)
      : batch(batch_), heads(heads_), q_blocks((seqlen_q + block - 1) / block), kv_blocks((seqlen_k + block - 1) / block),
        kv_num(rows() * 4), kv_ids(rows() * kv_blocks * 4), full_num(rows() * 4), full_ids(rows() * kv_blocks * 4),
        q_num(columns() * 4), q_ids(columns() * q_blocks * 4), full_q_num(columns() * 4), full_q_ids(columns() * q_blocks * 4) {
    auto view = [](DeviceBuffer& b, std::initializer_list<int64_t> shape) {
      return TensorView::contiguous(b.get(), ScalarType::int32, shape);
    };
    for (DeviceBuffer* b : {&kv_num, &kv_ids, &full_num, &full_ids, &q_num, &q_ids, &full_q_num, &full_q_ids}) b->poison();
    buffers.kv_num_blocks = view(kv_num, {batch, heads, q_blocks});
    buffers.kv_indices = view(kv_ids, {batch, heads, q_blocks, kv_blocks});
    buffers.full_kv_num_blocks = view(full_num, {batch, heads, q_blocks});
    buffers.full_kv_indices = view(full_ids, {batch, heads, q_blocks, kv_blocks});
    buffers.q_num_blocks = view(q_num, {batch, heads, kv_blocks});
    buffers.q_indices = view(q_ids, {batch, heads, kv_blocks, q_blocks});
    buffers.full_q_num_blocks = view(full_q_num, {batch, heads, kv_blocks});
    buffers.full_q_indices = view(full_q_ids, {batch, heads, kv_blocks, q_blocks});
    buffers.q_block_size = buffers.kv_block_size = block;
    mask.kv_num_blocks = buffers.kv_num_blocks;
    mask.kv_indices = buffers.kv_indices;
    mask.full_kv_num_blocks = &buffers.full_kv_num_blocks;
    mask.full_kv_indices = &buffers.full_kv_indices;
    mask.q_block_size = mask.kv_block_size = block;
  }
  size_t rows() const { return size_t(batch) * heads * q_blocks; }
  size_t columns() const { return size_t(batch) * heads * kv_blocks; }

  // The lists the builder must write for tile states `states` (batch, heads, q_blocks, kv_blocks).
  void check_lists(const std::vector<uint8_t>& states) {
    const auto got_kv_num = kv_num.download<int>(), got_kv_ids = kv_ids.download<int>();
    const auto got_full_num = full_num.download<int>(), got_full_ids = full_ids.download<int>();
    const auto got_q_num = q_num.download<int>(), got_q_ids = q_ids.download<int>();
    const auto got_full_q_num = full_q_num.download<int>(), got_full_q_ids = full_q_ids.download<int>();
    size_t bad = 0;
    for (size_t pair = 0; pair < size_t(batch) * heads; ++pair) {
      for (int r = 0; r < q_blocks; ++r) {
        std::vector<int> partial, full;
        for (int c = 0; c < kv_blocks; ++c) {
          const int state = states[(pair * q_blocks + r) * kv_blocks + c];
          if (state == 1) partial.push_back(c);
          if (state == 2) full.push_back(c);
        }
        const size_t row = pair * q_blocks + r;
        bad += got_kv_num[row] != int(partial.size()) || got_full_num[row] != int(full.size());
        for (size_t i = 0; i < partial.size() && i < size_t(kv_blocks); ++i) bad += got_kv_ids[row * kv_blocks + i] != partial[i];
        for (size_t i = 0; i < full.size() && i < size_t(kv_blocks); ++i) bad += got_full_ids[row * kv_blocks + i] != full[i];
      }
      for (int c = 0; c < kv_blocks; ++c) {
        std::vector<int> partial, full;
        for (int r = 0; r < q_blocks; ++r) {
          const int state = states[(pair * q_blocks + r) * kv_blocks + c];
          if (state == 1) partial.push_back(r);
          if (state == 2) full.push_back(r);
        }
        const size_t column = pair * kv_blocks + c;
        bad += got_q_num[column] != int(partial.size()) || got_full_q_num[column] != int(full.size());
        for (size_t i = 0; i < partial.size(); ++i) bad += got_q_ids[column * q_blocks + i] != partial[i];
        for (size_t i = 0; i < full.size(); ++i) bad += got_full_q_ids[column * q_blocks + i] != full[i];
      }
    }
    CHECK(bad == 0);
  }
};

// Tile states of `fn` over the whole mask, as the builder defines them (elements past the sequence
// do not count).
std::vector<uint8_t> host_tile_states(int batch, int heads, int seqlen_q, int seqlen_k, int block,
                                      const std::function<bool(int, int, int, int)>& fn) {
  const int q_blocks = (seqlen_q + block - 1) / block, kv_blocks = (seqlen_k + block - 1) / block;
  std::vector<uint8_t> states(size_t(batch) * heads * q_blocks * kv_blocks);
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < heads; ++h)
      for (int r = 0; r < q_blocks; ++r)
        for (int c = 0; c < kv_blocks; ++c) {
          bool any_visible = false, any_hidden = false;
          for (int i = r * block; i < std::min(seqlen_q, (r + 1) * block); ++i)
            for (int j = c * block; j < std::min(seqlen_k, (c + 1) * block); ++j) (fn(b, h, i, j) ? any_visible : any_hidden) = true;
          states[((size_t(b) * heads + h) * q_blocks + r) * kv_blocks + c] = !any_visible ? 0 : any_hidden ? 1 : 2;
        }
  return states;
}

struct ModifierRun {
  AttentionShape shape;
  std::shared_ptr<const AttentionModifier> code;
  std::vector<TensorView> tensors;
  bool block_mask = false;  // build one with create_block_mask and pass it
};

void check_modifier(ModifierRun r, uint64_t seed) {
  AttentionMod mod{r.code, r.tensors};
  AttentionOptions options;
  options.mod = &mod;
  std::unique_ptr<DeviceBlockMask> mask;
  if (r.block_mask) {
    mask = std::make_unique<DeviceBlockMask>(r.shape.batch, r.shape.heads_q, r.shape.seqlen_q, r.shape.seqlen_k);
    test_runtime().create_block_mask(mod, r.shape.batch, r.shape.heads_q, r.shape.seqlen_q, r.shape.seqlen_k, mask->buffers);
    synchronize();
    mask->check_lists(host_tile_states(r.shape.batch, r.shape.heads_q, r.shape.seqlen_q, r.shape.seqlen_k, 128, r.shape.mask_fn));
    options.block_mask = &mask->mask;
  }
  AttentionCase c(r.shape, DType::bf16, seed);
  c.run(test_runtime(), options);
  INFO(c.describe() << (r.block_mask ? " with a block mask" : "") << " mask {" << r.code->mask << "} score {"
                    << r.code->score << "}");
  check_against_oracle(c, tensor_core_output_tolerance(DType::bf16), tensor_core_lse_tolerance());
}

// Document ids of a packed batch: documents of lengths cycling through `lengths`.
std::vector<int> document_ids(int seqlen, std::vector<int> lengths) {
  std::vector<int> ids(seqlen);
  int doc = 0, left = lengths[0];
  for (int i = 0; i < seqlen; ++i) {
    if (left == 0) left = lengths[++doc % lengths.size()];
    ids[i] = doc;
    --left;
  }
  return ids;
}

}  // namespace

TEST_CASE("modifiers: document masking, prefix-LM and sliding window with sinks, through block masks", "[modifiers][quick]") {
  if (!hopper_or_skip()) return;
  for (int head_dim : {64, 128, 256}) {
    const int seqlen = head_dim == 128 ? 1000 : 700;
    const std::vector<int> docs = document_ids(seqlen, {300, 57, 129, 500});
    DeviceBuffer doc_buffer(docs.size() * 4);
    doc_buffer.upload(docs);
    const TensorView doc_view = TensorView::contiguous(doc_buffer.get(), ScalarType::int32, {seqlen});

    ModifierRun document;
    document.shape = AttentionShape::make(2, seqlen, seqlen, 4, 2, head_dim);
    document.shape.mask_fn = [&](int, int, int i, int j) { return docs[i] == docs[j] && i >= j; };
    document.code = modifier("return doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx;", "", {{"doc", ModifierTensorType::int32}});
    document.tensors = {doc_view};
    document.block_mask = true;
    check_modifier(document, 1);

    ModifierRun prefix;
    prefix.shape = AttentionShape::make(1, seqlen, seqlen, 8, 2, head_dim);
    prefix.shape.mask_fn = [](int, int, int i, int j) { return j < 200 || i >= j; };
    prefix.code = modifier("return kv_idx < 200 || q_idx >= kv_idx;", "");
    prefix.block_mask = true;
    check_modifier(prefix, 2);

    ModifierRun sinks;
    sinks.shape = AttentionShape::make(1, seqlen, seqlen, 4, 4, head_dim);
    sinks.shape.mask_fn = [](int, int, int i, int j) { return j <= i && (i - j < 256 || j < 4); };
    sinks.code = modifier("return kv_idx <= q_idx && (q_idx - kv_idx < 256 || kv_idx < 4);", "");
    sinks.block_mask = true;
    check_modifier(sinks, 3);
  }
}

TEST_CASE("modifiers: ALiBi and tanh softcap as score modifiers, a user mask without a block mask", "[modifiers][quick]") {
  if (!hopper_or_skip()) return;
  const int heads = 8;
  std::vector<float> slopes(heads);
  for (int h = 0; h < heads; ++h) slopes[h] = std::pow(2.f, -8.f * (h + 1) / heads);
  DeviceBuffer slope_buffer(heads * 4);
  slope_buffer.upload(slopes);
  for (int head_dim : {64, 128}) {
    ModifierRun alibi;
    alibi.shape = AttentionShape::make(2, 777, 777, heads, 2, head_dim);
    alibi.shape.causal = true;
    alibi.shape.score_fn = [&](double s, int, int h, int i, int j) { return s - double(slopes[h]) * (i - j); };
    alibi.code = modifier("", "return score - slopes[head] * float(q_idx - kv_idx);", {{"slopes", ModifierTensorType::float32}});
    alibi.tensors = {TensorView::contiguous(slope_buffer.get(), ScalarType::float32, {heads})};
    check_modifier(alibi, 4);

    ModifierRun softcap;
    softcap.shape = AttentionShape::make(1, 513, 1100, 4, 1, head_dim);
    softcap.shape.score_fn = [](double s, int, int, int, int) { return 2.0 * std::tanh(s / 2.0); };
    softcap.code = modifier("", "return 2.f * tanhf(score / 2.f);");
    check_modifier(softcap, 5);

    // A mask modifier on every tile (no block mask) beside a score modifier.
    ModifierRun both;
    both.shape = AttentionShape::make(1, 300, 300, 2, 2, head_dim);
    both.shape.mask_fn = [](int, int h, int i, int j) { return (i + j + h) % 3 != 0; };
    both.shape.score_fn = [](double s, int, int, int i, int j) { return s + 0.01 * ((i ^ j) & 7); };
    both.code = modifier("return (q_idx + kv_idx + head) % 3 != 0;", "return score + 0.01f * float((q_idx ^ kv_idx) & 7);");
    check_modifier(both, 6);
  }
}

TEST_CASE("modifiers: causal as a user mask matches the built-in causal mask", "[modifiers][quick]") {
  if (!hopper_or_skip()) return;
  const AttentionShape shape = AttentionShape::make(2, 1024, 1024, 4, 4, 128);
  ModifierRun user;
  user.shape = shape;
  user.shape.mask_fn = [](int, int, int i, int j) { return i >= j; };
  user.code = modifier("return q_idx >= kv_idx;", "");
  user.block_mask = true;
  check_modifier(user, 7);
}

TEST_CASE("modifiers: random block masks at densities 0, 5%, 50% and 100%", "[modifiers][quick]") {
  if (!hopper_or_skip()) return;
  const int seqlen_q = 1000, seqlen_k = 1300, heads = 4, batch = 2;
  const int q_blocks = (seqlen_q + 127) / 128, kv_blocks = (seqlen_k + 127) / 128;
  // In partial tiles an element mask of the indices; full tiles skip it.
  auto element = [](int, int h, int i, int j) { return (i * 7 + j * 13 + h) % 5 != 0; };
  for (double density : {0.0, 0.05, 0.5, 1.0}) {
    std::mt19937 rng(static_cast<unsigned>(density * 1000) + 11);
    std::vector<uint8_t> states(size_t(batch) * heads * q_blocks * kv_blocks);
    for (auto& s : states) {
      const double u = std::uniform_real_distribution<double>(0, 1)(rng);
      s = u >= density ? 0 : std::uniform_int_distribution<int>(1, 2)(rng);
    }
    DeviceBuffer map(states.size());
    map.upload(states);
    DeviceBlockMask mask(batch, heads, seqlen_q, seqlen_k);
    const TensorView map_view = TensorView::contiguous(map.get(), ScalarType::uint8, {batch, heads, q_blocks, kv_blocks});
    test_runtime().block_mask_from_tiles(map_view, seqlen_q, seqlen_k, mask.buffers);
    synchronize();
    mask.check_lists(states);

    ModifierRun run;
    run.shape = AttentionShape::make(batch, seqlen_q, seqlen_k, heads, 2, 128);
    run.shape.mask_fn = [&](int b, int h, int i, int j) {
      const int state = states[((size_t(b) * heads + h) * q_blocks + i / 128) * kv_blocks + j / 128];
      return state == 2 || (state == 1 && element(b, h, i, j));
    };
    AttentionMod mod{modifier("return (q_idx * 7 + kv_idx * 13 + head) % 5 != 0;", ""), {}};
    AttentionOptions options;
    options.mod = &mod;
    options.block_mask = &mask.mask;
    AttentionCase c(run.shape, DType::bf16, 8);
    c.run(test_runtime(), options);
    INFO(c.describe() << " block density " << density);
    check_against_oracle(c, tensor_core_output_tolerance(DType::bf16), tensor_core_lse_tolerance());
  }
}

TEST_CASE("modifiers: bad block masks and side tensors are refused by name", "[modifiers][quick]") {
  if (!hopper_or_skip()) return;
  DeviceBuffer q(2 * 256 * 2 * 64 * 2), o(2 * 256 * 2 * 64 * 2);
  const TensorView qv = TensorView::contiguous(q.get(), ScalarType::bfloat16, {2, 256, 2, 64});
  const TensorView ov = TensorView::contiguous(o.get(), ScalarType::bfloat16, {2, 256, 2, 64});
  DeviceBlockMask wrong_rows(2, 2, 384, 256);  // 3 query blocks where 256 rows make 2
  AttentionMod mod{modifier("return doc[q_idx] == doc[kv_idx];", "", {{"doc", ModifierTensorType::int32}}), {}};
  AttentionOptions options;
  options.mod = &mod;
  CHECK_THROWS_WITH(test_runtime().forward(qv, qv, qv, ov, nullptr, options), Catch::Contains("1 side tensors, 0 were given"));
  DeviceBuffer doc(256 * 8);
  mod.tensors = {TensorView::contiguous(doc.get(), ScalarType::int64, {256})};
  CHECK_THROWS_WITH(test_runtime().forward(qv, qv, qv, ov, nullptr, options), Catch::Contains("expected dtype int32"));
  mod.tensors = {TensorView::contiguous(doc.get(), ScalarType::int32, {256})};
  options.block_mask = &wrong_rows.mask;
  CHECK_THROWS_WITH(test_runtime().forward(qv, qv, qv, ov, nullptr, options), Catch::Contains("3 query blocks"));
  options.causal = true;
  CHECK_THROWS_WITH(test_runtime().forward(qv, qv, qv, ov, nullptr, options), Catch::Contains("replaces causal"));
}
