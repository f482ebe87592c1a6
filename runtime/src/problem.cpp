#include "problem.hpp"

#include <cmath>
#include <map>
#include <vector>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "driver.hpp"

namespace flashjit {

const char* to_string(ScalarType t) {
  switch (t) {
    case ScalarType::float16: return "float16";
    case ScalarType::bfloat16: return "bfloat16";
    case ScalarType::float32: return "float32";
    case ScalarType::int32: return "int32";
    case ScalarType::int64: return "int64";
    case ScalarType::uint8: return "uint8";
    case ScalarType::float8_e4m3: return "float8_e4m3";
  }
  return "unknown";
}

int element_size(ScalarType t) {
  switch (t) {
    case ScalarType::float16: case ScalarType::bfloat16: return 2;
    case ScalarType::int64: return 8;
    case ScalarType::uint8: case ScalarType::float8_e4m3: return 1;
    default: return 4;
  }
}

TensorView TensorView::contiguous(void* data, ScalarType dtype, std::initializer_list<int64_t> shape,
                                  int device) {
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.device = device;
  view.rank = static_cast<int>(shape.size());
  if (view.rank < 1 || view.rank > 4)
    throw Error(ErrorCode::invalid_argument, "TensorView::contiguous",
                fmt::format("rank must be 1 to 4, got {}", view.rank));
  int i = 0;
  for (int64_t extent : shape) view.shape[i++] = extent;
  int64_t stride = 1;
  for (int d = view.rank - 1; d >= 0; --d) {
    view.strides[d] = stride;
    stride *= view.shape[d];
  }
  return view;
}

TensorView TensorView::head_major(void* data, ScalarType dtype, int64_t batch, int64_t seqlen, int64_t heads,
                                  int64_t head_dim, int device) {
  TensorView view = contiguous(data, dtype, {batch, seqlen, heads, head_dim}, device);
  view.strides[1] = head_dim;
  view.strides[2] = seqlen * head_dim;
  return view;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= shape[d];
  return n;
}

namespace detail {
namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kVectorBytes = 16;  // the kernels' loads

Error bad(const std::string& message) { return Error(ErrorCode::invalid_argument, "forward", message); }

std::string shape_text(const TensorView& t) {
  std::string s = "(";
  for (int d = 0; d < t.rank; ++d) s += fmt::format("{}{}", d ? ", " : "", t.shape[d]);
  return s + ")";
}

// (An empty tensor may have no memory: PyTorch's have a null data pointer.)
void check_rank(const TensorView& t, const char* name, int rank, const char* layout) {
  if (t.rank != rank)
    throw bad(fmt::format("{}: expected {} dims {}, got {} dims {}", name, rank, layout, t.rank,
                          shape_text(t)));
  for (int d = 0; d < rank; ++d)
    if (t.shape[d] < 0) throw bad(fmt::format("{}: negative extent in shape {}", name, shape_text(t)));
  if (t.data == nullptr && t.numel() > 0) throw bad(fmt::format("{}: data pointer is null", name));
}

// Last dim contiguous, other strides multiples of 16 bytes and the base 16-byte aligned, so the
// kernels can move 16 bytes per load.
void check_attention_layout(const TensorView& t, const char* name) {
  const int last = t.rank - 1;
  const int vector_elements = kVectorBytes / element_size(t.dtype);
  if (t.strides[last] != 1 && t.shape[last] > 1)
    throw bad(fmt::format("{}: the last dim (head_dim) must be contiguous (stride 1), got stride {}",
                          name, t.strides[last]));
  for (int d = 0; d < last; ++d)
    if (t.strides[d] % vector_elements != 0 && t.shape[d] > 1)
      throw bad(fmt::format("{}: stride {} of dim {} is not a multiple of {} elements (16 bytes), "
                            "which the kernels' vector loads need",
                            name, t.strides[d], d, vector_elements));
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
    throw bad(fmt::format("{}: data pointer {} is not 16-byte aligned", name, t.data));
}

void check_same(const TensorView& a, const char* a_name, const TensorView& b, const char* b_name) {
  if (a.dtype != b.dtype)
    throw bad(fmt::format("{}: dtype {} differs from {}'s {}", b_name, to_string(b.dtype), a_name,
                          to_string(a.dtype)));
  if (a.device != b.device)
    throw bad(fmt::format("{}: on device {}, but {} is on device {}", b_name, b.device, a_name,
                          a.device));
}

void check_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> expected,
                 const char* layout) {
  int d = 0;
  bool same = t.rank == static_cast<int>(expected.size());
  for (int64_t e : expected) same = same && t.shape[d++] == e;
  if (!same) {
    std::string want = "(";
    d = 0;
    for (int64_t e : expected) want += fmt::format("{}{}", d++ ? ", " : "", e);
    throw bad(fmt::format("{}: expected shape {} {}, got {}", name, want + ")", layout, shape_text(t)));
  }
}

// The kernels' strides of a (batch, seqlen, heads, head_dim) view, or of a varlen (rows, heads,
// head_dim) view, which has no batch stride.
void kernel_strides(const TensorView& t, bool varlen, long long& batch_stride, long long& row_stride,
                    long long& head_stride) {
  const int s = varlen ? 0 : 1;  // the seqlen (rows) dim
  batch_stride = varlen ? 0 : t.strides[0];
  row_stride = t.strides[s];
  head_stride = t.strides[s + 1];
}

int to_int(int64_t value, const char* what) {
  if (value > (1LL << 31) - 1) throw bad(fmt::format("{} {} does not fit in 32 bits", what, value));
  return static_cast<int>(value);
}

// The checks forward and forward_kvcache share: every tensor's rank, q's dtype (fp16 or bf16, or
// with `takes_fp8` float8_e4m3 with a bfloat16 out) and device, k, v and out of q's dtype (out's as
// said) and device, a supported head dim, and heads_kv dividing heads_q.
struct AttentionHeads {
  int64_t head_dim, heads_q, heads_kv;
};
struct NamedView {
  const TensorView* view;
  const char* name;
};
AttentionHeads check_attention_tensors(const TensorView& q, NamedView k, NamedView v, const TensorView& out, int rank,
                                       const char* q_layout, const char* kv_layout, bool takes_fp8) {
  check_rank(q, "q", rank, q_layout);
  check_rank(*k.view, k.name, rank, kv_layout);
  check_rank(*v.view, v.name, rank, kv_layout);
  check_rank(out, "out", rank, q_layout);
  const bool fp8 = q.dtype == ScalarType::float8_e4m3;
  if (fp8 && !takes_fp8)
    throw bad("q: float8_e4m3 runs in forward() and forward_varlen() only (FP8 is forward-only: use bfloat16 here)");
  if (q.dtype != ScalarType::float16 && q.dtype != ScalarType::bfloat16 && !fp8)
    throw bad(fmt::format("q: expected dtype {}, got {}", takes_fp8 ? "float16, bfloat16 or float8_e4m3" : "float16 or bfloat16",
                          to_string(q.dtype)));
  check_same(q, "q", *k.view, k.name);
  check_same(q, "q", *v.view, v.name);
  if (fp8) {
    if (out.dtype != ScalarType::bfloat16)
      throw bad(fmt::format("out: expected dtype bfloat16 for float8_e4m3 inputs, got {}", to_string(out.dtype)));
    if (out.device != q.device)
      throw bad(fmt::format("out: on device {}, but q is on device {}", out.device, q.device));
  } else {
    check_same(q, "q", out, "out");
  }
  if (q.device < 0) throw bad(fmt::format("q: device {} is not a CUDA device ordinal", q.device));
  const AttentionHeads h{q.shape[rank - 1], q.shape[rank - 2], k.view->shape[rank - 2]};
  if (h.head_dim > kMaxHeadDim || h.head_dim % 8 != 0 || h.head_dim == 0)
    throw bad(fmt::format("q: head_dim {} is not supported (expected a multiple of 8, at most {})", h.head_dim,
                          kMaxHeadDim));
  if (h.heads_kv == 0 ? h.heads_q != 0 : h.heads_q % h.heads_kv != 0)  // (no heads at all: an empty problem)
    throw bad(fmt::format("{}: heads_kv {} must divide heads_q {} (GQA/MQA)", k.name, h.heads_kv, h.heads_q));
  return h;
}

// The LSE output of a problem whose q is `q` (p.is_varlen set): float32, (heads_q, total_q) when
// varlen, else (batch, heads_q, seqlen_q), rows contiguous.
void bind_lse(ForwardProblem& p, const TensorView& lse, const TensorView& q) {
  AttentionFwdParams& a = p.params;
  const int64_t heads_q = q.shape[q.rank - 2];
  if (lse.dtype != ScalarType::float32)
    throw bad(fmt::format("lse: expected dtype float32, got {}", to_string(lse.dtype)));
  if (lse.device != q.device)
    throw bad(fmt::format("lse: on device {}, but q is on device {}", lse.device, q.device));
  if (p.is_varlen) {
    check_shape(lse, "lse", {heads_q, q.shape[0]}, "(heads_q, total_q)");
    a.lse_batch_stride = 0;
    a.lse_head_stride = lse.strides[0];
  } else {
    check_shape(lse, "lse", {q.shape[0], heads_q, q.shape[1]}, "(batch, heads_q, seqlen_q)");
    a.lse_batch_stride = lse.strides[0];
    a.lse_head_stride = lse.strides[1];
  }
  if (lse.strides[lse.rank - 1] != 1 && lse.shape[lse.rank - 1] > 1)
    throw bad(fmt::format("lse: rows must be contiguous (last stride 1), got stride {}", lse.strides[lse.rank - 1]));
  if (reinterpret_cast<uintptr_t>(lse.data) % 4 != 0)
    throw bad(fmt::format("lse: data pointer {} is not 4-byte aligned", lse.data));
  a.lse = static_cast<float*>(lse.data);
}

// The options' mask, scale, softcap and launch fields into `p` (its head_dim and sequence lengths
// already set).
void apply_options(ForwardProblem& p, const AttentionOptions& options) {
  if (options.window_left < -1 || options.window_right < -1)
    throw bad(fmt::format("window_size ({}, {}): each side must be -1 (unbounded) or >= 0",
                          options.window_left, options.window_right));
  if (!(options.softcap >= 0.f) || std::isinf(options.softcap))
    throw bad(fmt::format("softcap must be finite and >= 0, got {}", options.softcap));
  const float scale = options.softmax_scale.value_or(1.f / std::sqrt(static_cast<float>(p.head_dim)));
  // (The kernels take each row's max of the raw scores as the softmax's stabiliser: with a
  // negative scale that is the wrong end, and exp2 overflows.)
  if (!(scale > 0.f) || !std::isfinite(scale))
    throw bad(fmt::format("softmax_scale must be positive and finite, got {}", scale));

  int window_left = options.window_left, window_right = options.window_right;
  if (options.causal) window_right = 0;
  // A side that reaches past both sequences bounds nothing (flash-attn takes one >= seqlen_k as
  // unbounded): -1, so that a huge one (INT_MAX for "no window") neither overflows the kernels' int
  // sums (row + diagonal + window) nor picks a masked kernel.
  const int64_t reach = int64_t{p.seqlen_q} + p.seqlen_k;
  if (window_left > reach) window_left = -1;
  if (window_right > reach) window_right = -1;
  if (window_left >= 0 || window_right >= 0)
    p.mask = window_left < 0 && window_right == 0 ? MaskKind::causal : MaskKind::window;
  p.has_softcap = options.softcap > 0.f;
  if (options.sm_margin < 0)
    throw bad(fmt::format("sm_margin must be >= 0 (SMs to leave free), got {}", options.sm_margin));
  p.backend = options.backend;
  p.sm_margin = options.sm_margin;
  if (options.num_splits < 0)
    throw bad(fmt::format("num_splits must be >= 0 (0: chosen, 1: no split), got {}", options.num_splits));
  p.num_splits = options.num_splits;
  p.prepare_backward = options.prepare_backward;
  p.deterministic_backward = options.deterministic;
  p.forced_kernel = options.kernel;
  p.stream = options.stream;

  AttentionFwdParams& a = p.params;
  a.window_left = p.mask == MaskKind::none ? -1 : window_left;
  a.window_right = p.mask == MaskKind::none ? -1 : window_right;
  a.softmax_scale = scale;
  a.softcap = options.softcap;
}

// options.q_descale, k_descale, v_descale: float32 (batch, heads_kv), FP8 inputs only.
void bind_descales(ForwardProblem& p, const AttentionOptions& options, const TensorView& q) {
  struct Binding {
    const TensorView* view;
    Fp8Descale* descale;
    const char* name;
  };
  for (const auto& [view, descale, name] : {Binding{options.q_descale, &p.q_descale, "q_descale"},
                                             Binding{options.k_descale, &p.k_descale, "k_descale"},
                                             Binding{options.v_descale, &p.v_descale, "v_descale"}}) {
    *descale = {};
    if (view == nullptr) continue;
    if (p.dtype != DType::e4m3)
      throw bad(fmt::format("{}: given for {} inputs; descale factors apply to float8_e4m3 q, k and v", name,
                            to_string(q.dtype)));
    check_rank(*view, name, 2, "(batch, heads_kv)");
    check_shape(*view, name, {p.batch, p.heads_kv}, "(batch, heads_kv)");
    if (view->dtype != ScalarType::float32)
      throw bad(fmt::format("{}: expected dtype float32, got {}", name, to_string(view->dtype)));
    if (view->device != q.device)
      throw bad(fmt::format("{}: on device {}, but q is on device {}", name, view->device, q.device));
    if (view->strides[0] < 0 || view->strides[1] < 0)
      throw bad(fmt::format("{}: strides must be >= 0, got ({}, {})", name, view->strides[0], view->strides[1]));
    if (reinterpret_cast<uintptr_t>(view->data) % 4 != 0)
      throw bad(fmt::format("{}: data pointer {} is not 4-byte aligned", name, view->data));
    *descale = {static_cast<const float*>(view->data), view->strides[0], view->strides[1]};
  }
}

// options.continuation: the running O beside the running LSE (the lse argument), row for row.
void bind_continuation(ForwardProblem& p, const ForwardContinuation& c, const TensorView* lse, const TensorView& q) {
  if (lse == nullptr)
    throw bad(p.is_varlen ? "continuation: lse is required (the running logsumexp, float32 (heads_q, total_q))"
                          : "continuation: lse is required (the running logsumexp, float32 (batch, heads_q, seqlen_q))");
  const TensorView& state = c.o_state;
  if (state.data == nullptr) throw bad("continuation.o_state: data pointer is null");
  if (state.dtype != ScalarType::float32)
    throw bad(fmt::format("continuation.o_state: expected dtype float32, got {}", to_string(state.dtype)));
  if (state.device != q.device)
    throw bad(fmt::format("continuation.o_state: on device {}, but q is on device {}", state.device, q.device));
  // Laid out as the LSE, head_dim floats per entry: its strides times head_dim, then 1.
  const int64_t d = p.head_dim;
  std::vector<int64_t> expected;
  if (p.is_varlen) {
    check_shape(state, "continuation.o_state", {p.heads_q, q.shape[0], p.head_dim}, "(heads_q, total_q, head_dim)");
    expected = {lse->strides[0] * d, lse->strides[1] * d, 1};
  } else {
    check_shape(state, "continuation.o_state", {q.shape[0], p.heads_q, q.shape[1], p.head_dim},
                "(batch, heads_q, seqlen_q, head_dim)");
    expected = {lse->strides[0] * d, lse->strides[1] * d, lse->strides[2] * d, 1};
  }
  for (int i = 0; i < state.rank; ++i)
    if (state.strides[i] != expected[i] && state.shape[i] > 1)
      throw bad(fmt::format("continuation.o_state: strides ({}) must be lse's times head_dim, then 1: ({})",
                            fmt::join(state.strides, state.strides + state.rank, ", "), fmt::join(expected, ", ")));
  if (reinterpret_cast<uintptr_t>(state.data) % 8 != 0)
    throw bad(fmt::format("continuation.o_state: data pointer {} is not 8-byte aligned", state.data));
  p.continues = true;
  p.params.state_o = static_cast<float*>(state.data);
  p.params.state_read = c.has_state ? 1 : 0;
  if (c.final_begin < 0 || c.final_rows < 0 || c.final_begin + c.final_rows > p.seqlen_q)
    throw bad(fmt::format("continuation: final rows [{}, {}) are outside 0 .. {} {}", c.final_begin,
                          c.final_begin + c.final_rows, p.is_varlen ? "max_seqlen_q" : "seqlen_q", p.seqlen_q));
  p.params.state_final_begin = static_cast<int>(c.final_begin);
  p.params.state_final_end = static_cast<int>(c.final_begin + c.final_rows);
}

// options.backward_continuation: fp32 running gradients shaped like q, k and v.
void bind_backward_continuation(BackwardProblem& b, const BackwardContinuation& c, const TensorView& q,
                                const TensorView& k, const AttentionOptions& options) {
  if (options.deterministic) throw bad("backward_continuation: atomic dQ only (deterministic is fa2_bwd's)");
  auto state = [&](const TensorView& t, const char* name, const TensorView& like) {
    if (t.data == nullptr) throw bad(fmt::format("backward_continuation.{}: data pointer is null", name));
    if (t.dtype != ScalarType::float32)
      throw bad(fmt::format("backward_continuation.{}: expected dtype float32, got {}", name, to_string(t.dtype)));
    if (t.device != q.device)
      throw bad(fmt::format("backward_continuation.{}: on device {}, but q is on device {}", name, t.device, q.device));
    check_rank(t, name, like.rank, "(the shape of the tensor it sums the gradient of)");
    for (int d = 0; d < like.rank; ++d)
      if (t.shape[d] != like.shape[d])
        throw bad(fmt::format("backward_continuation.{}: shape {} differs from {}", name, shape_text(t), shape_text(like)));
    // (dQ's row pass reads and writes it 16 bytes at a time)
    bool aligned = t.strides[t.rank - 1] == 1 && reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
    for (int d = 0; d + 1 < t.rank; ++d) aligned = aligned && t.strides[d] % 4 == 0;
    if (!aligned)
      throw bad(fmt::format("backward_continuation.{}: needs the last dim contiguous, the other strides multiples of "
                            "4 and a 16-byte aligned base", name));
  };
  state(c.dq_state, "dq_state", q);
  state(c.dk_state, "dk_state", k);
  state(c.dv_state, "dv_state", k);
  for (int d = 0; d < k.rank; ++d)
    if (c.dv_state.strides[d] != c.dk_state.strides[d])
      throw bad("backward_continuation: dv_state must have dk_state's strides");
  b.forward.continues = true;
  AttentionBwdParams& a = b.params;
  a.dq_state = static_cast<float*>(c.dq_state.data);
  a.dk_state = static_cast<float*>(c.dk_state.data);
  a.dv_state = static_cast<float*>(c.dv_state.data);
  // (varlen: (total rows, heads, head_dim), no batch stride)
  const int s = b.forward.is_varlen ? 0 : 1;
  a.dq_state_batch_stride = s ? c.dq_state.strides[0] : 0;
  a.dq_state_row_stride = c.dq_state.strides[s];
  a.dq_state_head_stride = c.dq_state.strides[s + 1];
  a.dkv_state_batch_stride = s ? c.dk_state.strides[0] : 0;
  a.dkv_state_row_stride = c.dk_state.strides[s];
  a.dkv_state_head_stride = c.dk_state.strides[s + 1];
  a.gradients_final = c.final ? 1 : 0;
}

ScalarType scalar_type(ModifierTensorType t) {
  switch (t) {
    case ModifierTensorType::int32: return ScalarType::int32;
    case ModifierTensorType::int64: return ScalarType::int64;
    case ModifierTensorType::float32: return ScalarType::float32;
  }
  return ScalarType::int32;
}

// options.mod: its code (validated) and side tensors, one per declared name, of its type, on q's
// device, contiguous.
void bind_modifier(ForwardProblem& p, const AttentionMod& mod, int device) {
  if (mod.code == nullptr) throw bad("mod: has no code (mod.code is null)");
  if (auto reason = mod.code->validate()) throw bad(fmt::format("mod: {}", *reason));
  const auto& declared = mod.code->tensors;
  if (mod.tensors.size() != declared.size())
    throw bad(fmt::format("mod: the code reads {} side tensors, {} were given", declared.size(), mod.tensors.size()));
  for (size_t i = 0; i < declared.size(); ++i) {
    const TensorView& t = mod.tensors[i];
    const std::string name = "mod tensor '" + declared[i].name + "'";
    if (t.data == nullptr && t.numel() > 0) throw bad(fmt::format("{}: data pointer is null", name));
    if (t.dtype != scalar_type(declared[i].type))
      throw bad(fmt::format("{}: expected dtype {}, got {}", name, to_string(scalar_type(declared[i].type)),
                            to_string(t.dtype)));
    if (t.device != device) throw bad(fmt::format("{}: on device {}, but q is on device {}", name, t.device, device));
    int64_t stride = 1;
    for (int d = t.rank - 1; d >= 0; --d) {
      if (t.shape[d] > 1 && t.strides[d] != stride)
        throw bad(fmt::format("{}: must be contiguous (it is read as a flat array), got shape {} with strides ({})", name,
                              shape_text(t), fmt::join(t.strides, t.strides + t.rank, ", ")));
      stride *= t.shape[d];
    }
    if (reinterpret_cast<uintptr_t>(t.data) % element_size(t.dtype) != 0)
      throw bad(fmt::format("{}: data pointer {} is not aligned to its {}-byte elements", name, t.data,
                            element_size(t.dtype)));
    p.params.modifier_tensors[i] = t.data;
  }
  p.modifier = mod.code;
}

// One side of a block mask (BlockSparseParams): counts (batch, heads, rows) and lists (batch,
// heads, rows, capacity), int32 on q's device, checked against the problem's batch and heads.
struct BlockMaskSide {
  const TensorView* num_blocks;
  const TensorView* indices;
  const TensorView* full_num_blocks;  // may be null (with full_indices)
  const TensorView* full_indices;
  const char* names[4];     // the four arrays' names, for errors
  const char* rows_dim;     // the rows' dim: "q_blocks" or "kv_blocks"
  const char* rows;         // and in words: "query blocks" or "key blocks"
  const char* length_name;  // the length they cover: "seqlen_q" or "seqlen_k"
  int64_t length;
  int64_t row_count;
  int row_block_size, column_block_size;
  int64_t column_blocks;
};

void bind_block_mask_side(BlockSparseParams& b, const BlockMaskSide& side, const ForwardProblem& p, int device) {
  auto check = [&](const TensorView& t, const char* name, int rank) {
    const std::string where = fmt::format("block_mask.{}", name);
    const std::string dims = fmt::format(rank == 3 ? "(batch, heads, {})" : "(batch, heads, {}, capacity)", side.rows_dim);
    check_rank(t, where.c_str(), rank, dims.c_str());
    if (t.dtype != ScalarType::int32) throw bad(fmt::format("{}: expected dtype int32, got {}", where, to_string(t.dtype)));
    if (t.device != device) throw bad(fmt::format("{}: on device {}, but q is on device {}", where, t.device, device));
    if (t.shape[0] != 1 && t.shape[0] != p.batch)
      throw bad(fmt::format("{}: batch extent {} must be 1 or the batch {}", where, t.shape[0], p.batch));
    if (t.shape[1] != 1 && t.shape[1] != p.heads_q)
      throw bad(fmt::format("{}: heads extent {} must be 1 or heads_q {}", where, t.shape[1], p.heads_q));
    if (t.shape[2] != side.row_count)
      throw bad(fmt::format("{}: {} {}, but {} {} in blocks of {} makes {}", where, t.shape[2], side.rows,
                            side.length_name, side.length, side.row_block_size, side.row_count));
    if (t.strides[rank - 1] != 1 && t.shape[rank - 1] > 1)
      throw bad(fmt::format("{}: the last dim must be contiguous (stride 1), got stride {}", where, t.strides[rank - 1]));
    if (reinterpret_cast<uintptr_t>(t.data) % 4 != 0) throw bad(fmt::format("{}: data pointer is not 4-byte aligned", where));
  };
  // A dim of extent 1 is shared by every batch entry or head: stride 0.
  auto stride = [](const TensorView& t, int d) -> long long { return t.shape[d] == 1 ? 0 : t.strides[d]; };
  // The kernels address a row's list by a 32-bit element offset.
  auto reach = [](const TensorView& t) {
    int64_t last = 0;
    for (int d = 0; d < t.rank; ++d) last += (t.shape[d] - 1) * t.strides[d];
    return last;
  };
  const TensorView& num = *side.num_blocks;
  const TensorView& indices = *side.indices;
  check(num, side.names[0], 3);
  check(indices, side.names[1], 4);
  if ((side.full_num_blocks == nullptr) != (side.full_indices == nullptr))
    throw bad(fmt::format("block_mask: {} and {} come together (both or neither)", side.names[2], side.names[3]));
  b.num_blocks = static_cast<const int*>(num.data);
  b.indices = static_cast<const int*>(indices.data);
  b.num_batch_stride = stride(num, 0);
  b.num_head_stride = stride(num, 1);
  b.indices_batch_stride = stride(indices, 0);
  b.indices_head_stride = stride(indices, 1);
  b.indices_row_stride = indices.strides[2];
  b.list_capacity = to_int(indices.shape[3], "block_mask list capacity");
  for (const TensorView* t : {side.indices, side.full_indices})
    if (t != nullptr && reach(*t) >= (int64_t(1) << 31))
      throw bad("block_mask: an index list spans 2^31 elements or more");
  if (side.full_num_blocks != nullptr) {
    const TensorView& full_num = *side.full_num_blocks;
    const TensorView& full_indices = *side.full_indices;
    check(full_num, side.names[2], 3);
    check(full_indices, side.names[3], 4);
    if (full_indices.shape[3] != indices.shape[3])
      throw bad(fmt::format("block_mask.{}: list capacity {} differs from {}'s {}", side.names[3], full_indices.shape[3],
                            side.names[1], indices.shape[3]));
    b.full_num_blocks = static_cast<const int*>(full_num.data);
    b.full_indices = static_cast<const int*>(full_indices.data);
    b.full_num_batch_stride = stride(full_num, 0);
    b.full_num_head_stride = stride(full_num, 1);
    b.full_indices_batch_stride = stride(full_indices, 0);
    b.full_indices_head_stride = stride(full_indices, 1);
    b.full_indices_row_stride = full_indices.strides[2];
  }
  b.row_block_size = side.row_block_size;
  b.column_block_size = side.column_block_size;
  b.num_column_blocks = to_int(side.column_blocks, "block_mask column blocks");
}

// options.block_mask: FlexAttention's arrays, checked against the problem's batch, heads and
// lengths (the kernel's tile sizes are checked where the spec is known). The lists by query block
// go to the forward's parameters; the backward binds the transposed ones (bind_transposed_block_mask).
void bind_block_mask(ForwardProblem& p, const BlockMask& mask, int device) {
  if (p.is_varlen) throw bad("block_mask: not with a varlen batch (a block mask's rows are one sequence's blocks)");
  if (p.mask != MaskKind::none)
    throw bad("block_mask: replaces causal and window_size; write them into the block mask and the mask modifier");
  if (mask.q_block_size <= 0 || mask.kv_block_size <= 0)
    throw bad(fmt::format("block_mask: block sizes must be positive, got ({}, {})", mask.q_block_size, mask.kv_block_size));
  const int64_t q_blocks = (p.seqlen_q + mask.q_block_size - 1) / mask.q_block_size;
  const int64_t kv_blocks = (p.seqlen_k + mask.kv_block_size - 1) / mask.kv_block_size;
  bind_block_mask_side(p.params.block_mask,
                       {&mask.kv_num_blocks, &mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
                        {"kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"}, "q_blocks",
                        "query blocks", "seqlen_q", p.seqlen_q, q_blocks,
                        mask.q_block_size, mask.kv_block_size, kv_blocks},
                       p, device);
  p.block_sparse = true;
}

void bind_transposed_block_mask(BlockSparseParams& b, const ForwardProblem& p, const BlockMask& mask, int device) {
  if (mask.q_num_blocks == nullptr || mask.q_indices == nullptr)
    throw bad("block_mask: the backward walks the mask by key block and needs its transposed lists q_num_blocks and "
              "q_indices (and full_q_num_blocks, full_q_indices where the forward has full lists); create_block_mask "
              "builds them, and FlexAttention's BlockMask carries them");
  if ((mask.full_kv_num_blocks == nullptr) != (mask.full_q_num_blocks == nullptr))
    throw bad("block_mask: full_q_num_blocks and full_q_indices must be given exactly when full_kv_num_blocks and "
              "full_kv_indices are (the backward would see a different mask)");
  const int64_t q_blocks = (p.seqlen_q + mask.q_block_size - 1) / mask.q_block_size;
  const int64_t kv_blocks = (p.seqlen_k + mask.kv_block_size - 1) / mask.kv_block_size;
  bind_block_mask_side(b,
                       {mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices,
                        {"q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"}, "kv_blocks",
                        "key blocks", "seqlen_k", p.seqlen_k, kv_blocks,
                        mask.kv_block_size, mask.q_block_size, q_blocks},
                       p, device);
}

}  // namespace

