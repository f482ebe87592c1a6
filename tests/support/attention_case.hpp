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
#include "support/attention_layout.hpp"
#include "support/attention_reference.hpp"
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
  bool ok() const { return bad == 0; }
};

inline void compare(Comparison& c, double got, double want, Tolerance t, const std::string& where) {
  ++c.checked;
  const bool both_inf = std::isinf(want) && got == want;
  const double err = both_inf ? 0.0 : std::fabs(got - want);
  if (!(err <= t.atol + t.rtol * std::fabs(want))) {  // NaN fails here
    if (c.bad++ == 0) {
      std::ostringstream s;
      s << where << ": got " << got << ", want " << want;
      c.first_bad = s.str();
    }
  }
  if (std::isfinite(err)) c.max_abs = std::max(c.max_abs, err);
}

// Where the expected values come from: the float64 CPU reference, or, for shapes too large for
// it, the GPU reference kernel (fp32 math) run on the same device inputs.
enum class Oracle { cpu_float64, gpu_reference };

class AttentionCase {
 public:
  AttentionCase(const AttentionShape& shape, DType dtype, uint64_t seed, Layout layout = Layout::bshd,
                Oracle oracle = Oracle::cpu_float64)
      : shape_(shape), dtype_(dtype), layout_(shape.is_varlen() ? Layout::bshd : layout), oracle_(oracle) {
    std::mt19937_64 rng(seed);
    const int d = shape.head_dim;
    fill_rounded(rng, dtype, size_t(shape.total_q()) * shape.heads_q * d, q_bits_, q_);
    fill_rounded(rng, dtype, size_t(shape.total_k()) * shape.heads_kv * d, k_bits_, k_);
    fill_rounded(rng, dtype, size_t(shape.total_k()) * shape.heads_kv * d, v_bits_, v_);
    if (oracle == Oracle::cpu_float64) {
      reference_attention(shape, q_, k_, v_, want_out_, want_lse_);
    } else {
      want_out_.assign(q_.size(), 0.0);
      want_lse_.assign(size_t(shape.total_q()) * shape.heads_q, 0.0);
    }
  }

  // Poisons the outputs, runs `runtime.forward` (or forward_varlen), synchronizes. With the GPU
  // oracle, the reference kernel first computes the expected values from the same inputs.
  void run(Runtime& runtime, AttentionOptions options) {
    if (oracle_ == Oracle::gpu_reference && !oracle_done_) {
      AttentionOptions reference = options;
      reference.backend = Backend::reference;
      reference.kernel.reset();
      launch(runtime, reference);
      for (size_t i = 0; i < got_out_.size(); ++i) want_out_[i] = from_storage(dtype_, got_out_[i]);
      for (size_t i = 0; i < got_lse_.size(); ++i) want_lse_[i] = got_lse_[i];
      oracle_done_ = true;
    }
    launch(runtime, options);
  }

  // The expected output comes rounded to 16 bits from the GPU oracle: widen the tolerance by that
  // rounding (half an ulp).
  Tolerance oracle_adjusted(Tolerance t) const {
    if (oracle_ == Oracle::gpu_reference) t.rtol += dtype_ == DType::bf16 ? 1.0 / 512 : 1.0 / 4096;
    return t;
  }

