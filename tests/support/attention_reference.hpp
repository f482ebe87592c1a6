// Float64 CPU attention, the oracle for every forward test. It reads the already-rounded inputs
// (so only the kernel's arithmetic is being judged) and writes O and the natural-log LSE.
#pragma once

#include <cmath>
#include <functional>
#include <limits>
#include <vector>

namespace flashjit::test {

struct AttentionShape {
  int batch = 1;
  int seqlen_q = 1;  // per sequence when seqlens_q is empty
  int seqlen_k = 1;
  int heads_q = 1;
  int heads_kv = 1;
  int head_dim = 64;
  bool causal = false;
  int window_left = -1;
  int window_right = -1;
  float softcap = 0.f;
  double scale = 0;              // 0: 1 / sqrt(head_dim)
  std::vector<int> seqlens_q;   // varlen when non-empty (then batch == size)
  std::vector<int> seqlens_k;
  // What a user modifier means, for the forward reference (indices within the sequence; null:
  // none). A row with a mask function that sees no key gets LSE -inf (FlexAttention's convention).
  std::function<bool(int batch, int head, int q_idx, int kv_idx)> mask_fn;
  std::function<double(double score, int batch, int head, int q_idx, int kv_idx)> score_fn;

  static AttentionShape make(int batch, int seqlen_q, int seqlen_k, int heads_q, int heads_kv, int head_dim) {
    AttentionShape s;
    s.batch = batch;
    s.seqlen_q = seqlen_q;
    s.seqlen_k = seqlen_k;
    s.heads_q = heads_q;
    s.heads_kv = heads_kv;
    s.head_dim = head_dim;
    return s;
  }