namespace {

// Allocations already seen, by address range. One cuPointerGetAttribute costs about a microsecond,
// and a call checks up to seven tensors; frameworks reuse their allocations, so after the first
// call a check is a map lookup. Bounded: cleared when it grows past kMaxRanges.
class AllocationRanges {
 public:
  struct Range {
    uintptr_t begin = 0, end = 0;
    int device = -1;
  };

  std::optional<Range> find(uintptr_t address) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = ranges_.upper_bound(address);
    if (it == ranges_.begin()) return std::nullopt;
    --it;
    if (address >= it->second.end) return std::nullopt;
    return it->second;
  }

  void add(const Range& r) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (ranges_.size() >= kMaxRanges) ranges_.clear();
    ranges_[r.begin] = r;
  }

 private:
  static constexpr size_t kMaxRanges = 4096;
  std::mutex mutex_;
  std::map<uintptr_t, Range> ranges_;
};

AllocationRanges& allocation_ranges() {
  static AllocationRanges ranges;
  return ranges;
}

// Bytes from data to one past the last element the view can address.
uint64_t view_extent_bytes(const TensorView& view) {
  uint64_t last = 0;
  for (int d = 0; d < view.rank; ++d) {
    if (view.shape[d] == 0) return 0;
    last += static_cast<uint64_t>(view.shape[d] - 1) * static_cast<uint64_t>(view.strides[d]);
  }
  return (last + 1) * element_size(view.dtype);
}

}  // namespace

