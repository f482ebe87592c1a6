// One backward test case on the GPU: random inputs and dout (rounded to the dtype), the forward
// through the public API, checked against the float64 reference forward, poisoned gradients, the
// backward, and a comparison of dq, dk, dv with the float64 reference gradients. The backward is
// fed the reference forward's O (rounded to the dtype) and LSE, not the kernel's: its reference
// then depends on no kernel output, so a forward that drifted cannot carry the backward's
// reference along with it.
#pragma once

#include <cmath>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "support/attention_case.hpp"

namespace flashjit::test {

struct GradientComparison {
  Comparison forward_out, dq, dk, dv;  // forward_out: the forward kernel's O against the reference
  bool ok() const { return forward_out.ok() && dq.ok() && dk.ok() && dv.ok(); }
};

class BackwardCase {
 public:
  BackwardCase(const AttentionShape& shape, DType dtype, uint64_t seed, Layout layout = Layout::bshd)
      : shape_(shape), dtype_(dtype), layout_(layout) {
    std::mt19937_64 rng(seed);
    const int d = shape.head_dim;
    fill_rounded(rng, dtype, size_t(shape.total_q()) * shape.heads_q * d, q_bits_, q_);
    fill_rounded(rng, dtype, size_t(shape.total_k()) * shape.heads_kv * d, k_bits_, k_);
    fill_rounded(rng, dtype, size_t(shape.total_k()) * shape.heads_kv * d, v_bits_, v_);
    fill_rounded(rng, dtype, q_.size(), dout_bits_, dout_);
    reference_attention(shape, q_, k_, v_, want_out_, want_lse_, &want_magnitude_);
    std::vector<double> rounded_out(want_out_.size());
    want_out_bits_.resize(want_out_.size());
    for (size_t i = 0; i < want_out_.size(); ++i) {
      want_out_bits_[i] = to_storage(dtype, static_cast<float>(want_out_[i]));
      rounded_out[i] = from_storage(dtype, want_out_bits_[i]);
    }
    reference_ = std::make_unique<AttentionGradients>(reference_attention_backward(shape, q_, k_, v_, rounded_out, dout_));
  }

  // Forward (the same mask options, no forced kernel, the automatic backend), then the backward
  // with `options` on the reference forward's O and LSE. Outputs and gradients are poisoned first.
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
    const int rows_q = shape_.is_varlen() ? shape_.total_q() : shape_.seqlen_q;
    const int rows_k = shape_.is_varlen() ? shape_.total_k() : shape_.seqlen_k;
    // The inputs in `layout_` (q, k, v packed for packed_qkv); out, dout and the gradients as the
    // other tensors. Outputs are poisoned.
    auto buffer = [&](int rows, int heads, Role role) {
      return std::make_unique<DeviceBuffer>(placement(shape_, rows, heads, layout_, role).elements * 2);
    };
    auto upload = [&](const std::vector<uint16_t>& bits, int rows, int heads, Role role) {
      auto b = buffer(rows, heads, role);
      b->upload(to_layout(bits, rows, heads, role));
      return b;
    };
    const auto q = upload(q_bits_, rows_q, shape_.heads_q, Role::q);
    const auto k = upload(k_bits_, rows_k, shape_.heads_kv, Role::k);
    const auto v = upload(v_bits_, rows_k, shape_.heads_kv, Role::v);
    const auto dout = upload(dout_bits_, rows_q, shape_.heads_q, Role::other);
    const auto out = buffer(rows_q, shape_.heads_q, Role::other), dq = buffer(rows_q, shape_.heads_q, Role::other);
    const auto dk = buffer(rows_k, shape_.heads_kv, Role::other), dv = buffer(rows_k, shape_.heads_kv, Role::other);
    DeviceBuffer lse(size_t(shape_.total_q()) * shape_.heads_q * 4);
    for (DeviceBuffer* b : {out.get(), &lse, dq.get(), dk.get(), dv.get()}) b->poison();
    auto qv = [&](const DeviceBuffer& b, Role role) { return view(b.get(), t, rows_q, shape_.heads_q, role); };
    auto kv = [&](const DeviceBuffer& b, Role role) { return view(b.get(), t, rows_k, shape_.heads_kv, role); };
    const Role other = Role::other;

    if (shape_.is_varlen()) {
      const DeviceVarlenBatch varlen(shape_);
      auto lse_view = TensorView::contiguous(lse.get(), ScalarType::float32, {shape_.heads_q, rows_q});
      runtime.forward_varlen(qv(*q, Role::q), kv(*k, Role::k), kv(*v, Role::v), qv(*out, other), &lse_view,
                             varlen.batch(), forward_options);
      synchronize();
      take_forward(*out, lse, forward_options);
      runtime.backward_varlen(qv(*q, Role::q), kv(*k, Role::k), kv(*v, Role::v), qv(*out, other), qv(*dout, other),
                              &lse_view, qv(*dq, other), kv(*dk, other), kv(*dv, other), varlen.batch(), options);
    } else {
      auto lse_view = TensorView::contiguous(lse.get(), ScalarType::float32,
                                             {shape_.batch, shape_.heads_q, shape_.seqlen_q});
      runtime.forward(qv(*q, Role::q), kv(*k, Role::k), kv(*v, Role::v), qv(*out, other), &lse_view,
                      forward_options);
      synchronize();
      take_forward(*out, lse, forward_options);
      runtime.backward(qv(*q, Role::q), kv(*k, Role::k), kv(*v, Role::v), qv(*out, other), qv(*dout, other),
                       &lse_view, qv(*dq, other), kv(*dk, other), kv(*dv, other), options);
    }
    synchronize();
    CaseLedger::get().ran(options, /*backward=*/true, shape_, dtype_);
    got_dq_ = from_layout(dq->download<uint16_t>(), rows_q, shape_.heads_q, other);
    got_dk_ = from_layout(dk->download<uint16_t>(), rows_k, shape_.heads_kv, other);
    got_dv_ = from_layout(dv->download<uint16_t>(), rows_k, shape_.heads_kv, other);
  }

