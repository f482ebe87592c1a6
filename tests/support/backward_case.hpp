// One backward test case on the GPU: random inputs and dout (rounded to the dtype), the forward
// through the public API (its out and lse feed the backward, as in training), poisoned gradients,
// the backward, and a comparison of dq, dk, dv with the float64 reference gradients.
#pragma once

#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "support/attention_case.hpp"

namespace flashjit::test {

struct GradientComparison {
  Comparison dq, dk, dv;
  bool ok() const { return dq.ok() && dk.ok() && dv.ok(); }
};

class BackwardCase {
 public:
  BackwardCase(const AttentionShape& shape, DType dtype, uint64_t seed, Layout layout = Layout::bshd)
      : shape_(shape), dtype_(dtype), layout_(shape.is_varlen() ? Layout::bshd : layout) {
    std::mt19937_64 rng(seed);
    const int d = shape.head_dim;
    fill_rounded(rng, dtype, size_t(shape.total_q()) * shape.heads_q * d, q_bits_, q_);
    fill_rounded(rng, dtype, size_t(shape.total_k()) * shape.heads_kv * d, k_bits_, k_);
    fill_rounded(rng, dtype, size_t(shape.total_k()) * shape.heads_kv * d, v_bits_, v_);
    fill_rounded(rng, dtype, q_.size(), dout_bits_, dout_);
  }

  // Forward, then backward with `options` (the forward gets the same mask options, no forced
  // kernel and the automatic backend). Gradients are poisoned first; the reference is computed once, from the first run's
  // forward output.
  void run(Runtime& runtime, AttentionOptions options) {
    options.causal = shape_.causal;
    options.window_left = shape_.window_left;
    options.window_right = shape_.window_right;
    options.softcap = shape_.softcap;
    if (shape_.scale != 0) options.softmax_scale = static_cast<float>(shape_.scale);
    AttentionOptions forward_options = options;
    forward_options.kernel.reset();
    forward_options.backend = Backend::automatic;

    const ScalarType t = dtype_ == DType::bf16 ? ScalarType::bfloat16 : ScalarType::float16;
    const size_t q_bytes = q_bits_.size() * 2, k_bytes = k_bits_.size() * 2;
    DeviceBuffer q(q_bytes), k(k_bytes), v(k_bytes), out(q_bytes), dout(q_bytes), dq(q_bytes), dk(k_bytes),
        dv(k_bytes), lse(size_t(shape_.total_q()) * shape_.heads_q * 4);
    q.upload(to_layout(q_bits_, shape_.seqlen_q, shape_.heads_q));
    k.upload(to_layout(k_bits_, shape_.seqlen_k, shape_.heads_kv));
    v.upload(to_layout(v_bits_, shape_.seqlen_k, shape_.heads_kv));
    dout.upload(to_layout(dout_bits_, shape_.seqlen_q, shape_.heads_q));
    for (DeviceBuffer* b : {&out, &lse, &dq, &dk, &dv}) b->poison();

    if (shape_.is_varlen()) {
      const DeviceVarlenBatch varlen(shape_);
      const VarlenBatch& batch = varlen.batch();
      const int d = shape_.head_dim;
      auto packed = [&](DeviceBuffer& b, int rows, int heads) {
        return TensorView::contiguous(b.get(), t, {rows, heads, d});
      };
      const int tq = shape_.total_q(), tk = shape_.total_k();
      auto lse_view = TensorView::contiguous(lse.get(), ScalarType::float32, {shape_.heads_q, tq});
      runtime.forward_varlen(packed(q, tq, shape_.heads_q), packed(k, tk, shape_.heads_kv),
                             packed(v, tk, shape_.heads_kv), packed(out, tq, shape_.heads_q), &lse_view, batch,
                             forward_options);
      runtime.backward_varlen(packed(q, tq, shape_.heads_q), packed(k, tk, shape_.heads_kv),
                              packed(v, tk, shape_.heads_kv), packed(out, tq, shape_.heads_q),
                              packed(dout, tq, shape_.heads_q), &lse_view, packed(dq, tq, shape_.heads_q),
                              packed(dk, tk, shape_.heads_kv), packed(dv, tk, shape_.heads_kv), batch, options);
      synchronize();
    } else {
      auto lse_view = TensorView::contiguous(lse.get(), ScalarType::float32,
                                             {shape_.batch, shape_.heads_q, shape_.seqlen_q});
      auto qv = [&](DeviceBuffer& b) { return view(b.get(), t, shape_.seqlen_q, shape_.heads_q); };
      auto kv = [&](DeviceBuffer& b) { return view(b.get(), t, shape_.seqlen_k, shape_.heads_kv); };
      runtime.forward(qv(q), kv(k), kv(v), qv(out), &lse_view, forward_options);
      runtime.backward(qv(q), kv(k), kv(v), qv(out), qv(dout), &lse_view, qv(dq), kv(dk), kv(dv), options);
      synchronize();
    }
    if (!reference_) {
      const std::vector<uint16_t> out_bits = from_layout(out.download<uint16_t>(), shape_.seqlen_q, shape_.heads_q);
      std::vector<double> out_values(out_bits.size());
      for (size_t i = 0; i < out_bits.size(); ++i) out_values[i] = from_storage(dtype_, out_bits[i]);
      reference_ = std::make_unique<AttentionGradients>(
          reference_attention_backward(shape_, q_, k_, v_, out_values, dout_));
    }
    got_dq_ = from_layout(dq.download<uint16_t>(), shape_.seqlen_q, shape_.heads_q);
    got_dk_ = from_layout(dk.download<uint16_t>(), shape_.seqlen_k, shape_.heads_kv);
    got_dv_ = from_layout(dv.download<uint16_t>(), shape_.seqlen_k, shape_.heads_kv);
  }

