// What the forward and backward GPU test cases share: random inputs rounded to the dtype (bits for
// the device, values for the float64 reference), and the memory layouts of the (batch, seqlen,
// heads, head_dim) tensors.
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

// Memory orders of q/k/v/out and the gradients, each tensor in its own buffer:
//   bshd        (batch, seqlen, heads, head_dim) contiguous: flash-attn's order, a projection's output
//   bhsd        (batch, heads, seqlen, head_dim) contiguous: SDPA's
//   bshd_padded bshd with each token's row padded by 8 elements (16 bytes): a slice of a wider tensor
//   packed_qkv  q, k and v as the views of one (batch, seqlen, heads_q + 2 heads_kv, head_dim) QKV
//               projection: token stride (heads_q + 2 heads_kv) head_dim, k and v at offsets; the
//               other tensors bshd (each buffer holds the whole packed extent, only its part written)
// Varlen tensors are (total rows, heads, head_dim): bshd packs them so; bhsd stores (heads, total
// rows, head_dim), head-major; padded and packed apply to the rows as above.
// Memory no element of the view covers holds NaN: a kernel that reads it shows.
enum class Layout { bshd, bhsd, bshd_padded, packed_qkv };
enum class Role { q, k, v, other };  // which tensor, for packed_qkv

inline const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::bshd: return "bshd";
    case Layout::bhsd: return "bhsd";
    case Layout::bshd_padded: return "bshd padded";
    case Layout::packed_qkv: return "packed qkv";
  }
  return "?";
}

struct MemoryPlacement {
  int64_t offset = 0;                // elements before (0, 0, 0, 0)
  int64_t batch = 0, row = 0, head = 0;  // strides in elements; the head_dim stride is 1
  int64_t elements = 0;              // the buffer's size
};

// Where (batch, s, head, c) of a (batch, seqlen, heads, head_dim) tensor lives (varlen: batch 0,
// s the packed row of `seqlen` total rows).
inline MemoryPlacement placement(const AttentionShape& shape, int seqlen, int heads, Layout layout, Role role) {
  const int64_t d = shape.head_dim, batch = shape.is_varlen() ? 1 : shape.batch;
  MemoryPlacement m;
  if (layout == Layout::packed_qkv && role == Role::other) layout = Layout::bshd;
  switch (layout) {
    case Layout::bshd:
      m.head = d, m.row = heads * d;
      break;
    case Layout::bhsd:
      m.row = d, m.head = seqlen * d;
      break;
    case Layout::bshd_padded:
      m.head = d, m.row = heads * d + 8;
      break;
    case Layout::packed_qkv:
      m.head = d, m.row = (shape.heads_q + 2 * shape.heads_kv) * d;
      m.offset = role == Role::q ? 0 : role == Role::k ? shape.heads_q * d : (shape.heads_q + shape.heads_kv) * d;
      break;
  }
  m.batch = layout == Layout::bhsd ? heads * seqlen * d : seqlen * m.row;
  m.elements = m.offset + batch * m.batch;
  return m;
}

// A (batch, seqlen, heads, head_dim) view of `data` laid out in `layout` (varlen: (rows, heads, head_dim)).
inline TensorView layout_view(void* data, ScalarType t, const AttentionShape& shape, int seqlen, int heads,
                              Layout layout, Role role = Role::other) {
  const MemoryPlacement m = placement(shape, seqlen, heads, layout, role);
  void* base = static_cast<uint16_t*>(data) + m.offset;
  if (shape.is_varlen()) {
    TensorView v = TensorView::contiguous(base, t, {seqlen, heads, shape.head_dim});
    v.strides[0] = m.row;
    v.strides[1] = m.head;
    return v;
  }
  TensorView v = TensorView::contiguous(base, t, {shape.batch, seqlen, heads, shape.head_dim});
  v.strides[0] = m.batch;
  v.strides[1] = m.row;
  v.strides[2] = m.head;
  return v;
}

// BSHD-ordered (packed, for varlen) values to `layout`'s memory (to_memory, NaN where no element
// lies) or back.
inline std::vector<uint16_t> relayout(const std::vector<uint16_t>& in, const AttentionShape& shape, int seqlen,
                                      int heads, Layout layout, bool to_memory, Role role = Role::other) {
  const MemoryPlacement m = placement(shape, seqlen, heads, layout, role);
  const int d = shape.head_dim, batch = shape.is_varlen() ? 1 : shape.batch;
  std::vector<uint16_t> out(to_memory ? size_t(m.elements) : size_t(batch) * seqlen * heads * d, uint16_t(0x7fc0));
  for (int b = 0; b < batch; ++b)
    for (int s = 0; s < seqlen; ++s)
      for (int h = 0; h < heads; ++h)
        for (int c = 0; c < d; ++c) {
          const size_t dense = ((size_t(b) * seqlen + s) * heads + h) * d + c;
          const size_t memory = size_t(m.offset + b * m.batch + s * m.row + h * m.head + c);
          if (to_memory) out[memory] = in[dense];
          else out[dense] = in[memory];
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