void check_device_pointer(const TensorView& view, const char* name) {
  if (view.numel() == 0) return;  // nothing is read or written through it
  const auto address = reinterpret_cast<uintptr_t>(view.data);
  const uint64_t extent = view_extent_bytes(view);
  auto fits = [&](const AllocationRanges::Range& r) {
    return r.device == view.device && extent <= r.end - address;
  };
  // A remembered range that fits is trusted; one that does not may be stale (freed and
  // reallocated differently), so the driver is asked again before anything is reported.
  if (auto cached = allocation_ranges().find(address); cached && fits(*cached)) return;

  const DriverApi& api = driver();
  CUdeviceptr base = 0;
  size_t size = 0;
  int ordinal = -1;
  const auto pointer = static_cast<CUdeviceptr>(address);
  if (api.cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, pointer) != CUDA_SUCCESS ||
      api.cuPointerGetAttribute(&base, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, pointer) != CUDA_SUCCESS ||
      api.cuPointerGetAttribute(&size, CU_POINTER_ATTRIBUTE_RANGE_SIZE, pointer) != CUDA_SUCCESS)
    throw bad(fmt::format("{}: {} is not CUDA device memory", name, view.data));
  const AllocationRanges::Range range{static_cast<uintptr_t>(base), static_cast<uintptr_t>(base) + size, ordinal};
  allocation_ranges().add(range);
  if (range.device != view.device)
    throw bad(fmt::format("{}: memory is on device {}, but the view says device {}", name,
                          range.device, view.device));
  if (!fits(range))
    throw bad(fmt::format("{}: shape {} with strides ({}) reaches {} bytes past the end of its "
                          "allocation", name, shape_text(view),
                          fmt::join(view.strides, view.strides + view.rank, ", "),
                          extent - (range.end - address)));
}

