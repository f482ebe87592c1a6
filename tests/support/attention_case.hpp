// One forward-attention test case on the GPU: random inputs (rounded to the dtype), device buffers
// in the requested layout, poisoned outputs, a launch through the public API, and a comparison
// with the float64 reference.
#pragma once

#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "flashjit/flashjit.hpp"
#include "flashjit/tuning.hpp"
#include "support/attention_layout.hpp"
#include "support/attention_reference.hpp"
#include "support/case_ledger.hpp"
#include "support/device_buffer.hpp"
#include "support/half_precision.hpp"
#include "support/tolerances.hpp"

namespace flashjit::test {

// One runtime for a whole test executable, configured from FLASHJIT_* like an application's.
inline Runtime& test_runtime() {
  static Runtime runtime(CacheConfig::from_environment());
  return runtime;
}

struct Comparison {
  size_t checked = 0;
  size_t bad = 0;        // outside tolerance (NaN counts: unwritten elements stay NaN)
  double max_abs = 0;    // largest |got - want|
  std::string first_bad;
  // Heads over Tolerance::head_rms, and the largest RMS of row errors relative to magnitude.
  size_t bad_heads = 0;
  double worst_head_rms = 0;
  std::string worst_head;
  bool ok() const { return bad == 0 && bad_heads == 0; }
};

// `where` (a callable giving the element's name) runs only for the first bad element: built for every
// element, the names were most of a large case's time.
template <class Where>
void compare(Comparison& c, double got, double want, Tolerance t, Where&& where) {
  ++c.checked;
  const bool both_inf = std::isinf(want) && got == want;
  const double err = both_inf ? 0.0 : std::fabs(got - want);
  if (!(err <= t.atol + t.rtol * std::fabs(want))) {  // NaN fails here
    if (c.bad++ == 0) {
      std::ostringstream s;
      s << where() << ": got " << got << ", want " << want;
      c.first_bad = s.str();
    }
  }
  if (std::isfinite(err)) c.max_abs = std::max(c.max_abs, err);
}

// Elementwise and per head (tolerances.hpp); rows with a NaN magnitude were not computed.
inline Comparison compare_output(const AttentionShape& shape, DType dtype, const std::vector<uint16_t>& got,
                               const std::vector<double>& want, const std::vector<double>& magnitudes, Tolerance t) {
  Comparison c;
  const int d = shape.head_dim, heads = shape.heads_q;
  const size_t rows = want.size() / (size_t(heads) * d);
  std::vector<double> head_sum(heads, 0.0);
  std::vector<size_t> head_rows(heads, 0);
  for (size_t row = 0; row < rows; ++row)
    for (int head = 0; head < heads; ++head) {
      const size_t base = (row * heads + head) * d;
      double magnitude = 0;
      if (!magnitudes.empty()) {
        magnitude = magnitudes[row * heads + head];
      } else {  // the GPU oracle: the row's RMS
        for (int col = 0; col < d; ++col) magnitude += want[base + col] * want[base + col];
        magnitude = std::sqrt(magnitude / d);
      }
      if (std::isnan(magnitude)) continue;
      const Tolerance element{t.atol + t.row * magnitude, t.rtol};
      double error2 = 0;
      for (int col = 0; col < d; ++col) {
        const double g = from_storage(dtype, got[base + col]), w = want[base + col];
        compare(c, g, w, element, [&] {
          return "out[row " + std::to_string(row) + ", head " + std::to_string(head) + ", dim " + std::to_string(col) + "]";
        });
        error2 += std::isinf(w) && g == w ? 0.0 : (g - w) * (g - w);
      }
      if (magnitude > 0) {
        head_sum[head] += error2 / d / (magnitude * magnitude);  // NaN stays NaN: a bad head
        ++head_rows[head];
      }
    }
  if (t.head_rms > 0)
    for (int head = 0; head < heads; ++head) {
      if (head_rows[head] == 0) continue;
      const double rms = std::sqrt(head_sum[head] / head_rows[head]);
      if (!(rms <= t.head_rms)) ++c.bad_heads;
      if (!(rms <= c.worst_head_rms)) {
        c.worst_head_rms = rms;
        c.worst_head = "head " + std::to_string(head) + " (" + std::to_string(head_rows[head]) + " rows)";
      }
    }
  return c;
}

// A deliberate defect for the tests of the checks (tests/gpu/test_checks.cpp): what a broken
// kernel would compute, made by running a correct one on altered arguments. The reference is not
// altered, so every defect must be caught.
struct Defect {
  double scale_factor = 1;  // the softmax scale off by this factor
  int drop_keys_from = -1;  // keys [from, from + count) of every sequence left out (fixed-length batches)
  int drop_keys_count = 0;
  bool q_wrong_layout = false;  // q read with the other layout's strides
};

// Where the expected values come from: the float64 CPU reference, or, for shapes too large for
// it, the GPU reference kernel (fp32 math) run on the same device inputs.
enum class Oracle { cpu_float64, gpu_reference };

class AttentionCase {
 public:
  AttentionCase(const AttentionShape& shape, DType dtype, uint64_t seed, Layout layout = Layout::bshd,
                Oracle oracle = Oracle::cpu_float64)
      : shape_(shape), dtype_(dtype), layout_(layout), oracle_(oracle) {
    std::mt19937_64 rng(seed);
    const int d = shape.head_dim;
    fill_rounded(rng, dtype, size_t(shape.total_q()) * shape.heads_q * d, q_bits_, q_);
    fill_rounded(rng, dtype, size_t(shape.total_k()) * shape.heads_kv * d, k_bits_, k_);
    fill_rounded(rng, dtype, size_t(shape.total_k()) * shape.heads_kv * d, v_bits_, v_);
    if (oracle == Oracle::cpu_float64) {
      reference_attention(shape, q_, k_, v_, want_out_, want_lse_, &want_magnitude_, reference_row_step(shape));
    } else {
      want_out_.assign(q_.size(), 0.0);
      want_lse_.assign(size_t(shape.total_q()) * shape.heads_q, 0.0);
    }
  }

