// Float64 CPU attention, the oracle for every forward test. It reads the already-rounded inputs
// (so only the kernel's arithmetic is being judged) and writes O and the natural-log LSE.
#pragma once

#include <cmath>
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
inline void reference_attention(const AttentionShape& s, const std::vector<double>& q,
                                const std::vector<double>& k, const std::vector<double>& v,
                                std::vector<double>& out, std::vector<double>& lse) {
  const int d = s.head_dim;
  const int group = s.heads_q / s.heads_kv;
  const double scale = s.softmax_scale();
  out.assign(size_t(s.total_q()) * s.heads_q * d, 0.0);
  lse.assign(size_t(s.total_q()) * s.heads_q, 0.0);
  const int window_right = s.causal ? 0 : s.window_right;
  std::vector<double> scores;
  int q_row0 = 0, k_row0 = 0;
  for (int b = 0; b < s.batch; ++b) {
    const int sq = s.len_q(b), sk = s.len_k(b);
    for (int h = 0; h < s.heads_q; ++h) {
      const int hk = h / group;
      for (int i = 0; i < sq; ++i) {
        const double* qi = &q[(size_t(q_row0 + i) * s.heads_q + h) * d];
        scores.assign(sk, -std::numeric_limits<double>::infinity());
        double row_max = -std::numeric_limits<double>::infinity();
        for (int j = 0; j < sk; ++j) {
          const long long diagonal = static_cast<long long>(i) + sk - sq;
          if (window_right >= 0 && j > diagonal + window_right) continue;
          if (s.window_left >= 0 && j < diagonal - s.window_left) continue;
          const double* kj = &k[(size_t(k_row0 + j) * s.heads_kv + hk) * d];
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += qi[c] * kj[c];
          double score = dot * scale;
          if (s.softcap > 0) score = s.softcap * std::tanh(score / s.softcap);
          scores[j] = score;
          row_max = std::max(row_max, score);
        }
        const size_t lse_index = s.is_varlen() ? size_t(h) * s.total_q() + q_row0 + i
                                               : (size_t(b) * s.heads_q + h) * sq + i;
        double* oi = &out[(size_t(q_row0 + i) * s.heads_q + h) * d];
        if (row_max == -std::numeric_limits<double>::infinity()) {
          lse[lse_index] = std::numeric_limits<double>::infinity();
          continue;
        }
        double sum = 0;
        for (int j = 0; j < sk; ++j) {
          if (scores[j] == -std::numeric_limits<double>::infinity()) continue;
          const double p = std::exp(scores[j] - row_max);
          sum += p;
          const double* vj = &v[(size_t(k_row0 + j) * s.heads_kv + hk) * d];
          for (int c = 0; c < d; ++c) oi[c] += p * vj[c];
        }
        for (int c = 0; c < d; ++c) oi[c] /= sum;
        lse[lse_index] = row_max + std::log(sum);
      }
    }
    q_row0 += sq;
    k_row0 += sk;
  }
}

}  // namespace flashjit::test