void check_cu_seqlens(const ForwardProblem& problem, const VarlenBatch& batch, int64_t total_q,
                      int64_t total_k) {
  const auto stream = static_cast<CUstream>(problem.stream);
  auto read_back = [&](const TensorView& view) {
    std::vector<int> host(static_cast<size_t>(view.shape[0]));
    FLASHJIT_CU(cuMemcpyDtoHAsync, host.data(), reinterpret_cast<CUdeviceptr>(view.data),
                host.size() * sizeof(int), stream);
    return host;
  };
  const std::vector<int> cu_q = read_back(batch.cu_seqlens_q), cu_k = read_back(batch.cu_seqlens_k);
  const std::vector<int> used_q = batch.seqused_q.data != nullptr ? read_back(batch.seqused_q) : std::vector<int>{};
  const std::vector<int> used_k = batch.seqused_k.data != nullptr ? read_back(batch.seqused_k) : std::vector<int>{};
  FLASHJIT_CU(cuStreamSynchronize, stream);
  auto check = [&](const std::vector<int>& cu, const std::vector<int>& used, const char* name, const char* used_name,
                   int64_t total, int max_seqlen, const char* max_name) {
    if (cu[0] != 0) throw bad(fmt::format("{}[0] is {}, expected 0", name, cu[0]));
    for (size_t b = 1; b < cu.size(); ++b) {
      const int64_t length = int64_t(cu[b]) - cu[b - 1];
      if (length < 0)
        throw bad(fmt::format("{} is not monotone: entry {} is {} after {}", name, b, cu[b], cu[b - 1]));
      if (!used.empty() && (used[b - 1] < 0 || used[b - 1] > length))
        throw bad(fmt::format("{}: sequence {} uses {} rows of the {} that {} gives it", used_name, b - 1,
                              used[b - 1], length, name));
      const int64_t rows = used.empty() ? length : used[b - 1];
      if (rows > max_seqlen)
        throw bad(fmt::format("{}: sequence {} has {} rows, more than {} = {}", name, b - 1, rows,
                              max_name, max_seqlen));
    }
    if (cu.back() > total)
      throw bad(fmt::format("{} ends at {}, past the {} packed rows", name, cu.back(), total));
  };
  check(cu_q, used_q, "cu_seqlens_q", "seqused_q", total_q, batch.max_seqlen_q, "max_seqlen_q");
  check(cu_k, used_k, "cu_seqlens_k", "seqused_k", total_k, batch.max_seqlen_k, "max_seqlen_k");
}