  // Poisons the outputs, runs `runtime.forward` (or forward_varlen), synchronizes. With the GPU
  // oracle, the reference kernel first computes the expected values from the same inputs.
  void run(Runtime& runtime, AttentionOptions options, const Defect& defect = {}) {
    if (oracle_ == Oracle::gpu_reference && !oracle_done_) {
      AttentionOptions reference = options;
      reference.backend = Backend::reference;
      reference.kernel.reset();
      launch(runtime, reference);
      for (size_t i = 0; i < got_out_.size(); ++i) want_out_[i] = from_storage(dtype_, got_out_[i]);
      for (size_t i = 0; i < got_lse_.size(); ++i) want_lse_[i] = got_lse_[i];
      oracle_done_ = true;
    }
    launch(runtime, options, defect);
  }

  // The expected output comes rounded to 16 bits from the GPU oracle: widen the tolerance by that
  // rounding (half an ulp).
  Tolerance oracle_adjusted(Tolerance t) const {
    if (oracle_ == Oracle::gpu_reference) t.rtol += dtype_ == DType::bf16 ? 1.0 / 512 : 1.0 / 4096;
    return t;
  }

 private:
  void launch(Runtime& runtime, AttentionOptions options, const Defect& defect = {}) {
    const int d = shape_.head_dim;
    // The keys the kernel is given: all, or all but the dropped ones.
    const int seqlen_k = shape_.seqlen_k - (defect.drop_keys_from >= 0 ? defect.drop_keys_count : 0);
    auto given_keys = [&](const std::vector<uint16_t>& bits) {
      if (defect.drop_keys_from < 0) return bits;
      std::vector<uint16_t> kept;
      const size_t row = size_t(shape_.heads_kv) * d;
      for (int b = 0; b < shape_.batch; ++b)
        for (int j = 0; j < shape_.seqlen_k; ++j)
          if (j < defect.drop_keys_from || j >= defect.drop_keys_from + defect.drop_keys_count)
            kept.insert(kept.end(), bits.begin() + (size_t(b) * shape_.seqlen_k + j) * row,
                        bits.begin() + (size_t(b) * shape_.seqlen_k + j + 1) * row);
      return kept;
    };
    const int rows_q = shape_.is_varlen() ? shape_.total_q() : shape_.seqlen_q;
    const int rows_k = shape_.is_varlen() ? shape_.total_k() : seqlen_k;
    auto upload = [&](const std::vector<uint16_t>& bits, int rows, int heads, Role role) {
      const std::vector<uint16_t> memory = to_layout(bits, rows, heads, role);
      auto buffer = std::make_unique<DeviceBuffer>(memory.size() * 2);
      buffer->upload(memory);
      return buffer;
    };
    const auto q = upload(q_bits_, rows_q, shape_.heads_q, Role::q);
    const auto k = upload(given_keys(k_bits_), rows_k, shape_.heads_kv, Role::k);
    const auto v = upload(given_keys(v_bits_), rows_k, shape_.heads_kv, Role::v);
    out_ = std::make_unique<DeviceBuffer>(placement(shape_, rows_q, shape_.heads_q, layout_, Role::other).elements * 2);
    lse_ = std::make_unique<DeviceBuffer>(want_lse_.size() * 4);
    out_->poison();
    lse_->poison();
    const ScalarType t = dtype_ == DType::bf16 ? ScalarType::bfloat16 : ScalarType::float16;
    options.causal = shape_.causal;
    options.window_left = shape_.window_left;
    options.window_right = shape_.window_right;
    options.softcap = shape_.softcap;
    if (shape_.scale != 0) options.softmax_scale = static_cast<float>(shape_.scale);
    if (defect.scale_factor != 1)
      options.softmax_scale = static_cast<float>(shape_.softmax_scale() * defect.scale_factor);
    const Layout q_layout = !defect.q_wrong_layout ? layout_ : layout_ == Layout::bhsd ? Layout::bshd : Layout::bhsd;
    const TensorView qv = layout_view(q->get(), t, shape_, rows_q, shape_.heads_q, q_layout, Role::q);
    const TensorView kv = view(k->get(), t, rows_k, shape_.heads_kv, Role::k);
    const TensorView vv = view(v->get(), t, rows_k, shape_.heads_kv, Role::v);
    const TensorView ov = view(out_->get(), t, rows_q, shape_.heads_q, Role::other);
    if (shape_.is_varlen()) {
      const DeviceVarlenBatch varlen(shape_);
      auto lse_view = TensorView::contiguous(lse_->get(), ScalarType::float32, {shape_.heads_q, shape_.total_q()});
      runtime.forward_varlen(qv, kv, vv, ov, &lse_view, varlen.batch(), options);
    } else {
      auto lse_view = TensorView::contiguous(lse_->get(), ScalarType::float32,
                                             {shape_.batch, shape_.heads_q, shape_.seqlen_q});
      runtime.forward(qv, kv, vv, ov, &lse_view, options);
    }
    synchronize();
    got_out_ = from_layout(out_->download<uint16_t>(), rows_q, shape_.heads_q, Role::other);
    got_lse_ = lse_->download<float>();
    CaseLedger::get().ran(options, /*backward=*/false, shape_, dtype_);
  }