  GradientComparison check(GradientTolerance t) const {
    GradientComparison c = check_gradients(got_dq_, got_dk_, got_dv_, t);
    c.forward_out = forward_out_;
    return c;
  }

  // Gradients computed elsewhere from this case's inputs (ring attention's shards, unsharded;
  // packed (rows, heads, head_dim)) against the float64 reference, as check() compares the run's.
  GradientComparison check_gradients(const std::vector<uint16_t>& dq, const std::vector<uint16_t>& dk,
                                     const std::vector<uint16_t>& dv, GradientTolerance t) const {
    GradientComparison c;
    const std::vector<double> none(reference_->dv.size(), 0.0);  // dV = P^T dO has no dS
    compare_gradient(c.dq, "dq", dq, reference_->dq, reference_->dq_mass, reference_->dq_cancellation, shape_.heads_q, t);
    compare_gradient(c.dk, "dk", dk, reference_->dk, reference_->dk_mass, reference_->dk_cancellation, shape_.heads_kv, t);
    compare_gradient(c.dv, "dv", dv, reference_->dv, reference_->dv_mass, none, shape_.heads_kv, t);
    return c;
  }

  // RMS of (got - reference) of dq, dk and dv in turn.
  std::vector<double> gradient_rms_errors(const std::vector<uint16_t>& dq, const std::vector<uint16_t>& dk,
                                          const std::vector<uint16_t>& dv) const {
    std::vector<double> errors;
    for (const auto& [got, want] : {std::pair{&dq, &reference_->dq}, {&dk, &reference_->dk}, {&dv, &reference_->dv}}) {
      double sum = 0;
      for (size_t i = 0; i < want->size(); ++i) {
        const double e = from_storage(dtype_, (*got)[i]) - (*want)[i];
        sum += e * e;
      }
      errors.push_back(std::sqrt(sum / std::max<size_t>(want->size(), 1)));
    }
    return errors;
  }

  // The run's gradients, and the inputs a split of the problem needs (packed (rows, heads,
  // head_dim); the LSE (batch, heads, rows)): q, k, v, dout, and the reference forward's O (rounded)
  // and LSE, which the backward is fed.
  const std::vector<uint16_t>& dq_bits() const { return got_dq_; }
  const std::vector<uint16_t>& dk_bits() const { return got_dk_; }
  const std::vector<uint16_t>& dv_bits() const { return got_dv_; }
  const std::vector<uint16_t>& input_bits(Role role) const {
    return role == Role::q ? q_bits_ : role == Role::k ? k_bits_ : role == Role::v ? v_bits_ : dout_bits_;
  }
  const std::vector<uint16_t>& reference_out_bits() const { return want_out_bits_; }
  const std::vector<double>& reference_lse() const { return want_lse_; }

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
      << ") softcap " << shape_.softcap << " " << layout_name(layout_)
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
      compare(c, from_storage(dtype_, got[i]), want[i], element, [&] {
        return std::string(name) + "[row " + std::to_string(i / (size_t(heads) * d)) + ", head " +
               std::to_string(i / d % heads) + ", dim " + std::to_string(i % d) + "]";
      });
    }
  }

  // The forward kernel's O against the reference forward; then the reference's O and LSE replace
  // the kernel's in `out` and `lse` for the backward.
  void take_forward(DeviceBuffer& out, DeviceBuffer& lse, const AttentionOptions& forward_options) {
    CaseLedger::get().ran(forward_options, /*backward=*/false, shape_, dtype_);
    const int rows_q = shape_.is_varlen() ? shape_.total_q() : shape_.seqlen_q;
    const std::vector<uint16_t> got = from_layout(out.download<uint16_t>(), rows_q, shape_.heads_q, Role::other);
    forward_out_ = compare_output(shape_, dtype_, got, want_out_, want_magnitude_, tensor_core_output_tolerance(dtype_));
    out.upload(to_layout(want_out_bits_, rows_q, shape_.heads_q, Role::other));
    std::vector<float> lse_values(want_lse_.begin(), want_lse_.end());
    lse.upload(lse_values);
  }

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
  std::vector<uint16_t> q_bits_, k_bits_, v_bits_, dout_bits_;
  std::vector<double> q_, k_, v_, dout_, want_out_, want_lse_, want_magnitude_;
  std::vector<uint16_t> want_out_bits_;  // the reference O rounded to the dtype, the backward's input
  Comparison forward_out_;
  std::unique_ptr<AttentionGradients> reference_;
  std::vector<uint16_t> got_dq_, got_dk_, got_dv_;
};

}  // namespace flashjit::test