ForwardProblem make_forward_problem(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const TensorView& out, const TensorView* lse,
                                    const VarlenBatch* varlen, const AttentionOptions& options) {
  ForwardProblem p;
  p.is_varlen = varlen != nullptr;
  const int rank = p.is_varlen ? 3 : 4;
  const char* q_layout = p.is_varlen ? "(total_q, heads_q, head_dim)" : "(batch, seqlen_q, heads_q, head_dim)";
  const char* kv_layout = p.is_varlen ? "(total_k, heads_kv, head_dim)" : "(batch, seqlen_k, heads_kv, head_dim)";
  const auto [head_dim, heads_q, heads_kv] =
      check_attention_tensors(q, {&k, "k"}, {&v, "v"}, out, rank, q_layout, kv_layout, /*takes_fp8=*/true);
  if (p.is_varlen) {
    check_shape(k, "k", {k.shape[0], heads_kv, head_dim}, kv_layout);
    check_shape(v, "v", {k.shape[0], heads_kv, head_dim}, kv_layout);
  } else {
    check_shape(k, "k", {q.shape[0], k.shape[1], heads_kv, head_dim}, kv_layout);
    check_shape(v, "v", {q.shape[0], k.shape[1], heads_kv, head_dim}, kv_layout);
  }
  if (p.is_varlen)
    check_shape(out, "out", {q.shape[0], heads_q, head_dim}, q_layout);
  else
    check_shape(out, "out", {q.shape[0], q.shape[1], heads_q, head_dim}, q_layout);
  for (const auto& [view, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}})
    check_attention_layout(*view, name);

  p.dtype = q.dtype == ScalarType::float16 ? DType::fp16 : q.dtype == ScalarType::float8_e4m3 ? DType::e4m3 : DType::bf16;
  p.device = q.device;
  p.heads_q = to_int(heads_q, "heads_q");
  p.heads_kv = to_int(heads_kv, "heads_kv");
  p.head_dim = static_cast<int>(head_dim);

  AttentionFwdParams& a = p.params;
  if (p.is_varlen) {
    const auto& cq = varlen->cu_seqlens_q;
    const auto& ck = varlen->cu_seqlens_k;
    check_rank(cq, "cu_seqlens_q", 1, "(batch + 1)");
    check_rank(ck, "cu_seqlens_k", 1, "(batch + 1)");
    for (const auto& [view, name] : {std::pair{&cq, "cu_seqlens_q"}, {&ck, "cu_seqlens_k"}}) {
      if (view->dtype != ScalarType::int32)
        throw bad(fmt::format("{}: expected dtype int32, got {}", name, to_string(view->dtype)));
      if (view->strides[0] != 1 && view->shape[0] > 1)
        throw bad(fmt::format("{}: must be contiguous, got stride {}", name, view->strides[0]));
      if (view->device != q.device)
        throw bad(fmt::format("{}: on device {}, but q is on device {}", name, view->device, q.device));
      if (view->shape[0] < 1) throw bad(fmt::format("{}: needs at least one element", name));
    }
    if (cq.shape[0] != ck.shape[0])
      throw bad(fmt::format("cu_seqlens_k: {} entries, but cu_seqlens_q has {}", ck.shape[0], cq.shape[0]));
    for (const auto& [view, name] : {std::pair{&varlen->seqused_q, "seqused_q"}, {&varlen->seqused_k, "seqused_k"}}) {
      if (view->data == nullptr) continue;
      check_rank(*view, name, 1, "(batch)");
      if (view->dtype != ScalarType::int32)
        throw bad(fmt::format("{}: expected dtype int32, got {}", name, to_string(view->dtype)));
      if (view->shape[0] != cq.shape[0] - 1)
        throw bad(fmt::format("{}: {} entries, expected batch = {}", name, view->shape[0], cq.shape[0] - 1));
      if (view->strides[0] != 1 && view->shape[0] > 1)
        throw bad(fmt::format("{}: must be contiguous, got stride {}", name, view->strides[0]));
      if (view->device != q.device)
        throw bad(fmt::format("{}: on device {}, but q is on device {}", name, view->device, q.device));
    }
    if (varlen->max_seqlen_q < 0 || varlen->max_seqlen_k < 0)
      throw bad("max_seqlen_q and max_seqlen_k must be non-negative");
    if (varlen->max_seqlen_q > q.shape[0])
      throw bad(fmt::format("max_seqlen_q {} exceeds total_q {}", varlen->max_seqlen_q, q.shape[0]));
    if (varlen->max_seqlen_k > k.shape[0])
      throw bad(fmt::format("max_seqlen_k {} exceeds total_k {}", varlen->max_seqlen_k, k.shape[0]));
    p.batch = to_int(cq.shape[0] - 1, "batch");
    p.total_q = to_int(q.shape[0], "total_q");
    p.total_k = to_int(k.shape[0], "total_k");
    p.seqlen_q = varlen->max_seqlen_q;
    p.seqlen_k = varlen->max_seqlen_k;
    a.cu_seqlens_q = static_cast<const int*>(cq.data);
    a.cu_seqlens_k = static_cast<const int*>(ck.data);
    a.seqused_q = static_cast<const int*>(varlen->seqused_q.data);
    a.seqused_k = static_cast<const int*>(varlen->seqused_k.data);
    p.seqused = a.seqused_q != nullptr || a.seqused_k != nullptr;
  } else {
    p.batch = to_int(q.shape[0], "batch");
    p.seqlen_q = to_int(q.shape[1], "seqlen_q");
    p.seqlen_k = to_int(k.shape[1], "seqlen_k");
  }

  if (lse != nullptr) bind_lse(p, *lse, q);

  apply_options(p, options);
  if (options.mod != nullptr) bind_modifier(p, *options.mod, q.device);
  if (options.block_mask != nullptr) bind_block_mask(p, *options.block_mask, q.device);
  if (options.continuation != nullptr) bind_continuation(p, *options.continuation, lse, q);
  bind_descales(p, options, q);

  a.q = q.data;
  a.k = k.data;
  a.v = v.data;
  a.o = out.data;
  kernel_strides(q, p.is_varlen, a.q_batch_stride, a.q_row_stride, a.q_head_stride);
  kernel_strides(k, p.is_varlen, a.k_batch_stride, a.k_row_stride, a.k_head_stride);
  kernel_strides(v, p.is_varlen, a.v_batch_stride, a.v_row_stride, a.v_head_stride);
  kernel_strides(out, p.is_varlen, a.o_batch_stride, a.o_row_stride, a.o_head_stride);
  a.batch = p.batch;
  a.num_heads_q = p.heads_q;
  a.num_heads_kv = p.heads_kv;
  a.head_dim = p.head_dim;
  a.seqlen_q = p.seqlen_q;
  a.seqlen_k = p.seqlen_k;
  return p;
}