 private:
  void launch(Runtime& runtime, AttentionOptions options) {
    const int d = shape_.head_dim;
    DeviceBuffer q(q_bits_.size() * 2), k(k_bits_.size() * 2), v(v_bits_.size() * 2);
    out_ = std::make_unique<DeviceBuffer>(q_bits_.size() * 2);
    lse_ = std::make_unique<DeviceBuffer>(want_lse_.size() * 4);
    q.upload(to_layout(q_bits_, shape_.seqlen_q, shape_.heads_q));
    k.upload(to_layout(k_bits_, shape_.seqlen_k, shape_.heads_kv));
    v.upload(to_layout(v_bits_, shape_.seqlen_k, shape_.heads_kv));
    out_->poison();
    lse_->poison();
    const ScalarType t = dtype_ == DType::bf16 ? ScalarType::bfloat16 : ScalarType::float16;
    options.causal = shape_.causal;
    options.window_left = shape_.window_left;
    options.window_right = shape_.window_right;
    options.softcap = shape_.softcap;
    if (shape_.scale != 0) options.softmax_scale = static_cast<float>(shape_.scale);
    if (shape_.is_varlen()) {
      const DeviceVarlenBatch varlen(shape_);
      const VarlenBatch& batch = varlen.batch();
      auto lse_view = TensorView::contiguous(lse_->get(), ScalarType::float32, {shape_.heads_q, shape_.total_q()});
      runtime.forward_varlen(
          TensorView::contiguous(q.get(), t, {shape_.total_q(), shape_.heads_q, d}),
          TensorView::contiguous(k.get(), t, {shape_.total_k(), shape_.heads_kv, d}),
          TensorView::contiguous(v.get(), t, {shape_.total_k(), shape_.heads_kv, d}),
          TensorView::contiguous(out_->get(), t, {shape_.total_q(), shape_.heads_q, d}), &lse_view,
          batch, options);
      synchronize();
    } else {
      auto lse_view = TensorView::contiguous(lse_->get(), ScalarType::float32,
                                             {shape_.batch, shape_.heads_q, shape_.seqlen_q});
      runtime.forward(view(q.get(), t, shape_.seqlen_q, shape_.heads_q),
                      view(k.get(), t, shape_.seqlen_k, shape_.heads_kv),
                      view(v.get(), t, shape_.seqlen_k, shape_.heads_kv),
                      view(out_->get(), t, shape_.seqlen_q, shape_.heads_q), &lse_view, options);
      synchronize();
    }
    got_out_ = from_layout(out_->download<uint16_t>(), shape_.seqlen_q, shape_.heads_q);
    got_lse_ = lse_->download<float>();
  }

 public:
  Comparison check_output(Tolerance t) const {
    t = oracle_adjusted(t);
    Comparison c;
    const int d = shape_.head_dim;
    for (size_t i = 0; i < want_out_.size(); ++i) {
      const size_t row = i / (size_t(shape_.heads_q) * d);
      const int head = static_cast<int>(i / d % shape_.heads_q), col = static_cast<int>(i % d);
      compare(c, from_storage(dtype_, got_out_[i]), want_out_[i], t,
              "out[row " + std::to_string(row) + ", head " + std::to_string(head) + ", dim " +
                  std::to_string(col) + "]");
    }
    return c;
  }

  Comparison check_lse(Tolerance t) const {
    Comparison c;
    for (size_t i = 0; i < want_lse_.size(); ++i)
      compare(c, got_lse_[i], want_lse_[i], t, "lse[" + std::to_string(i) + "]");
    return c;
  }

  const std::vector<uint16_t>& output_bits() const { return got_out_; }
  const std::vector<float>& lse_values() const { return got_lse_; }
  std::string describe() const {
    std::ostringstream s;
    s << to_string(dtype_) << " b" << shape_.batch << " sq" << shape_.seqlen_q << " sk" << shape_.seqlen_k
      << " hq" << shape_.heads_q << " hkv" << shape_.heads_kv << " d" << shape_.head_dim
      << (shape_.causal ? " causal" : "") << " window(" << shape_.window_left << "," << shape_.window_right
      << ") softcap " << shape_.softcap << (layout_ == Layout::bhsd ? " bhsd" : "")
      << (shape_.is_varlen() ? " varlen" : "");
    return s.str();
  }

 private:
  TensorView view(void* data, ScalarType t, int seqlen, int heads) const {
    return layout_view(data, t, shape_, seqlen, heads, layout_);
  }
  std::vector<uint16_t> to_layout(const std::vector<uint16_t>& bshd, int seqlen, int heads) const {
    return relayout(bshd, shape_, seqlen, heads, layout_, /*to_memory=*/true);
  }
  std::vector<uint16_t> from_layout(const std::vector<uint16_t>& mem, int seqlen, int heads) const {
    return relayout(mem, shape_, seqlen, heads, layout_, /*to_memory=*/false);
  }

  AttentionShape shape_;
  DType dtype_;
  Layout layout_;
  Oracle oracle_;
  bool oracle_done_ = false;
  std::vector<uint16_t> q_bits_, k_bits_, v_bits_;
  std::vector<double> q_, k_, v_, want_out_, want_lse_;
  std::unique_ptr<DeviceBuffer> out_, lse_;
  std::vector<uint16_t> got_out_;
  std::vector<float> got_lse_;
};

}  // namespace flashjit::test