 public:
  Comparison check_output(Tolerance t) const {
    return compare_output(shape_, dtype_, got_out_, want_out_, want_magnitude_, oracle_adjusted(t));
  }

  // `other` (another kernel's output bits) against this run's: both are within `t` of the truth,
  // so within twice that of each other.
  Comparison check_agreement(const std::vector<uint16_t>& other, Tolerance t) const {
    std::vector<double> want(other.size());
    for (size_t i = 0; i < other.size(); ++i) want[i] = from_storage(dtype_, other[i]);
    t = oracle_adjusted(t);
    return compare_output(shape_, dtype_, got_out_, want, want_magnitude_,
                          Tolerance{2 * t.atol, 2 * t.rtol, 2 * t.row, 2 * t.head_rms});
  }

  // Every row_step-th row of each sequence where the whole float64 product would take too long
  // (about 4e8 multiply-adds per pass; the rest are not checked).
  static int reference_row_step(const AttentionShape& shape) {
    double work = 0;
    for (int b = 0; b < shape.batch; ++b) work += double(shape.len_q(b)) * shape.len_k(b);
    work *= double(shape.heads_q) * shape.head_dim;
    const int step = static_cast<int>(std::ceil(work / 4e8));
    return step <= 1 ? 1 : step | 1;  // odd, so the rows fall at every offset within a tile
  }