BlockMaskProblem make_block_mask_problem(const AttentionMod* mod, const TensorView* tile_map, int64_t batch,
                                         int64_t heads, int64_t seqlen_q, int64_t seqlen_k,
                                         const BlockMaskBuffers& out, void* stream) {
  BlockMaskProblem m;
  try {
    ForwardProblem& f = m.forward;
    if (batch < 0 || heads < 0 || seqlen_q < 0 || seqlen_k < 0)
      throw bad(fmt::format("batch, heads, seqlen_q and seqlen_k must be >= 0, got {}, {}, {}, {}", batch, heads,
                            seqlen_q, seqlen_k));
    if (out.q_block_size <= 0 || out.kv_block_size <= 0 || out.q_block_size > 4096 || out.kv_block_size > 4096)
      throw bad(fmt::format("block sizes must be 1 to 4096, got ({}, {})", out.q_block_size, out.kv_block_size));
    const int64_t q_blocks = (seqlen_q + out.q_block_size - 1) / out.q_block_size;
    const int64_t kv_blocks = (seqlen_k + out.kv_block_size - 1) / out.kv_block_size;
    if (batch * heads > 65535 || q_blocks > 65535)
      throw bad(fmt::format("batch x heads {} and query blocks {} must each be at most 65535", batch * heads, q_blocks));
    const int device = out.kv_num_blocks.device;
    auto output = [&](const TensorView& t, const char* name, std::initializer_list<int64_t> shape, const char* layout) {
      check_rank(t, name, static_cast<int>(shape.size()), layout);
      if (t.dtype != ScalarType::int32) throw bad(fmt::format("{}: expected dtype int32, got {}", name, to_string(t.dtype)));
      if (t.device != device)
        throw bad(fmt::format("{}: on device {}, but kv_num_blocks is on device {}", name, t.device, device));
      check_shape(t, name, shape, layout);
      int64_t stride = 1;
      for (int d = t.rank - 1; d >= 0; --d) {
        if (t.shape[d] > 1 && t.strides[d] != stride) throw bad(fmt::format("{}: must be contiguous", name));
        stride *= t.shape[d];
      }
      return static_cast<int*>(t.data);
    };
    const char* counts = "(batch, heads, blocks)";
    const char* lists = "(batch, heads, blocks, other side's blocks)";
    BlockMaskParams& p = m.params;
    p.kv_num_blocks = output(out.kv_num_blocks, "kv_num_blocks", {batch, heads, q_blocks}, counts);
    p.kv_indices = output(out.kv_indices, "kv_indices", {batch, heads, q_blocks, kv_blocks}, lists);
    p.full_kv_num_blocks = output(out.full_kv_num_blocks, "full_kv_num_blocks", {batch, heads, q_blocks}, counts);
    p.full_kv_indices = output(out.full_kv_indices, "full_kv_indices", {batch, heads, q_blocks, kv_blocks}, lists);
    if (out.q_num_blocks.data != nullptr) {
      p.q_num_blocks = output(out.q_num_blocks, "q_num_blocks", {batch, heads, kv_blocks}, counts);
      p.q_indices = output(out.q_indices, "q_indices", {batch, heads, kv_blocks, q_blocks}, lists);
      p.full_q_num_blocks = output(out.full_q_num_blocks, "full_q_num_blocks", {batch, heads, kv_blocks}, counts);
      p.full_q_indices = output(out.full_q_indices, "full_q_indices", {batch, heads, kv_blocks, q_blocks}, lists);
    }
    if (tile_map != nullptr) {
      check_rank(*tile_map, "tile_map", 4, "(batch, heads, q_blocks, kv_blocks)");
      if (tile_map->dtype != ScalarType::uint8)
        throw bad(fmt::format("tile_map: expected dtype uint8 (0 empty, 1 partial, 2 full), got {}", to_string(tile_map->dtype)));
      if (tile_map->device != device)
        throw bad(fmt::format("tile_map: on device {}, but kv_num_blocks is on device {}", tile_map->device, device));
      check_shape(*tile_map, "tile_map", {batch, heads, q_blocks, kv_blocks}, "(batch, heads, q_blocks, kv_blocks)");
      output(TensorView{tile_map->data, ScalarType::int32, device, 4,
                        {tile_map->shape[0], tile_map->shape[1], tile_map->shape[2], tile_map->shape[3]},
                        {tile_map->strides[0], tile_map->strides[1], tile_map->strides[2], tile_map->strides[3]}},
             "tile_map", {batch, heads, q_blocks, kv_blocks}, "(batch, heads, q_blocks, kv_blocks)");
      p.tile_map = static_cast<unsigned char*>(tile_map->data);
      m.has_tile_map = true;
    }
    f.device = device;
    f.stream = stream;
    f.batch = to_int(batch, "batch");
    f.heads_q = f.heads_kv = to_int(heads, "heads");
    f.seqlen_q = to_int(seqlen_q, "seqlen_q");
    f.seqlen_k = to_int(seqlen_k, "seqlen_k");
    if (mod != nullptr) bind_modifier(f, *mod, device);
    AttentionFwdParams& a = f.params;
    a.batch = f.batch;
    a.num_heads_q = a.num_heads_kv = f.heads_q;
    a.seqlen_q = f.seqlen_q;
    a.seqlen_k = f.seqlen_k;
    p.fwd = a;
    p.q_blocks = static_cast<int>(q_blocks);
    p.kv_blocks = to_int(kv_blocks, "key blocks");
    m.q_block_size = out.q_block_size;
    m.kv_block_size = out.kv_block_size;
  } catch (const Error& e) {
    if (e.code() != ErrorCode::invalid_argument) throw;
    throw Error(ErrorCode::invalid_argument, "create_block_mask", e.message());
  }
  return m;
}

