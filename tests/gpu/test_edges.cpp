// Inputs PyTorch's attention accepts at the edges: empty tensors (PyTorch gives them a null data
// pointer), no keys, varlen batches whose queries are all empty, and batches or head counts beyond
// a grid's 65535 CTAs along y and z (the runtime runs those in slices).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>

#include "support/attention_checks.hpp"
#include "support/backward_case.hpp"

using namespace flashjit;
using namespace flashjit::test;

namespace {

std::vector<Backend> forward_backends() {
  if (device_properties(0).arch().name() == "sm_90a") return {Backend::fa2, Backend::sm90};
  return {Backend::fa2};
}

// A contiguous (batch, seqlen, heads, head_dim) view: of `buffer`, or with no memory when empty.
TensorView attention_view(const DeviceBuffer* buffer, int batch, int seqlen, int heads, int head_dim) {
  return TensorView::contiguous(buffer != nullptr ? buffer->get() : nullptr, ScalarType::bfloat16,
                                {batch, seqlen, heads, head_dim});
}

bool all_zero(const DeviceBuffer& b) {
  const auto bits = b.download<uint16_t>();
  return std::all_of(bits.begin(), bits.end(), [](uint16_t x) { return x == 0; });
}

void check_gradients(BackwardCase& c, Backend backend) {
  AttentionOptions options;
  options.backend = backend;
  c.run(test_runtime(), options);
  INFO(c.describe() << (backend == Backend::sm90 ? " sm90_bwd" : backend == Backend::fa2 ? " fa2_bwd" : ""));
  const GradientComparison g = c.check(tensor_core_gradient_tolerance(DType::bf16));
  for (auto [name, cmp] : {std::pair{"forward out", &g.forward_out}, {"dq", &g.dq}, {"dk", &g.dk}, {"dv", &g.dv}}) {
    INFO(name << ": " << cmp->bad << " of " << cmp->checked << " outside tolerance; first " << cmp->first_bad);
    CHECK(cmp->ok());
  }
}

}  // namespace

TEST_CASE("edges: empty tensors without memory return at once, forward and backward", "[edges][quick]") {
  struct Shape {
    int batch, seqlen_q, seqlen_k, heads;
  };
  for (Shape s : {Shape{0, 16, 16, 2}, Shape{2, 0, 0, 2}, Shape{2, 16, 16, 0}}) {
    INFO("batch " << s.batch << " seqlen " << s.seqlen_q << "/" << s.seqlen_k << " heads " << s.heads);
    const TensorView q = attention_view(nullptr, s.batch, s.seqlen_q, s.heads, 64);
    const TensorView k = attention_view(nullptr, s.batch, s.seqlen_k, s.heads, 64);
    const TensorView lse = TensorView::contiguous(nullptr, ScalarType::float32, {s.batch, s.heads, s.seqlen_q});
    CHECK_NOTHROW(test_runtime().forward(q, k, k, q, &lse, AttentionOptions{}));
    CHECK_NOTHROW(test_runtime().backward(q, k, k, q, q, &lse, q, k, k, AttentionOptions{}));
  }
  synchronize();
}

TEST_CASE("edges: no queries still writes dK = dV = 0; no keys gives out 0 and dQ = 0", "[edges][quick]") {
  const int batch = 2, heads = 2, d = 64, rows = 37;
  for (bool causal : {false, true}) {
    AttentionOptions options;
    options.causal = causal;
    // No queries (q, out, dout, dq and lse without memory): the keys' gradients are zero.
    DeviceBuffer k(size_t(batch) * rows * heads * d * 2), dk(k.bytes()), dv(k.bytes());
    k.upload(std::vector<uint16_t>(k.bytes() / 2, 0x3f80));  // 1.0: no zeros to hide behind
    dk.poison();
    dv.poison();
    const TensorView no_queries = attention_view(nullptr, batch, 0, heads, d);
    const TensorView keys = attention_view(&k, batch, rows, heads, d);
    const TensorView no_lse = TensorView::contiguous(nullptr, ScalarType::float32, {batch, heads, 0});
    test_runtime().backward(no_queries, keys, keys, no_queries, no_queries, &no_lse, no_queries,
                            attention_view(&dk, batch, rows, heads, d), attention_view(&dv, batch, rows, heads, d),
                            options);
    synchronize();
    CHECK(all_zero(dk));
    CHECK(all_zero(dv));
  }
  // No keys: every row sees nothing (out 0, LSE +inf as for fully masked rows, dQ 0). The
  // automatic backend: TMA (the sm_90 families) cannot map a tensor without rows.
  BackwardCase c(AttentionShape::make(batch, rows, 0, heads, 1, d), DType::bf16, 41);
  check_gradients(c, Backend::automatic);
}

TEST_CASE("edges: a varlen batch whose queries are all empty", "[edges][quick]") {
  AttentionShape shape = AttentionShape::make(3, 0, 0, 4, 2, 64);
  shape.seqlens_q = {0, 0, 0};
  shape.seqlens_k = {5, 0, 130};
  BackwardCase c(shape, DType::bf16, 42);
  check_gradients(c, Backend::automatic);  // dK = dV = 0 written over the poison
}

TEST_CASE("edges: 70,000 sequences and 70,000 query heads run in slices of the grid", "[edges][quick]") {
  uint64_t seed = 43;
  for (auto [batch, seqlen_q, seqlen_k, heads_q, heads_kv] :
       {std::tuple{70000, 3, 5, 2, 1}, {1, 2, 3, 70000, 10000}}) {
    const AttentionShape shape = AttentionShape::make(batch, seqlen_q, seqlen_k, heads_q, heads_kv, 64);
    for (Backend backend : forward_backends()) {
      AttentionCase c(shape, DType::bf16, seed);
      AttentionOptions options;
      options.backend = backend;
      c.run(test_runtime(), options);
      INFO(c.describe() << (backend == Backend::sm90 ? " sm90_fwd" : " fa2_fwd"));
      check_against_oracle(c, tensor_core_output_tolerance(DType::bf16), tensor_core_lse_tolerance());
      BackwardCase b(shape, DType::bf16, seed);
      check_gradients(b, backend);
    }
    ++seed;
  }
}