  Comparison check_lse(Tolerance t) const {
    Comparison c;
    for (size_t i = 0; i < want_lse_.size(); ++i)
      if (!std::isnan(want_lse_[i])) compare(c, got_lse_[i], want_lse_[i], t, [&] { return "lse[" + std::to_string(i) + "]"; });
    return c;
  }

  const std::vector<uint16_t>& output_bits() const { return got_out_; }
  // The rounded inputs (bits and values) and the float64 truth, packed (rows, heads, head_dim), for
  // tests that split the problem themselves (ring attention's shards).
  const std::vector<uint16_t>& input_bits(Role role) const { return role == Role::q ? q_bits_ : role == Role::k ? k_bits_ : v_bits_; }
  const std::vector<double>& input_values(Role role) const { return role == Role::q ? q_ : role == Role::k ? k_ : v_; }
  const std::vector<double>& want_output() const { return want_out_; }
  const std::vector<double>& want_lse() const { return want_lse_; }
  const std::vector<double>& want_magnitude() const { return want_magnitude_; }
  const std::vector<float>& lse_values() const { return got_lse_; }
  std::string describe() const {
    std::ostringstream s;
    s << to_string(dtype_) << " b" << shape_.batch << " sq" << shape_.seqlen_q << " sk" << shape_.seqlen_k
      << " hq" << shape_.heads_q << " hkv" << shape_.heads_kv << " d" << shape_.head_dim
      << (shape_.causal ? " causal" : "") << " window(" << shape_.window_left << "," << shape_.window_right
      << ") softcap " << shape_.softcap << " " << layout_name(layout_)
      << (shape_.is_varlen() ? " varlen" : "");
    return s.str();
  }

 private:
  TensorView view(void* data, ScalarType t, int rows, int heads, Role role) const {
    return layout_view(data, t, shape_, rows, heads, layout_, role);
  }
  std::vector<uint16_t> to_layout(const std::vector<uint16_t>& bshd, int rows, int heads, Role role) const {
    return relayout(bshd, shape_, rows, heads, layout_, /*to_memory=*/true, role);
  }
  std::vector<uint16_t> from_layout(const std::vector<uint16_t>& mem, int rows, int heads, Role role) const {
    return relayout(mem, shape_, rows, heads, layout_, /*to_memory=*/false, role);
  }

  AttentionShape shape_;
  DType dtype_;
  Layout layout_;
  Oracle oracle_;
  bool oracle_done_ = false;
  std::vector<uint16_t> q_bits_, k_bits_, v_bits_;
  std::vector<double> q_, k_, v_, want_out_, want_lse_, want_magnitude_;
  std::unique_ptr<DeviceBuffer> out_, lse_;
  std::vector<uint16_t> got_out_;
  std::vector<float> got_lse_;
};

// A tuning entry's problem on a shape of the test's choosing (4 query heads, GQA 2): the entry's
// head dim, dtype, mask (a window of `window_left` keys to the left), softcap and layout.
struct TunedProblemCase {
  AttentionShape shape;
  DType dtype;
  Layout layout;
};
inline TunedProblemCase tuned_problem_case(const ProblemKey& p, int batch, int seqlen_q, int seqlen_k, int window_left) {
  TunedProblemCase c{AttentionShape::make(batch, seqlen_q, seqlen_k, 4, 2, p.head_dim), p.dtype,
                     p.head_major ? Layout::bhsd : Layout::bshd};
  c.shape.causal = p.mask == MaskKind::causal;
  if (p.mask == MaskKind::window) c.shape.window_left = window_left, c.shape.window_right = 0;
  if (p.softcap) c.shape.softcap = 30.f;
  return c;
}

}  // namespace flashjit::test
