// One FP8 (e4m3) forward test case on the GPU: random q, k, v quantised per (batch, KV head) with
// scale amax / 448 (FlashAttention-3's descales), the float64 reference over the dequantised values,
// poisoned outputs, a launch through the public API, and the comparison (tolerances.hpp). The
// heads' magnitudes differ, so a descale applied to the wrong head or batch fails.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "host_tensors.hpp"
#include "support/attention_checks.hpp"

namespace flashjit::test {

inline constexpr float kE4m3Max = 448.f;

// One tensor (batch, seqlen, heads, head_dim) quantised per (batch, KV head): its e4m3 bits, its
// descales (batch, heads_kv) and the dequantised values the reference reads.
struct Quantised {
  std::vector<uint8_t> bits;
  std::vector<float> descale;
  std::vector<double> values;
};

inline Quantised quantise(const AttentionShape& s, int seqlen, int heads, const std::vector<float>& x) {
  const int d = s.head_dim, group = heads / s.heads_kv;
  Quantised t;
  t.bits.resize(x.size());
  t.values.resize(x.size());
  t.descale.assign(size_t(s.batch) * s.heads_kv, 0.f);
  auto index = [&](int b, int i, int h, int c) { return ((size_t(b) * seqlen + i) * heads + h) * d + c; };
  for (int b = 0; b < s.batch; ++b)
    for (int hk = 0; hk < s.heads_kv; ++hk) {
      float amax = 1e-6f;
      for (int i = 0; i < seqlen; ++i)
        for (int h = hk * group; h < (hk + 1) * group; ++h)
          for (int c = 0; c < d; ++c) amax = std::max(amax, std::fabs(x[index(b, i, h, c)]));
      const float scale = amax / kE4m3Max;
      t.descale[size_t(b) * s.heads_kv + hk] = scale;
      for (int i = 0; i < seqlen; ++i)
        for (int h = hk * group; h < (hk + 1) * group; ++h)
          for (int c = 0; c < d; ++c) {
            const size_t at = index(b, i, h, c);
            t.bits[at] = detail::to_e4m3_bits(x[at] / scale);
            t.values[at] = double(detail::from_e4m3_bits(t.bits[at])) * scale;
          }
    }
  return t;
}

// Random q, k, v for `shape` (fixed-length batch), quantised; the reference's out, LSE and
// magnitudes. q ~ 2 N(0, 1), k ~ N(0, 1) times 1-3 by (batch, KV head), v ~ 0.5 N(0, 1).
struct Fp8Case {
  AttentionShape shape;
  Quantised q, k, v;
  std::vector<double> want_out, want_lse, want_magnitude;

  Fp8Case(const AttentionShape& s, uint64_t seed) : shape(s) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    const int d = s.head_dim;
    std::vector<float> xq(size_t(s.batch) * s.seqlen_q * s.heads_q * d), xk(size_t(s.batch) * s.seqlen_k * s.heads_kv * d),
        xv(xk.size());
    for (auto& x : xq) x = 2.f * normal(rng);
    for (size_t i = 0; i < xk.size(); ++i) {
      const size_t head = i / d % s.heads_kv, batch = i / (size_t(s.seqlen_k) * s.heads_kv * d);
      xk[i] = normal(rng) * float(1 + (batch * s.heads_kv + head) % 3);
      xv[i] = 0.5f * normal(rng);
    }
    q = quantise(s, s.seqlen_q, s.heads_q, xq);
    k = quantise(s, s.seqlen_k, s.heads_kv, xk);
    v = quantise(s, s.seqlen_k, s.heads_kv, xv);
    reference_attention(s, q.values, k.values, v.values, want_out, want_lse, &want_magnitude);
  }

  // Poisoned outputs, one forward with `options` (descales added), the comparison.
  void run_and_check(AttentionOptions options) const {
    const AttentionShape& s = shape;
    const int d = s.head_dim;
    DeviceBuffer dq(q.bits.size()), dk(k.bits.size()), dv(v.bits.size()), out(q.bits.size() * 2),
        lse(size_t(s.batch) * s.heads_q * s.seqlen_q * 4), descales(3 * q.descale.size() * 4);
    dq.upload(q.bits);
    dk.upload(k.bits);
    dv.upload(v.bits);
    std::vector<float> all_descales = q.descale;
    all_descales.insert(all_descales.end(), k.descale.begin(), k.descale.end());
    all_descales.insert(all_descales.end(), v.descale.begin(), v.descale.end());
    descales.upload(all_descales);
    out.poison();
    lse.poison();
    auto view = [&](const DeviceBuffer& m, int seqlen, int heads, ScalarType type) {
      return TensorView::contiguous(m.get(), type, {s.batch, seqlen, heads, d});
    };
    auto descale = [&](int i) {
      return TensorView::contiguous(static_cast<char*>(descales.get()) + i * q.descale.size() * 4, ScalarType::float32,
                                    {s.batch, s.heads_kv});
    };
    const TensorView lse_view = TensorView::contiguous(lse.get(), ScalarType::float32, {s.batch, s.heads_q, s.seqlen_q});
    const TensorView q_descale = descale(0), k_descale = descale(1), v_descale = descale(2);
    options.q_descale = &q_descale;
    options.k_descale = &k_descale;
    options.v_descale = &v_descale;
    test_runtime().forward(view(dq, s.seqlen_q, s.heads_q, ScalarType::float8_e4m3),
                           view(dk, s.seqlen_k, s.heads_kv, ScalarType::float8_e4m3),
                           view(dv, s.seqlen_k, s.heads_kv, ScalarType::float8_e4m3),
                           view(out, s.seqlen_q, s.heads_q, ScalarType::bfloat16), &lse_view, options);
    synchronize();
    const Comparison c = compare_output(s, DType::bf16, out.download<uint16_t>(), want_out, want_magnitude,
                                        fp8_output_tolerance());
    INFO(c.bad << " of " << c.checked << " outside tolerance; first " << c.first_bad << "; worst "
               << c.worst_head << " at " << c.worst_head_rms << " of the magnitude; largest error " << c.max_abs);
    CHECK(c.ok());
    const std::vector<float> got_lse = lse.download<float>();
    const Tolerance t = fp8_lse_tolerance();
    size_t bad = 0;
    for (size_t i = 0; i < got_lse.size(); ++i) {
      const double want = want_lse[i], got = got_lse[i];
      if (!(std::isinf(want) ? got == want : std::fabs(got - want) <= t.atol + t.rtol * std::fabs(want))) ++bad;
    }
    CHECK(bad == 0);
  }
};

}  // namespace flashjit::test