  bool is_varlen() const { return !seqlens_q.empty(); }
  int len_q(int b) const { return is_varlen() ? seqlens_q[b] : seqlen_q; }
  int len_k(int b) const { return is_varlen() ? seqlens_k[b] : seqlen_k; }
  int total_q() const {
    int t = 0;
    for (int b = 0; b < batch; ++b) t += len_q(b);
    return t;
  }
  int total_k() const {
    int t = 0;
    for (int b = 0; b < batch; ++b) t += len_k(b);
    return t;
  }
  double softmax_scale() const { return scale != 0 ? scale : 1.0 / std::sqrt(double(head_dim)); }
};

// Tensors are packed (rows, heads, head_dim) with rows = sum of per-sequence lengths (for fixed
// length batches that is the contiguous (batch, seqlen, heads, head_dim) layout). lse is
// (heads_q, total_q) for varlen and (batch, heads_q, seqlen_q) otherwise. Rows that see no key get
// O = 0 and LSE = +inf.
//
// `magnitude` (rows, heads), where given, gets each output row's natural scale, sqrt(sum_j p_j^2
// |v_j|^2 / head_dim): the RMS its O would have for independent values, and the scale of the
// rounding errors of P (tolerances.hpp). Unlike the RMS of O itself it cannot be small by chance.
// With `row_step` > 1 only every row_step-th query row of each sequence (and its last) is computed,
// for shapes too large for the whole product; the others get NaN everywhere, magnitude included.
inline void reference_attention(const AttentionShape& s, const std::vector<double>& q,
                                const std::vector<double>& k, const std::vector<double>& v,
                                std::vector<double>& out, std::vector<double>& lse,
                                std::vector<double>* magnitude = nullptr, int row_step = 1) {
  const int d = s.head_dim;
  const int group = s.heads_q / s.heads_kv;
  const double scale = s.softmax_scale();
  const double skipped = row_step > 1 ? std::numeric_limits<double>::quiet_NaN() : 0.0;
  out.assign(size_t(s.total_q()) * s.heads_q * d, skipped);
  lse.assign(size_t(s.total_q()) * s.heads_q, skipped);
  if (magnitude) magnitude->assign(size_t(s.total_q()) * s.heads_q, skipped);
  const int window_right = s.causal ? 0 : s.window_right;
  std::vector<double> scores;
  int q_row0 = 0, k_row0 = 0;
  for (int b = 0; b < s.batch; ++b) {
    const int sq = s.len_q(b), sk = s.len_k(b);
    for (int h = 0; h < s.heads_q; ++h) {
      const int hk = h / group;
      for (int i = 0; i < sq; ++i) {
        if (i % row_step != 0 && i != sq - 1) continue;
        const double* qi = &q[(size_t(q_row0 + i) * s.heads_q + h) * d];
        double* oi = &out[(size_t(q_row0 + i) * s.heads_q + h) * d];
        for (int c = 0; c < d; ++c) oi[c] = 0;
        if (magnitude) (*magnitude)[size_t(q_row0 + i) * s.heads_q + h] = 0;
        scores.assign(sk, -std::numeric_limits<double>::infinity());
        double row_max = -std::numeric_limits<double>::infinity();
        for (int j = 0; j < sk; ++j) {
          const long long diagonal = static_cast<long long>(i) + sk - sq;
          if (window_right >= 0 && j > diagonal + window_right) continue;
          if (s.window_left >= 0 && j < diagonal - s.window_left) continue;
          if (s.mask_fn && !s.mask_fn(b, h, i, j)) continue;
          const double* kj = &k[(size_t(k_row0 + j) * s.heads_kv + hk) * d];
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += qi[c] * kj[c];
          double score = dot * scale;
          if (s.softcap > 0) score = s.softcap * std::tanh(score / s.softcap);
          if (s.score_fn) score = s.score_fn(score, b, h, i, j);
          scores[j] = score;
          row_max = std::max(row_max, score);
        }
        const size_t lse_index = s.is_varlen() ? size_t(h) * s.total_q() + q_row0 + i
                                               : (size_t(b) * s.heads_q + h) * sq + i;
        if (row_max == -std::numeric_limits<double>::infinity()) {
          lse[lse_index] = s.mask_fn ? -std::numeric_limits<double>::infinity() : std::numeric_limits<double>::infinity();
          continue;
        }
        double sum = 0, spread = 0;  // spread: sum_j p_j^2 |v_j|^2, unnormalised
        for (int j = 0; j < sk; ++j) {
          if (scores[j] == -std::numeric_limits<double>::infinity()) continue;
          const double p = std::exp(scores[j] - row_max);
          sum += p;
          const double* vj = &v[(size_t(k_row0 + j) * s.heads_kv + hk) * d];
          double norm2 = 0;
          for (int c = 0; c < d; ++c) {
            oi[c] += p * vj[c];
            norm2 += vj[c] * vj[c];
          }
          spread += p * p * norm2;
        }
        for (int c = 0; c < d; ++c) oi[c] /= sum;
        if (magnitude) (*magnitude)[size_t(q_row0 + i) * s.heads_q + h] = std::sqrt(spread / d) / sum;
        lse[lse_index] = row_max + std::log(sum);
      }
    }
    q_row0 += sq;
    k_row0 += sk;
  }
}

// Gradients of reference_attention: dq, dk, dv (packed like q, k, v) from dout. `out` is the
// forward output the kernel under test saw (rounded to its dtype), used for delta = rowsum(dout *
// out) as the kernels do; P comes from float64 scores. The *_mass outputs hold, per element, the
// sum of |terms| that make it up (|P| |dO| for dv, |dS| |q| for dk, |dS| |k| for dq): rounding one
// factor of every term by a relative u moves the element by at most u times its mass. dS = P (dP -
// delta) cancels when one key dominates a row; its fp32 error is relative to P (|dO| . |v| +
// |dO| . |out|), and the *_cancellation outputs carry that bound through to dq and dk.
struct AttentionGradients {
  std::vector<double> dq, dk, dv;
  std::vector<double> dq_mass, dk_mass, dv_mass;
  std::vector<double> dq_cancellation, dk_cancellation;
};

inline AttentionGradients reference_attention_backward(const AttentionShape& s, const std::vector<double>& q,
                                                       const std::vector<double>& k, const std::vector<double>& v,
                                                       const std::vector<double>& out,
                                                       const std::vector<double>& dout) {
  const int d = s.head_dim;
  const int group = s.heads_q / s.heads_kv;
  const double scale = s.softmax_scale();
  const int window_right = s.causal ? 0 : s.window_right;
  const double minus_inf = -std::numeric_limits<double>::infinity();
  AttentionGradients g;
  g.dq.assign(q.size(), 0.0);
  g.dq_mass.assign(q.size(), 0.0);
  g.dk.assign(k.size(), 0.0);
  g.dk_mass.assign(k.size(), 0.0);
  g.dv.assign(v.size(), 0.0);
  g.dv_mass.assign(v.size(), 0.0);
  g.dq_cancellation.assign(q.size(), 0.0);
  g.dk_cancellation.assign(k.size(), 0.0);
  std::vector<double> scores, dscore_ddot;
  int q_row0 = 0, k_row0 = 0;
  for (int b = 0; b < s.batch; ++b) {
    const int sq = s.len_q(b), sk = s.len_k(b);
    for (int h = 0; h < s.heads_q; ++h) {
      const int hk = h / group;
      for (int i = 0; i < sq; ++i) {
        const size_t qi_at = (size_t(q_row0 + i) * s.heads_q + h) * d;
        const double* qi = &q[qi_at];
        const double* doi = &dout[qi_at];
        scores.assign(sk, minus_inf);
        dscore_ddot.assign(sk, 0.0);
        double row_max = minus_inf;
        for (int j = 0; j < sk; ++j) {
          const long long diagonal = static_cast<long long>(i) + sk - sq;
          if (window_right >= 0 && j > diagonal + window_right) continue;
          if (s.window_left >= 0 && j < diagonal - s.window_left) continue;
          if (s.mask_fn && !s.mask_fn(b, h, i, j)) continue;
          const double* kj = &k[(size_t(k_row0 + j) * s.heads_kv + hk) * d];
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += qi[c] * kj[c];
          double score = dot * scale;
          dscore_ddot[j] = scale;
          if (s.softcap > 0) {
            const double t = std::tanh(score / s.softcap);
            score = s.softcap * t;
            dscore_ddot[j] = scale * (1 - t * t);
          }
          if (s.score_fn) {
            // The modifier's derivative by a central difference (its error, ~1e-10 relative, is far
            // below the kernels' tolerance): the reference needs no hand-written gradient to trust.
            const double step = 1e-5 * std::max(1.0, std::fabs(score));
            const double derivative = (s.score_fn(score + step, b, h, i, j) - s.score_fn(score - step, b, h, i, j)) / (2 * step);
            dscore_ddot[j] *= std::isfinite(derivative) ? derivative : 0.0;
            score = s.score_fn(score, b, h, i, j);
          }
          scores[j] = score;
          row_max = std::max(row_max, score);
        }
        if (row_max == minus_inf) continue;  // no visible key: no gradient flows
        double sum = 0;
        for (int j = 0; j < sk; ++j)
          if (scores[j] != minus_inf) sum += std::exp(scores[j] - row_max);
        const double lse = row_max + std::log(sum);
        double delta = 0, delta_abs = 0;
        for (int c = 0; c < d; ++c) {
          delta += doi[c] * out[qi_at + c];
          delta_abs += std::fabs(doi[c] * out[qi_at + c]);
        }
        for (int j = 0; j < sk; ++j) {
          if (scores[j] == minus_inf) continue;
          const size_t kj_at = (size_t(k_row0 + j) * s.heads_kv + hk) * d;
          const double* kj = &k[kj_at];
          const double* vj = &v[kj_at];
          const double p = std::exp(scores[j] - lse);
          double dp = 0, dp_abs = 0;
          for (int c = 0; c < d; ++c) {
            dp += doi[c] * vj[c];
            dp_abs += std::fabs(doi[c] * vj[c]);
          }
          const double dx = p * (dp - delta) * dscore_ddot[j];
          const double dx_error_scale = p * (dp_abs + delta_abs) * std::fabs(dscore_ddot[j]);
          for (int c = 0; c < d; ++c) {
            g.dv[kj_at + c] += p * doi[c];
            g.dv_mass[kj_at + c] += p * std::fabs(doi[c]);
            g.dk[kj_at + c] += dx * qi[c];
            g.dk_mass[kj_at + c] += std::fabs(dx * qi[c]);
            g.dq[qi_at + c] += dx * kj[c];
            g.dq_mass[qi_at + c] += std::fabs(dx * kj[c]);
            g.dk_cancellation[kj_at + c] += dx_error_scale * std::fabs(qi[c]);
            g.dq_cancellation[qi_at + c] += dx_error_scale * std::fabs(kj[c]);
          }
        }
      }
    }
    q_row0 += sq;
    k_row0 += sk;
  }
  return g;
}

}  // namespace flashjit::test
