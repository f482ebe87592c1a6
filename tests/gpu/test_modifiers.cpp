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
#include "support/backward_case.hpp"

using namespace flashjit;
using namespace flashjit::test;

namespace {

std::shared_ptr<const AttentionModifier> modifier(std::string mask, std::string score,
                                                  std::vector<ModifierTensor> tensors = {}, std::string score_grad = {}) {
  auto m = std::make_shared<AttentionModifier>();
  m->mask = std::move(mask);
  m->score = std::move(score);
  m->score_grad = std::move(score_grad);
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
    mask.q_num_blocks = &buffers.q_num_blocks;
    mask.q_indices = &buffers.q_indices;
    mask.full_q_num_blocks = &buffers.full_q_num_blocks;
    mask.full_q_indices = &buffers.full_q_indices;
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

// `count` tile states of a random block mask: a tile is kept with probability `density`, then
// partly (1) or fully (2) visible at even odds; 0 empty.
std::vector<uint8_t> random_tile_states(size_t count, double density, unsigned seed) {
  std::mt19937 rng(static_cast<unsigned>(density * 1000) + seed);
  std::vector<uint8_t> states(count);
  for (auto& state : states) {
    const double u = std::uniform_real_distribution<double>(0, 1)(rng);
    state = u >= density ? 0 : std::uniform_int_distribution<int>(1, 2)(rng);
  }
  return states;
}

struct ModifierRun {
  AttentionShape shape;
  std::shared_ptr<const AttentionModifier> code;
  std::vector<TensorView> tensors;
  bool block_mask = false;  // build one with create_block_mask and pass it
  Backend backend = Backend::automatic;
  bool deterministic = false;  // (the backward)
};

// Builds the run's block mask (checking its lists against the host's) into `mask` and returns the
// options of the run.
AttentionOptions modifier_options(const ModifierRun& r, AttentionMod& mod, std::unique_ptr<DeviceBlockMask>& mask) {
  mod = AttentionMod{r.code, r.tensors};
  AttentionOptions options;
  options.mod = &mod;
  options.backend = r.backend;
  options.deterministic = r.deterministic;
  if (r.block_mask) {
    mask = std::make_unique<DeviceBlockMask>(r.shape.batch, r.shape.heads_q, r.shape.seqlen_q, r.shape.seqlen_k);
    test_runtime().create_block_mask(mod, r.shape.batch, r.shape.heads_q, r.shape.seqlen_q, r.shape.seqlen_k, mask->buffers);
    synchronize();
    mask->check_lists(host_tile_states(r.shape.batch, r.shape.heads_q, r.shape.seqlen_q, r.shape.seqlen_k, 128, r.shape.mask_fn));
    options.block_mask = &mask->mask;
  }
  return options;
}

std::string describe_modifier(const ModifierRun& r) {
  return std::string(r.backend == Backend::fa2 ? " fa2 family" : "") + (r.deterministic ? " deterministic" : "") +
         (r.block_mask ? " with a block mask" : "") + " mask {" + r.code->mask + "} score {" + r.code->score +
         "}" + (r.code->has_score_grad() ? " score_grad {" + r.code->score_grad + "}" : "");
}

void check_modifier(ModifierRun r, uint64_t seed) {
  AttentionMod mod;
  std::unique_ptr<DeviceBlockMask> mask;
  const AttentionOptions options = modifier_options(r, mod, mask);
  AttentionCase c(r.shape, DType::bf16, seed);
  c.run(test_runtime(), options);
  INFO(c.describe() << describe_modifier(r));
  check_against_oracle(c, tensor_core_output_tolerance(DType::bf16), tensor_core_lse_tolerance());
}

// The backward of a run (after its forward, itself checked) against the float64 reference
// gradients, whose score derivative is a central difference of the shape's score_fn. In
// deterministic mode, two reruns must give the same bits.
GradientComparison backward_of(const ModifierRun& r, uint64_t seed) {
  AttentionMod mod;
  std::unique_ptr<DeviceBlockMask> mask;
  const AttentionOptions options = modifier_options(r, mod, mask);
  BackwardCase c(r.shape, DType::bf16, seed);
  c.run(test_runtime(), options);
  const GradientComparison g = c.check(tensor_core_gradient_tolerance(DType::bf16));
  if (r.deterministic) {
    const std::vector<uint16_t> first = c.gradient_bits();
    for (int rerun = 0; rerun < 2; ++rerun) {
      c.run(test_runtime(), options);
      INFO("deterministic rerun " << rerun << describe_modifier(r));
      CHECK(c.gradient_bits() == first);
    }
  }
  return g;
}

void check_modifier_backward(const ModifierRun& r, uint64_t seed) {
  const GradientComparison g = backward_of(r, seed);
  INFO("backward b" << r.shape.batch << " sq" << r.shape.seqlen_q << " sk" << r.shape.seqlen_k << " hq" << r.shape.heads_q
                    << " hkv" << r.shape.heads_kv << " d" << r.shape.head_dim << describe_modifier(r));
  for (auto [name, cmp] : {std::pair{"forward out", &g.forward_out}, {"dq", &g.dq}, {"dk", &g.dk}, {"dv", &g.dv}}) {
    INFO(name << ": " << cmp->bad << " of " << cmp->checked << " outside tolerance; first " << cmp->first_bad
              << "; max abs error " << cmp->max_abs);
    CHECK(cmp->ok());
  }
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

// The README's mask examples at one head dim, each through a block mask: document masking (`docs`:
// the ids, on the device in `doc_view`), prefix-LM, sliding window with sinks; GQA.
std::vector<ModifierRun> mask_examples(int head_dim, int seqlen, const std::vector<int>& docs, const TensorView& doc_view) {
  ModifierRun document;
  document.shape = AttentionShape::make(2, seqlen, seqlen, 4, 2, head_dim);
  document.shape.mask_fn = [&docs](int, int, int i, int j) { return docs[i] == docs[j] && i >= j; };
  document.code = modifier("return doc[q_idx] == doc[kv_idx] && q_idx >= kv_idx;", "", {{"doc", ModifierTensorType::int32}});
  document.tensors = {doc_view};

  ModifierRun prefix;
  prefix.shape = AttentionShape::make(1, seqlen, seqlen, 8, 2, head_dim);
  prefix.shape.mask_fn = [](int, int, int i, int j) { return j < 200 || i >= j; };
  prefix.code = modifier("return kv_idx < 200 || q_idx >= kv_idx;", "");

  ModifierRun sinks;
  sinks.shape = AttentionShape::make(1, seqlen, seqlen, 4, 4, head_dim);
  sinks.shape.mask_fn = [](int, int, int i, int j) { return j <= i && (i - j < 256 || j < 4); };
  sinks.code = modifier("return kv_idx <= q_idx && (q_idx - kv_idx < 256 || kv_idx < 4);", "");
  std::vector<ModifierRun> runs{document, prefix, sinks};
  for (ModifierRun& r : runs) r.block_mask = true;
  return runs;
}

// Runs `check` on the mask examples at head dims 64, 128 (seqlen_128) and 256 (seqlen_other).
template <class Check>
void for_mask_examples(int seqlen_128, int seqlen_other, Check check) {
  for (int head_dim : {64, 128, 256}) {
    const int seqlen = head_dim == 128 ? seqlen_128 : seqlen_other;
    const std::vector<int> docs = document_ids(seqlen, {300, 57, 129, 500});
    DeviceBuffer doc_buffer(docs.size() * 4);
    doc_buffer.upload(docs);
    const TensorView doc_view = TensorView::contiguous(doc_buffer.get(), ScalarType::int32, {seqlen});
    uint64_t seed = head_dim;
    for (const ModifierRun& run : mask_examples(head_dim, seqlen, docs, doc_view)) check(run, seed++);
  }
}

}  // namespace

TEST_CASE("modifiers: document masking, prefix-LM and sliding window with sinks, through block masks", "[modifiers][quick]") {
  if (!hopper_or_skip()) return;
  for_mask_examples(1000, 700, [](const ModifierRun& run, uint64_t seed) { check_modifier(run, seed); });
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

TEST_CASE("modifiers: the sm_80 family (fa2_fwd) with modifiers and block masks", "[modifiers][quick]") {
  // fa2_fwd runs on every sm_80+ device: forced here, it is the path of sm_80/sm_89 GPUs and of
  // tensors TMA cannot read.
  for_mask_examples(600, 600, [](ModifierRun run, uint64_t seed) {
    run.backend = Backend::fa2;
    check_modifier(run, seed + 30);
  });
  for (int head_dim : {64, 128, 256}) {
    // A score modifier and a mask modifier on every tile; every fifth query sees no key.
    ModifierRun both;
    both.shape = AttentionShape::make(1, 300, 333, 2, 2, head_dim);
    both.shape.mask_fn = [](int, int h, int i, int j) { return i % 5 != 0 && (i + j + h) % 3 != 0; };
    both.shape.score_fn = [](double s, int, int, int i, int j) { return 2.0 * std::tanh(s / 2.0) + 0.01 * ((i ^ j) & 7); };
    both.code = modifier("return q_idx % 5 != 0 && (q_idx + kv_idx + head) % 3 != 0;",
                         "return 2.f * tanhf(score / 2.f) + 0.01f * float((q_idx ^ kv_idx) & 7);");
    both.backend = Backend::fa2;
    check_modifier(both, 40);
  }
}

TEST_CASE("modifiers: random block masks at densities 0, 5%, 50% and 100%", "[modifiers][quick]") {
  if (!hopper_or_skip()) return;
  const int seqlen_q = 1000, seqlen_k = 1300, heads = 4, batch = 2;
  const int q_blocks = (seqlen_q + 127) / 128, kv_blocks = (seqlen_k + 127) / 128;
  // In partial tiles an element mask of the indices; full tiles skip it.
  auto element = [](int, int h, int i, int j) { return (i * 7 + j * 13 + h) % 5 != 0; };
  for (double density : {0.0, 0.05, 0.5, 1.0}) {
    const std::vector<uint8_t> states = random_tile_states(size_t(batch) * heads * q_blocks * kv_blocks, density, 11);
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

// ALiBi slopes of `heads` heads, on the host and the device.
struct AlibiSlopes {
  explicit AlibiSlopes(int heads) : host(heads), device(heads * 4) {
    for (int h = 0; h < heads; ++h) host[h] = std::pow(2.f, -8.f * (h + 1) / heads);
    device.upload(host);
  }
  std::vector<float> host;
  DeviceBuffer device;
};

// The backward's score-modifier runs at one head dim: ALiBi beside the built-in causal mask (its
// gradient derived); a tanh softcap of 2 on unit-scale scores (the tanh's derivative matters); a
// mask modifier on every tile (no block mask) beside a score modifier, where every fifth query sees
// no key (output 0, LSE -inf, no gradient).
std::vector<ModifierRun> score_modifier_runs(int head_dim, const AlibiSlopes& slopes) {
  const int heads = static_cast<int>(slopes.host.size());
  ModifierRun alibi;
  alibi.shape = AttentionShape::make(2, 333, 333, heads, 2, head_dim);
  alibi.shape.causal = true;
  alibi.shape.score_fn = [&slopes](double s, int, int h, int i, int j) { return s - double(slopes.host[h]) * (i - j); };
  alibi.code = modifier("", "return score - slopes[head] * float(q_idx - kv_idx);", {{"slopes", ModifierTensorType::float32}});
  alibi.tensors = {TensorView::contiguous(slopes.device.get(), ScalarType::float32, {heads})};

  ModifierRun softcap;
  softcap.shape = AttentionShape::make(1, 257, 450, 4, 1, head_dim);
  softcap.shape.score_fn = [](double s, int, int, int, int) { return 2.0 * std::tanh(s / 2.0); };
  softcap.code = modifier("", "return 2.f * tanhf(score / 2.f);");

  ModifierRun both;
  both.shape = AttentionShape::make(1, 300, 300, 2, 2, head_dim);
  both.shape.mask_fn = [](int, int h, int i, int j) { return i % 5 != 0 && (i + j + h) % 3 != 0; };
  both.shape.score_fn = [](double s, int, int, int i, int j) { return s * (1.0 + 0.1 * ((i ^ j) & 3)); };
  both.code = modifier("return q_idx % 5 != 0 && (q_idx + kv_idx + head) % 3 != 0;",
                       "return score * (1.f + 0.1f * float((q_idx ^ kv_idx) & 3));");
  return {alibi, softcap, both};
}

// ---------------------------------------------------------------------------------------------
// The backward (sm90_bwd, and fa2_bwd by name): the same modifiers and block masks, dq, dk and dv
// against the float64 reference gradients.

TEST_CASE("modifiers backward: document masking, prefix-LM and sliding window with sinks, through block masks",
          "[modifiers][quick]") {
  if (!hopper_or_skip()) return;
  for_mask_examples(700, 520, [](const ModifierRun& run, uint64_t seed) { check_modifier_backward(run, seed + 20); });
}

TEST_CASE("modifiers backward: ALiBi and tanh softcap with derived gradients, rows that see no key", "[modifiers][quick]") {
  if (!hopper_or_skip()) return;
  const AlibiSlopes slopes(4);
  for (int head_dim : {64, 128, 256}) {
    uint64_t seed = 24;
    for (const ModifierRun& run : score_modifier_runs(head_dim, slopes)) check_modifier_backward(run, seed++);
  }
}

TEST_CASE("modifiers backward: random block masks at densities 0, 5%, 50% and 100%", "[modifiers][quick]") {
  // sm90_bwd (automatic on sm_90; here by name in deterministic mode, its adds ordered by the key
  // tiles' visits), and fa2_bwd by name in both dQ modes.
  const bool hopper = device_properties(0).arch().name() == "sm_90a";
  const int seqlen_q = 700, seqlen_k = 900, heads = 4, batch = 1;
  const int q_blocks = (seqlen_q + 127) / 128, kv_blocks = (seqlen_k + 127) / 128;
  for (auto [backend, deterministic] :
       {std::pair{Backend::automatic, false}, {Backend::sm90, true}, {Backend::fa2, false}, {Backend::fa2, true}}) {
    for (int head_dim : {64, 128}) {
      if (backend != Backend::fa2 && !hopper) continue;
      for (double density : {0.0, 0.05, 0.5, 1.0}) {
        const std::vector<uint8_t> states =
            random_tile_states(size_t(batch) * heads * q_blocks * kv_blocks, density, head_dim);
        DeviceBuffer map(states.size());
        map.upload(states);
        DeviceBlockMask mask(batch, heads, seqlen_q, seqlen_k);
        test_runtime().block_mask_from_tiles(
            TensorView::contiguous(map.get(), ScalarType::uint8, {batch, heads, q_blocks, kv_blocks}), seqlen_q, seqlen_k,
            mask.buffers);
        synchronize();

        AttentionShape shape = AttentionShape::make(batch, seqlen_q, seqlen_k, heads, 2, head_dim);
        shape.mask_fn = [&](int, int h, int i, int j) {
          const int state = states[(size_t(h) * q_blocks + i / 128) * kv_blocks + j / 128];
          return state == 2 || (state == 1 && (i * 7 + j * 13 + h) % 5 != 0);
        };
        AttentionMod mod{modifier("return (q_idx * 7 + kv_idx * 13 + head) % 5 != 0;", ""), {}};
        AttentionOptions options;
        options.mod = &mod;
        options.block_mask = &mask.mask;
        options.backend = backend;
        options.deterministic = deterministic;
        BackwardCase c(shape, DType::bf16, 27);
        c.run(test_runtime(), options);
        const GradientComparison g = c.check(tensor_core_gradient_tolerance(DType::bf16));
        INFO(c.describe() << " block density " << density << (backend == Backend::fa2 ? " fa2_bwd" : "")
                          << (deterministic ? " deterministic" : ""));
        for (auto [name, cmp] : {std::pair{"forward out", &g.forward_out}, {"dq", &g.dq}, {"dk", &g.dk}, {"dv", &g.dv}}) {
          INFO(name << ": " << cmp->bad << " of " << cmp->checked << " outside tolerance; first " << cmp->first_bad);
          CHECK(cmp->ok());
        }
        if (deterministic) {
          const std::vector<uint16_t> first = c.gradient_bits();
          c.run(test_runtime(), options);
          CHECK(c.gradient_bits() == first);
        }
      }
    }
  }
}

TEST_CASE("modifiers backward: a wrong hand-written score gradient is caught, the right one passes", "[modifiers][quick]") {
  if (!hopper_or_skip()) return;
  ModifierRun run;
  run.shape = AttentionShape::make(1, 256, 256, 2, 2, 128);
  run.shape.score_fn = [](double s, int, int, int, int) { return 1.5 * s + 0.25 * s * s; };
  run.code = modifier("", "return 1.5f * score + 0.25f * score * score;", {}, "return 1.5f + 0.5f * score;");
  const GradientComparison right = backward_of(run, 28);
  CHECK(right.ok());
  // The derivative of the linear term only: off by 0.5 * score, which the reference's central
  // difference exposes in dq and dk (dv, which has no dS, stays right).
  run.code = modifier("", "return 1.5f * score + 0.25f * score * score;", {}, "return 1.5f;");
  const GradientComparison wrong = backward_of(run, 28);
  CHECK(wrong.forward_out.ok());
  CHECK(wrong.dv.ok());
  CHECK_FALSE(wrong.dq.ok());
  CHECK_FALSE(wrong.dk.ok());
}

// sm90_bwd's deterministic mode under a block mask: each key tile adds to a query block's dQ after
// the tiles before it that visit the block (their count, from the transposed lists). The mask
// examples at head dims 64, 128 and 256, the document mask at 96 and 192 too, bitwise reruns.
TEST_CASE("modifiers backward: sm90_bwd's deterministic mode under block masks", "[modifiers]") {
  if (!hopper_or_skip()) return;
  for_mask_examples(700, 520, [](ModifierRun run, uint64_t seed) {
    run.backend = Backend::sm90;
    run.deterministic = true;
    check_modifier_backward(run, seed + 80);
  });
  for (int head_dim : {96, 192}) {
    const int seqlen = 600;
    const std::vector<int> docs = document_ids(seqlen, {300, 57, 129, 500});
    DeviceBuffer doc_buffer(docs.size() * 4);
    doc_buffer.upload(docs);
    const TensorView doc_view = TensorView::contiguous(doc_buffer.get(), ScalarType::int32, {seqlen});
    ModifierRun run = mask_examples(head_dim, seqlen, docs, doc_view)[0];
    run.backend = Backend::sm90;
    run.deterministic = true;
    check_modifier_backward(run, 90 + head_dim);
  }
}

// A transposed list that names a query block twice for one key tile (malformed: FlexAttention's
// builders never write one) double-counts that tile's work, but the ordered adds must still finish:
// key tile 1's second visit to query block 1 finds the block's count already past its turn.
TEST_CASE("modifiers backward: deterministic sm90_bwd finishes on a list that repeats a block", "[modifiers]") {
  if (!hopper_or_skip()) return;
  const int seqlen = 256, heads = 1, batch = 1, head_dim = 64;
  DeviceBlockMask mask(batch, heads, seqlen, seqlen);
  const std::vector<uint8_t> states(4, 2);  // every tile fully visible
  DeviceBuffer map(states.size());
  map.upload(states);
  const TensorView tiles = TensorView::contiguous(map.get(), ScalarType::uint8, {batch, heads, 2, 2});
  test_runtime().block_mask_from_tiles(tiles, seqlen, seqlen, mask.buffers);
  synchronize();
  std::vector<int> q_num = mask.q_num.download<int>(), q_ids = mask.q_ids.download<int>();
  q_num[1] = 1;      // key block 1's partial list: query block 1, which its full list names too
  q_ids[1 * 2] = 1;  // (rows of q_blocks ids)
  mask.q_num.upload(q_num);
  mask.q_ids.upload(q_ids);
  AttentionMod mod{modifier("return true;", ""), {}};
  AttentionOptions options;
  options.mod = &mod;
  options.block_mask = &mask.mask;
  options.backend = Backend::sm90;
  options.deterministic = true;
  BackwardCase c(AttentionShape::make(batch, seqlen, seqlen, heads, heads, head_dim), DType::bf16, 31);
  CHECK_NOTHROW(c.run(test_runtime(), options));
}

// fa2_bwd with modifiers and block masks: the backward of sm_80/sm_89 devices and of deterministic
// mode under a block mask on sm_90, forced by name (automatic dispatch waits for this test to pass
// on a device), in both dQ modes.
TEST_CASE("modifiers backward: the sm_80 family (fa2_bwd) with modifiers and block masks, atomic and deterministic",
          "[modifiers]") {
  for (bool deterministic : {false, true}) {
    for_mask_examples(600, 520, [&](ModifierRun run, uint64_t seed) {
      run.backend = Backend::fa2;
      run.deterministic = deterministic;
      check_modifier_backward(run, seed + 50);
    });
    const AlibiSlopes slopes(4);
    for (int head_dim : {64, 128, 256}) {
      uint64_t seed = 60 + head_dim;
      for (ModifierRun run : score_modifier_runs(head_dim, slopes)) {
        run.backend = Backend::fa2;
        run.deterministic = deterministic;
        check_modifier_backward(run, seed++);
      }
    }
  }
  // A wrong hand-written gradient is caught here too.
  ModifierRun run;
  run.shape = AttentionShape::make(1, 256, 256, 2, 2, 128);
  run.shape.score_fn = [](double s, int, int, int, int) { return 1.5 * s + 0.25 * s * s; };
  run.code = modifier("", "return 1.5f * score + 0.25f * score * score;", {}, "return 1.5f;");
  run.backend = Backend::fa2;
  const GradientComparison wrong = backward_of(run, 29);
  CHECK(wrong.dv.ok());
  CHECK_FALSE(wrong.dq.ok());
  CHECK_FALSE(wrong.dk.ok());
}

TEST_CASE("modifiers backward: a block mask without its transposed lists is refused by name", "[modifiers][quick]") {
  if (!hopper_or_skip()) return;
  const int64_t b = 1, s = 256, h = 2, d = 64;
  DeviceBuffer q(b * s * h * d * 2), o(b * s * h * d * 2), g(b * s * h * d * 2), lse(b * h * s * 4);
  const TensorView t = TensorView::contiguous(q.get(), ScalarType::bfloat16, {b, s, h, d});
  const TensorView ov = TensorView::contiguous(o.get(), ScalarType::bfloat16, {b, s, h, d});
  const TensorView gv = TensorView::contiguous(g.get(), ScalarType::bfloat16, {b, s, h, d});
  const TensorView lv = TensorView::contiguous(lse.get(), ScalarType::float32, {b, h, s});
  DeviceBlockMask mask(1, 1, s, s);
  mask.mask.q_num_blocks = mask.mask.q_indices = nullptr;
  AttentionOptions options;
  options.block_mask = &mask.mask;
  CHECK_THROWS_WITH(test_runtime().backward(t, t, t, ov, gv, &lv, gv, gv, gv, options),
                    Catch::Contains("needs its transposed lists q_num_blocks and q_indices"));
}