KvCacheProblem make_kvcache_problem(const TensorView& q, const KvCache& cache, const TensorView& out,
                                    const TensorView* lse, const AttentionOptions& options) {
  KvCacheProblem c;
  try {
    const TensorView& kc = cache.k_cache;
    const TensorView& vc = cache.v_cache;
    c.is_paged = cache.block_table != nullptr;
    const char* q_layout = "(batch, seqlen_q, heads_q, head_dim)";
    const char* cache_layout = c.is_paged ? "(num_pages, page_size, heads_kv, head_dim)"
                                          : "(batch, seqlen_cache, heads_kv, head_dim)";
    const auto [head_dim, heads_q, heads_kv] =
        check_attention_tensors(q, {&kc, "k_cache"}, {&vc, "v_cache"}, out, 4, q_layout, cache_layout,
                                /*takes_fp8=*/false);
    const int64_t batch = q.shape[0];
    if (kc.shape[3] != head_dim)
      throw bad(fmt::format("k_cache: head_dim {} differs from q's {}", kc.shape[3], head_dim));
    check_shape(vc, "v_cache", {kc.shape[0], kc.shape[1], heads_kv, head_dim}, "(the shape of k_cache)");
    check_shape(out, "out", {batch, q.shape[1], heads_q, head_dim}, q_layout);
    for (const auto& [view, name] : {std::pair{&q, "q"}, {&kc, "k_cache"}, {&vc, "v_cache"}, {&out, "out"}})
      check_attention_layout(*view, name);

    AttentionKvCacheParams& a = c.params;
    auto int32_vector = [&](const TensorView& t, const char* name, int rank, const char* layout) {
      check_rank(t, name, rank, layout);
      if (t.dtype != ScalarType::int32) throw bad(fmt::format("{}: expected dtype int32, got {}", name, to_string(t.dtype)));
      if (t.device != q.device) throw bad(fmt::format("{}: on device {}, but q is on device {}", name, t.device, q.device));
      if (t.strides[rank - 1] != 1 && t.shape[rank - 1] > 1)
        throw bad(fmt::format("{}: the last dim must be contiguous (stride 1), got stride {}", name, t.strides[rank - 1]));
      if (reinterpret_cast<uintptr_t>(t.data) % 4 != 0) throw bad(fmt::format("{}: data pointer is not 4-byte aligned", name));
    };
    int64_t capacity = kc.shape[1];
    if (c.is_paged) {
      const TensorView& table = *cache.block_table;
      int32_vector(table, "block_table", 2, "(batch, max_pages_per_seq)");
      if (table.shape[0] != batch)
        throw bad(fmt::format("block_table: {} rows, but q has batch {}", table.shape[0], batch));
      if (kc.shape[0] == 0) throw bad("k_cache: a paged cache needs at least one page");
      if (kc.shape[1] == 0) throw bad("k_cache: page_size must be at least 1, got 0");
      capacity = table.shape[1] * kc.shape[1];
      a.block_table = static_cast<const int*>(table.data);
      a.block_table_batch_stride = table.strides[0];
      a.num_pages = to_int(kc.shape[0], "num_pages");
      a.page_size = to_int(kc.shape[1], "page_size");
      // Division by the page size as a multiply-high and a shift (round-up reciprocal, exact for
      // dividends below 2^31): shift = ceil(log2(page_size)), magic = ceil(2^(32 + shift) / page_size).
      int shift = 0;
      while ((int64_t(1) << shift) < a.page_size) ++shift;
      a.page_size_shift = shift;
      a.page_size_magic = a.page_size == 1 ? 0u
                                           : static_cast<unsigned>(((uint64_t(1) << (32 + shift)) + a.page_size - 1) /
                                                                   a.page_size - (uint64_t(1) << 32));
    } else {
      if (kc.shape[0] != batch)
        throw bad(fmt::format("k_cache: batch {} differs from q's {} (a contiguous cache holds one sequence per row; "
                              "pass block_table for a paged one)", kc.shape[0], batch));
      a.page_size = to_int(std::max<int64_t>(capacity, 1), "seqlen_cache");
      a.num_pages = to_int(batch, "batch");
    }
    a.capacity = to_int(capacity, "the cache's tokens per sequence");
    a.k_page_stride = kc.strides[0];
    a.v_page_stride = vc.strides[0];

    if (cache.cache_seqlens != nullptr) {
      int32_vector(*cache.cache_seqlens, "cache_seqlens", 1, "(batch)");
      if (cache.cache_seqlens->shape[0] != batch)
        throw bad(fmt::format("cache_seqlens: {} entries, but q has batch {}", cache.cache_seqlens->shape[0], batch));
      a.cache_seqlens = static_cast<const int*>(cache.cache_seqlens->data);
    }
    if ((cache.k_new == nullptr) != (cache.v_new == nullptr))
      throw bad(fmt::format("{} is given without {}: new tokens need both", cache.k_new ? "k" : "v", cache.k_new ? "v" : "k"));
    if (cache.k_new != nullptr) {
      const TensorView& kn = *cache.k_new;
      const TensorView& vn = *cache.v_new;
      if (cache.cache_seqlens == nullptr)
        throw bad("k, v: appending new tokens needs cache_seqlens (where each sequence's new tokens go)");
      check_rank(kn, "k", 4, "(batch, seqlen_new, heads_kv, head_dim)");
      check_same(q, "q", kn, "k");
      check_same(q, "q", vn, "v");
      check_shape(kn, "k", {batch, kn.shape[1], heads_kv, head_dim}, "(batch, seqlen_new, heads_kv, head_dim)");
      check_shape(vn, "v", {batch, kn.shape[1], heads_kv, head_dim}, "(the shape of k)");
      check_attention_layout(kn, "k");
      check_attention_layout(vn, "v");
      if (kn.shape[1] > capacity)
        throw bad(fmt::format("k: {} new tokens do not fit a cache of {} tokens per sequence", kn.shape[1], capacity));
      c.seqlen_new = to_int(kn.shape[1], "seqlen_new");
      a.k_new = kn.data;
      a.v_new = vn.data;
      kernel_strides(kn, false, a.k_new_batch_stride, a.k_new_row_stride, a.k_new_head_stride);
      kernel_strides(vn, false, a.v_new_batch_stride, a.v_new_row_stride, a.v_new_head_stride);
    }
    a.seqlen_new = c.seqlen_new;

    ForwardProblem& p = c.forward;
    p.dtype = q.dtype == ScalarType::float16 ? DType::fp16 : DType::bf16;
    p.device = q.device;
    p.batch = to_int(batch, "batch");
    p.seqlen_q = to_int(q.shape[1], "seqlen_q");
    p.seqlen_k = a.capacity;
    p.heads_q = to_int(heads_q, "heads_q");
    p.heads_kv = to_int(heads_kv, "heads_kv");
    p.head_dim = static_cast<int>(head_dim);
    if (p.batch > 65535) throw bad(fmt::format("batch {} exceeds the grid limit of 65535", p.batch));
    if (lse != nullptr) bind_lse(p, *lse, q);
    apply_options(p, options);
    if (options.mod != nullptr || options.block_mask != nullptr)
      throw bad("mod and block_mask: forward_kvcache does not take user modifiers or block masks yet");
    if (options.continuation != nullptr) throw bad("continuation: forward_kvcache does not continue running results");

    AttentionFwdParams& f = p.params;
    f.q = q.data;
    f.k = kc.data;
    f.v = vc.data;
    f.o = out.data;
    kernel_strides(q, false, f.q_batch_stride, f.q_row_stride, f.q_head_stride);
    kernel_strides(out, false, f.o_batch_stride, f.o_row_stride, f.o_head_stride);
    kernel_strides(kc, false, f.k_batch_stride, f.k_row_stride, f.k_head_stride);
    kernel_strides(vc, false, f.v_batch_stride, f.v_row_stride, f.v_head_stride);
    f.batch = p.batch;
    f.num_heads_q = p.heads_q;
    f.num_heads_kv = p.heads_kv;
    f.head_dim = p.head_dim;
    f.seqlen_q = p.seqlen_q;
    f.seqlen_k = p.seqlen_k;
    a.fwd = f;
  } catch (const Error& e) {
    if (e.code() != ErrorCode::invalid_argument) throw;
    throw Error(ErrorCode::invalid_argument, "forward_kvcache", e.message());
  }
  return c;
}

