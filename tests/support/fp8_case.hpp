// One FP8 (e4m3) forward test case on the GPU, fixed-length or varlen: random q, k, v quantised per
// (batch, KV head) with scale amax / 448 (FlashAttention-3's descales), the float64 reference over
// the dequantised values, poisoned outputs, a launch through the public API, and the comparison
// (tolerances.hpp). The heads' magnitudes differ, so a descale applied to the wrong head or batch fails.
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

// One tensor (batch, seqlen, heads, head_dim), or varlen (total rows, heads, head_dim), quantised per
// (batch, KV head): its e4m3 bits, its descales (batch, heads_kv) and the dequantised values the
// reference reads.
struct Quantised {
  std::vector<uint8_t> bits;
  std::vector<float> descale;
  std::vector<double> values;
};

// Sequence b's rows of q (keys false) or of k and v (keys true): each tensor by its own lengths.
struct SequenceRows {
  size_t begin;
  int count;
};
inline SequenceRows sequence_rows(const AttentionShape& s, int b, bool keys) {
  if (!s.is_varlen()) {
    const int n = keys ? s.seqlen_k : s.seqlen_q;
    return {size_t(b) * n, n};
  }
  const std::vector<int>& lengths = keys ? s.seqlens_k : s.seqlens_q;
  size_t begin = 0;
  for (int i = 0; i < b; ++i) begin += lengths[i];
  return {begin, lengths[b]};
}

inline Quantised quantise(const AttentionShape& s, bool keys, const std::vector<float>& x) {
  const int d = s.head_dim, heads = keys ? s.heads_kv : s.heads_q, group = heads / s.heads_kv;
  Quantised t;
  t.bits.resize(x.size());
  t.values.resize(x.size());
  t.descale.assign(size_t(s.batch) * s.heads_kv, 0.f);
  auto index = [&](size_t row, int h, int c) { return (row * heads + h) * d + c; };
  for (int b = 0; b < s.batch; ++b) {
    const SequenceRows rows = sequence_rows(s, b, keys);
    for (int hk = 0; hk < s.heads_kv; ++hk) {
      float amax = 1e-6f;
      for (int i = 0; i < rows.count; ++i)
        for (int h = hk * group; h < (hk + 1) * group; ++h)
          for (int c = 0; c < d; ++c) amax = std::max(amax, std::fabs(x[index(rows.begin + i, h, c)]));
      const float scale = amax / kE4m3Max;
      t.descale[size_t(b) * s.heads_kv + hk] = scale;
      for (int i = 0; i < rows.count; ++i)
        for (int h = hk * group; h < (hk + 1) * group; ++h)
          for (int c = 0; c < d; ++c) {
            const size_t at = index(rows.begin + i, h, c);
            t.bits[at] = detail::to_e4m3_bits(x[at] / scale);
            t.values[at] = double(detail::from_e4m3_bits(t.bits[at])) * scale;
          }
    }
  }
  return t;
}

// Random q, k, v for `shape` (fixed-length or varlen), quantised; the reference's out, LSE and
// magnitudes. q ~ 2 N(0, 1), k ~ N(0, 1) times 1-3 by (batch, KV head), v ~ 0.5 N(0, 1).
struct Fp8Case {
  AttentionShape shape;
  Quantised q, k, v;
  std::vector<double> want_out, want_lse, want_magnitude;

  Fp8Case(const AttentionShape& s, uint64_t seed) : shape(s) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    const int d = s.head_dim;
    const size_t rows_q = s.is_varlen() ? s.total_q() : size_t(s.batch) * s.seqlen_q,
                 rows_k = s.is_varlen() ? s.total_k() : size_t(s.batch) * s.seqlen_k;
    std::vector<float> xq(rows_q * s.heads_q * d), xk(rows_k * s.heads_kv * d), xv(xk.size());
    for (auto& x : xq) x = 2.f * normal(rng);
    for (int b = 0; b < s.batch; ++b) {
      const SequenceRows rows = sequence_rows(s, b, /*keys=*/true);
      for (size_t i = rows.begin * s.heads_kv * d; i < (rows.begin + rows.count) * s.heads_kv * d; ++i) {
        const size_t head = i / d % s.heads_kv;
        xk[i] = normal(rng) * float(1 + (b * s.heads_kv + head) % 3);
        xv[i] = 0.5f * normal(rng);
      }
    }
    q = quantise(s, /*keys=*/false, xq);
    k = quantise(s, /*keys=*/true, xk);
    v = quantise(s, /*keys=*/true, xv);
    reference_attention(s, q.values, k.values, v.values, want_out, want_lse, &want_magnitude);
  }

  // Poisoned outputs, one forward with `options` (descales added), the comparison.
  void run_and_check(AttentionOptions options) const {
    const AttentionShape& s = shape;
    const int d = s.head_dim;
    const size_t rows_q = q.bits.size() / (size_t(s.heads_q) * d), rows_k = k.bits.size() / (size_t(s.heads_kv) * d);
    DeviceBuffer dq(q.bits.size()), dk(k.bits.size()), dv(v.bits.size()), out(q.bits.size() * 2),
        lse(rows_q * s.heads_q * 4), descales(3 * q.descale.size() * 4);
    dq.upload(q.bits);
    dk.upload(k.bits);
    dv.upload(v.bits);
    std::vector<float> all_descales = q.descale;
    all_descales.insert(all_descales.end(), k.descale.begin(), k.descale.end());
    all_descales.insert(all_descales.end(), v.descale.begin(), v.descale.end());
    descales.upload(all_descales);
    out.poison();
    lse.poison();
    // (batch, seqlen, heads, d), or varlen (total rows, heads, d).
    auto view = [&](const DeviceBuffer& m, size_t rows, int heads, ScalarType type) {
      if (s.is_varlen()) return TensorView::contiguous(m.get(), type, {int64_t(rows), heads, d});
      return TensorView::contiguous(m.get(), type, {s.batch, int64_t(rows / s.batch), heads, d});
    };
    auto descale = [&](int i) {
      return TensorView::contiguous(static_cast<char*>(descales.get()) + i * q.descale.size() * 4, ScalarType::float32,
                                    {s.batch, s.heads_kv});
    };
    const TensorView lse_view =
        s.is_varlen() ? TensorView::contiguous(lse.get(), ScalarType::float32, {s.heads_q, int64_t(rows_q)})
                      : TensorView::contiguous(lse.get(), ScalarType::float32, {s.batch, s.heads_q, s.seqlen_q});
    const TensorView q_descale = descale(0), k_descale = descale(1), v_descale = descale(2);
    options.q_descale = &q_descale;
    options.k_descale = &k_descale;
    options.v_descale = &v_descale;
    const TensorView qv = view(dq, rows_q, s.heads_q, ScalarType::float8_e4m3),
                     kv = view(dk, rows_k, s.heads_kv, ScalarType::float8_e4m3),
                     vv = view(dv, rows_k, s.heads_kv, ScalarType::float8_e4m3),
                     ov = view(out, rows_q, s.heads_q, ScalarType::bfloat16);
    if (s.is_varlen()) {
      const DeviceVarlenBatch varlen(s);
      test_runtime().forward_varlen(qv, kv, vv, ov, &lse_view, varlen.batch(), options);
      synchronize();  // (before the sequence lengths' buffers go)
    } else {
      test_runtime().forward(qv, kv, vv, ov, &lse_view, options);
    }
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