  GradientComparison check(GradientTolerance t) const {
    GradientComparison c;
    const std::vector<double> none(reference_->dv.size(), 0.0);  // dV = P^T dO has no dS
    compare_gradient(c.dq, "dq", got_dq_, reference_->dq, reference_->dq_mass, reference_->dq_cancellation,
                     shape_.heads_q, t);
    compare_gradient(c.dk, "dk", got_dk_, reference_->dk, reference_->dk_mass, reference_->dk_cancellation,
                     shape_.heads_kv, t);
    compare_gradient(c.dv, "dv", got_dv_, reference_->dv, reference_->dv_mass, none, shape_.heads_kv, t);
    return c;
  }

  // Raw bits of the last run's gradients, for bitwise rerun checks.
  std::vector<uint16_t> gradient_bits() const {
    std::vector<uint16_t> all = got_dq_;
    all.insert(all.end(), got_dk_.begin(), got_dk_.end());
    all.insert(all.end(), got_dv_.begin(), got_dv_.end());
    return all;
  }

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
  void compare_gradient(Comparison& c, const char* name, const std::vector<uint16_t>& got,
                        const std::vector<double>& want, const std::vector<double>& mass,
                        const std::vector<double>& cancellation, int heads, GradientTolerance t) const {
    const int d = shape_.head_dim;
    for (size_t i = 0; i < want.size(); ++i) {
      const Tolerance element{t.atol + t.mass_factor * mass[i] + t.cancellation_factor * cancellation[i], t.rtol};
      compare(c, from_storage(dtype_, got[i]), want[i], element,
              std::string(name) + "[row " + std::to_string(i / (size_t(heads) * d)) + ", head " +
                  std::to_string(i / d % heads) + ", dim " + std::to_string(i % d) + "]");
    }
  }

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
  std::vector<uint16_t> q_bits_, k_bits_, v_bits_, dout_bits_;
  std::vector<double> q_, k_, v_, dout_;
  std::unique_ptr<AttentionGradients> reference_;
  std::vector<uint16_t> got_dq_, got_dk_, got_dv_;
};

}  // namespace flashjit::test
