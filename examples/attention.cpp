// Embedding flashjit from C++: one causal GQA attention call (bf16, sequence-major tensors) on
// random data through flashjit::Runtime, its output and logsumexp checked against a float64
// reference computed here. Exit status: 0 checked (or no GPU), 1 a mismatch or an error.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <flashjit/flashjit.h>
#include <flashjit/flashjit.hpp>

namespace {

uint16_t to_bf16(float x) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

bool check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) std::fprintf(stderr, "attention_cpp: %s: %s\n", what, cudaGetErrorString(status));
  return status == cudaSuccess;
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::puts("attention_cpp: no GPU, skipped");
    return 0;
  }
  constexpr int batch = 2, seqlen = 300, heads_q = 4, heads_kv = 2, dim = 64;
  const size_t q_elements = size_t(batch) * seqlen * heads_q * dim, kv_elements = size_t(batch) * seqlen * heads_kv * dim;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  std::vector<uint16_t> q(q_elements), k(kv_elements), v(kv_elements);
  for (auto* t : {&q, &k, &v})
    for (uint16_t& x : *t) x = to_bf16(uniform(rng));

  void *dq = nullptr, *dk = nullptr, *dv = nullptr, *dout = nullptr, *dlse = nullptr;
  const size_t lse_elements = size_t(batch) * heads_q * seqlen;
  if (!check(cudaMalloc(&dq, q_elements * 2), "cudaMalloc") || !check(cudaMalloc(&dk, kv_elements * 2), "cudaMalloc") ||
      !check(cudaMalloc(&dv, kv_elements * 2), "cudaMalloc") || !check(cudaMalloc(&dout, q_elements * 2), "cudaMalloc") ||
      !check(cudaMalloc(&dlse, lse_elements * 4), "cudaMalloc"))
    return 1;
  check(cudaMemcpy(dq, q.data(), q_elements * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaMemcpy(dk, k.data(), kv_elements * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaMemcpy(dv, v.data(), kv_elements * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  check(cudaMemset(dout, 0xff, q_elements * 2), "cudaMemset");  // NaN: an unwritten element shows
  check(cudaMemset(dlse, 0xff, lse_elements * 4), "cudaMemset");

  using flashjit::ScalarType;
  using flashjit::TensorView;
  const TensorView tq = TensorView::contiguous(dq, ScalarType::bfloat16, {batch, seqlen, heads_q, dim});
  const TensorView tk = TensorView::contiguous(dk, ScalarType::bfloat16, {batch, seqlen, heads_kv, dim});
  const TensorView tv = TensorView::contiguous(dv, ScalarType::bfloat16, {batch, seqlen, heads_kv, dim});
  const TensorView tout = TensorView::contiguous(dout, ScalarType::bfloat16, {batch, seqlen, heads_q, dim});
  const TensorView tlse = TensorView::contiguous(dlse, ScalarType::float32, {batch, heads_q, seqlen});
  flashjit::AttentionOptions options;
  options.causal = true;
  try {
    flashjit::Runtime::global().forward(tq, tk, tv, tout, &tlse, options);
  } catch (const flashjit::Error& e) {
    std::fprintf(stderr, "attention_cpp: %s\n", e.what());
    return 1;
  }
  if (!check(cudaDeviceSynchronize(), "the attention call")) return 1;
  std::vector<uint16_t> out(q_elements);
  std::vector<float> lse(lse_elements);
  check(cudaMemcpy(out.data(), dout, q_elements * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
  check(cudaMemcpy(lse.data(), dlse, lse_elements * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");

  // float64 reference: row i sees keys 0..i; query head h reads KV head h / (heads_q / heads_kv).
  const double scale = 1.0 / std::sqrt(double(dim));
  double out_error = 0, lse_error = 0;
  std::vector<double> scores(seqlen), row(dim);
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < heads_q; ++h)
      for (int i = 0; i < seqlen; ++i) {
        const int hk = h / (heads_q / heads_kv);
        auto at = [&](const std::vector<uint16_t>& t, int heads, int r, int head, int c) {
          return double(from_bf16(t[((size_t(b) * seqlen + r) * heads + head) * dim + c]));
        };
        double top = -INFINITY;
        for (int j = 0; j <= i; ++j) {
          double dot = 0;
          for (int c = 0; c < dim; ++c) dot += at(q, heads_q, i, h, c) * at(k, heads_kv, j, hk, c);
          scores[j] = dot * scale;
          top = std::fmax(top, scores[j]);
        }
        double sum = 0;
        for (double& x : row) x = 0;
        for (int j = 0; j <= i; ++j) {
          const double p = std::exp(scores[j] - top);
          sum += p;
          for (int c = 0; c < dim; ++c) row[c] += p * at(v, heads_kv, j, hk, c);
        }
        for (int c = 0; c < dim; ++c) {
          const double got = from_bf16(out[((size_t(b) * seqlen + i) * heads_q + h) * dim + c]);
          out_error = std::fmax(out_error, std::isnan(got) ? INFINITY : std::fabs(got - row[c] / sum));
        }
        const double got_lse = lse[(size_t(b) * heads_q + h) * seqlen + i];
        lse_error = std::fmax(lse_error, std::isnan(got_lse) ? INFINITY : std::fabs(got_lse - (top + std::log(sum))));
      }
  // bf16 keeps 8 bits: outputs of magnitude below 1 round by up to 2^-9; the LSE is fp32.
  const bool ok = out_error < 1e-2 && lse_error < 1e-3;
  std::printf("attention_cpp: flashjit %s, causal GQA bf16 %dx%dx%d/%dx%d: max |out - ref| %.2e, |lse - ref| %.2e: %s\n",
              flashjit_version(), batch, seqlen, heads_q, heads_kv, dim, out_error, lse_error, ok ? "ok" : "MISMATCH");
  for (void* p : {dq, dk, dv, dout, dlse}) cudaFree(p);
  return ok ? 0 : 1;
}