BackwardProblem make_backward_problem(const TensorView& q, const TensorView& k, const TensorView& v,
                                      const TensorView& out, const TensorView& dout, const TensorView* lse,
                                      const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                      const VarlenBatch* varlen, const AttentionOptions& options) {
  BackwardProblem b;
  try {
    if (lse == nullptr)
      throw bad("lse: the backward needs the forward's logsumexp (float32 (batch, heads_q, seqlen_q), or "
                "(heads_q, total_q) when varlen); it is missing");
    if (options.continuation != nullptr) throw bad("continuation: the forward's option; the backward takes the final O and LSE");
    if (q.dtype == ScalarType::float8_e4m3)
      throw bad("q: float8_e4m3 has no backward (FP8 is forward-only): run the forward and backward in bfloat16");
    b.forward = make_forward_problem(q, k, v, out, lse, varlen, options);
    if (options.block_mask != nullptr)
      bind_transposed_block_mask(b.params.transposed_block_mask, b.forward, *options.block_mask, q.device);
    const int rank = b.forward.is_varlen ? 3 : 4;
    // Each gradient must look like the tensor it belongs to: shape, dtype, device, layout rules.
    auto like = [&](const TensorView& grad, const char* grad_name, const TensorView& of, const char* of_name) {
      check_rank(grad, grad_name, rank, "(the shape of the tensor it is the gradient of)");
      check_same(of, of_name, grad, grad_name);
      for (int d = 0; d < rank; ++d)
        if (grad.shape[d] != of.shape[d])
          throw bad(fmt::format("{}: shape {} differs from {}'s {}", grad_name, shape_text(grad), of_name,
                                shape_text(of)));
      check_attention_layout(grad, grad_name);
    };
    like(dout, "dout", out, "out");
    like(dq, "dq", q, "q");
    like(dk, "dk", k, "k");
    like(dv, "dv", v, "v");
    if (options.backward_continuation != nullptr) bind_backward_continuation(b, *options.backward_continuation, q, k, options);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::invalid_argument) throw;
    throw Error(ErrorCode::invalid_argument, "backward", e.message());
  }

  const ForwardProblem& f = b.forward;
  b.deterministic = options.deterministic;
  AttentionBwdParams& a = b.params;
  a.fwd = f.params;
  a.d_o = dout.data;
  a.dq = dq.data;
  a.dk = dk.data;
  a.dv = dv.data;
  kernel_strides(dout, f.is_varlen, a.do_batch_stride, a.do_row_stride, a.do_head_stride);
  kernel_strides(dq, f.is_varlen, a.dq_batch_stride, a.dq_row_stride, a.dq_head_stride);
  kernel_strides(dk, f.is_varlen, a.dk_batch_stride, a.dk_row_stride, a.dk_head_stride);
  kernel_strides(dv, f.is_varlen, a.dv_batch_stride, a.dv_row_stride, a.dv_head_stride);
  a.workspace_rows = f.is_varlen ? to_int(q.shape[0], "total_q") : to_int(int64_t(f.batch) * f.seqlen_q, "batch x seqlen_q");
  return b;
}


std::vector<ProblemSlice> grid_slices(const ForwardProblem& p) {
  if (fits_one_grid(p)) return {{0, p.batch, 0, p.heads_kv}};
  if (p.modifier != nullptr || p.block_sparse || p.continues)
    throw bad(fmt::format("batch {} x heads {}: over {} sequences or heads a problem runs in slices, which a mod, a "
                          "block mask or a continuation (indexed by sequence and head) cannot follow",
                          p.batch, p.heads_q, kMaxGridBatch));
  const int group = p.heads_q / p.heads_kv;
  if (group > kMaxGridBatch)
    throw bad(fmt::format("q: {} query heads share one KV head; at most {} can", group, kMaxGridBatch));
  const int kv_heads_per_slice = std::min(p.heads_kv, kMaxGridBatch / group);
  std::vector<ProblemSlice> slices;
  for (int b = 0; b < p.batch; b += kMaxGridBatch)
    for (int h = 0; h < p.heads_kv; h += kv_heads_per_slice)
      slices.push_back({b, std::min(kMaxGridBatch, p.batch - b), h, std::min(kv_heads_per_slice, p.heads_kv - h)});
  return slices;
}

namespace {

// `base` moved by `elements` values of `element_bytes` bytes (16-bit, or FP8's q, k and v).
template <class Pointer>
Pointer advanced(Pointer base, long long elements, int element_bytes = 2) {
  if (base == nullptr) return base;
  using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Pointer>>, const char, char>;
  return reinterpret_cast<Pointer>(reinterpret_cast<Byte*>(base) + elements * element_bytes);
}

// Where a slice starts: its first sequence, query head and KV head.
struct SliceStart {
  long long batch, q_head, kv_head;
};

SliceStart slice_start(const ForwardProblem& p, const ProblemSlice& s) {
  const int group = p.heads_q / p.heads_kv;
  return {s.batch_begin, static_cast<long long>(s.kv_head_begin) * group, s.kv_head_begin};
}

}  // namespace

ForwardProblem slice_problem(const ForwardProblem& p, const ProblemSlice& s) {
  ForwardProblem part = p;
  AttentionFwdParams& a = part.params;
  const auto [b, hq, hk] = slice_start(p, s);
  // (Varlen batch strides are 0: its rows are addressed through cu_seqlens, which move instead.)
  const int input_bytes = element_bytes(p.dtype);  // (out is 16-bit)
  a.q = advanced(a.q, b * a.q_batch_stride + hq * a.q_head_stride, input_bytes);
  a.k = advanced(a.k, b * a.k_batch_stride + hk * a.k_head_stride, input_bytes);
  a.v = advanced(a.v, b * a.v_batch_stride + hk * a.v_head_stride, input_bytes);
  a.o = advanced(a.o, b * a.o_batch_stride + hq * a.o_head_stride);
  for (Fp8Descale* descale : {&part.q_descale, &part.k_descale, &part.v_descale})
    if (descale->data != nullptr) descale->data += b * descale->batch_stride + hk * descale->head_stride;
  if (a.lse != nullptr) a.lse += b * a.lse_batch_stride + hq * a.lse_head_stride;
  for (const int** lengths : {&a.cu_seqlens_q, &a.cu_seqlens_k, &a.seqused_q, &a.seqused_k})
    if (*lengths != nullptr) *lengths += b;
  part.batch = a.batch = s.batch_count;
  part.heads_kv = a.num_heads_kv = s.kv_head_count;
  part.heads_q = a.num_heads_q = s.kv_head_count * (p.heads_q / p.heads_kv);
  return part;
}

BackwardProblem slice_problem(const BackwardProblem& p, const ProblemSlice& s) {
  BackwardProblem part = p;
  part.forward = slice_problem(p.forward, s);
  AttentionBwdParams& a = part.params;
  a.fwd = part.forward.params;
  const auto [b, hq, hk] = slice_start(p.forward, s);
  a.d_o = advanced(a.d_o, b * a.do_batch_stride + hq * a.do_head_stride);
  a.dq = advanced(a.dq, b * a.dq_batch_stride + hq * a.dq_head_stride);
  a.dk = advanced(a.dk, b * a.dk_batch_stride + hk * a.dk_head_stride);
  a.dv = advanced(a.dv, b * a.dv_batch_stride + hk * a.dv_head_stride);
  if (!part.forward.is_varlen) a.workspace_rows = s.batch_count * part.forward.seqlen_q;  // (varlen: packed rows)
  return part;
}

}  // namespace detail
}  // namespace flashjit
