// What the forward and backward GPU test cases share: random inputs rounded to the dtype (bits for
// the device, values for the float64 reference), and the two memory orders of the
// (batch, seqlen, heads, head_dim) tensors.
#pragma once

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "flashjit/flashjit.hpp"
#include "support/attention_reference.hpp"
#include "support/device_buffer.hpp"
#include "support/half_precision.hpp"

namespace flashjit::test {

enum class Layout { bshd, bhsd };  // memory order of q/k/v/out (ignored for varlen: packed)

// n N(0, 1) values rounded to `dtype`: `bits` for the device, `values` (the same numbers, exactly)
// for the reference.
inline void fill_rounded(std::mt19937_64& rng, DType dtype, size_t n, std::vector<uint16_t>& bits,
                         std::vector<double>& values) {
  std::normal_distribution<float> normal(0.f, 1.f);
  bits.resize(n);
  values.resize(n);
  for (size_t i = 0; i < n; ++i) {
    bits[i] = to_storage(dtype, normal(rng));
    values[i] = from_storage(dtype, bits[i]);
  }
}

// A (batch, seqlen, heads, head_dim) view of `data` laid out in `layout`.
inline TensorView layout_view(void* data, ScalarType t, const AttentionShape& shape, int seqlen, int heads,
                              Layout layout) {
  const int d = shape.head_dim;
  TensorView v = TensorView::contiguous(data, t, {shape.batch, seqlen, heads, d});
  if (layout == Layout::bhsd) {
    v.strides[0] = int64_t(heads) * seqlen * d;
    v.strides[1] = d;
    v.strides[2] = int64_t(seqlen) * d;
  }
  return v;
}

// BSHD-ordered values to `layout` (to_memory) or back.
inline std::vector<uint16_t> relayout(const std::vector<uint16_t>& in, const AttentionShape& shape, int seqlen,
                                      int heads, Layout layout, bool to_memory) {
  if (layout == Layout::bshd) return in;
  std::vector<uint16_t> out(in.size());
  const int d = shape.head_dim;
  for (int b = 0; b < shape.batch; ++b)
    for (int s = 0; s < seqlen; ++s)
      for (int h = 0; h < heads; ++h)
        for (int c = 0; c < d; ++c) {
          const size_t bshd = ((size_t(b) * seqlen + s) * heads + h) * d + c;
          const size_t bhsd = ((size_t(b) * heads + h) * seqlen + s) * d + c;
          if (to_memory) out[bhsd] = in[bshd];
          else out[bshd] = in[bhsd];
        }
  return out;
}

// A varlen shape's cu_seqlens on the device, and the VarlenBatch pointing at them.
class DeviceVarlenBatch {
 public:
  explicit DeviceVarlenBatch(const AttentionShape& shape) {
    std::vector<int> cu_q{0}, cu_k{0};
    int max_q = 0, max_k = 0;
    for (int b = 0; b < shape.batch; ++b) {
      cu_q.push_back(cu_q.back() + shape.seqlens_q[b]);
      cu_k.push_back(cu_k.back() + shape.seqlens_k[b]);
      max_q = std::max(max_q, shape.seqlens_q[b]);
      max_k = std::max(max_k, shape.seqlens_k[b]);
    }
    cu_q_ = std::make_unique<DeviceBuffer>(cu_q.size() * 4);
    cu_k_ = std::make_unique<DeviceBuffer>(cu_k.size() * 4);
    cu_q_->upload(cu_q);
    cu_k_->upload(cu_k);
    batch_ = VarlenBatch{TensorView::contiguous(cu_q_->get(), ScalarType::int32, {int64_t(cu_q.size())}),
                         TensorView::contiguous(cu_k_->get(), ScalarType::int32, {int64_t(cu_k.size())}), max_q,
                         max_k};
  }
  const VarlenBatch& batch() const { return batch_; }

 private:
  std::unique_ptr<DeviceBuffer> cu_q_, cu_k_;
  VarlenBatch batch_;
};

}  // namespace flashjit::test
