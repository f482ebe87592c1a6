// User modifiers and block masks, the device side: the Config::Modifiers codegen renders for a spec
// with a modifier or a block mask (or NoModifiers), the walk of a query tile's key tiles through a
// block mask's lists, and the element pass that applies a score modifier and a mask modifier to a
// score tile. Indices given to the user's functions are within the sequence, and only for elements
// inside it (q_idx < seqlen_q, kv_idx < seqlen_k), so a side tensor of the sequence's length is
// never read past its end.
#pragma once

#include "common/types.cuh"

// Bodies may hide an element by returning -INFINITY from the score function; NVRTC's headers do
// not define it.
#ifndef INFINITY
#define INFINITY (__int_as_float(0x7f800000))
#endif

namespace flashjit::kernels {

// The backward's derivative of a score modifier the user gave no gradient for: the score body
// is a template over the score's type, run on a dual number (value, derivative with respect to the
// score) carried through the arithmetic and the math functions below (forward-mode automatic
// differentiation: exact, not a finite difference). Own namespace: the overloads are found by
// argument-dependent lookup for dual arguments only, and never hide the float functions from the
// rest of the kernels. A body that turns the score into a float (`float t = score;`) does not
// compile this way; its user writes `auto` or gives the gradient body.
namespace score_autodiff {

struct ScoreDual {
  float value, derivative;
  __device__ __forceinline__ ScoreDual(float v, float d = 0.f) : value(v), derivative(d) {}  // NOLINT: constants convert
  __device__ __forceinline__ ScoreDual& operator+=(ScoreDual o) { return *this = ScoreDual(value + o.value, derivative + o.derivative); }
  __device__ __forceinline__ ScoreDual& operator-=(ScoreDual o) { return *this = ScoreDual(value - o.value, derivative - o.derivative); }
  __device__ __forceinline__ ScoreDual& operator*=(ScoreDual o) {
    return *this = ScoreDual(value * o.value, derivative * o.value + value * o.derivative);
  }
  __device__ __forceinline__ ScoreDual& operator/=(ScoreDual o) {
    return *this = ScoreDual(value / o.value, (derivative * o.value - value * o.derivative) / (o.value * o.value));
  }
};
__device__ __forceinline__ ScoreDual operator+(ScoreDual a) { return a; }
__device__ __forceinline__ ScoreDual operator-(ScoreDual a) { return ScoreDual(-a.value, -a.derivative); }
__device__ __forceinline__ ScoreDual operator+(ScoreDual a, ScoreDual b) { return a += b; }
__device__ __forceinline__ ScoreDual operator-(ScoreDual a, ScoreDual b) { return a -= b; }
__device__ __forceinline__ ScoreDual operator*(ScoreDual a, ScoreDual b) { return a *= b; }
__device__ __forceinline__ ScoreDual operator/(ScoreDual a, ScoreDual b) { return a /= b; }
__device__ __forceinline__ bool operator<(ScoreDual a, ScoreDual b) { return a.value < b.value; }
__device__ __forceinline__ bool operator>(ScoreDual a, ScoreDual b) { return a.value > b.value; }
__device__ __forceinline__ bool operator<=(ScoreDual a, ScoreDual b) { return a.value <= b.value; }
__device__ __forceinline__ bool operator>=(ScoreDual a, ScoreDual b) { return a.value >= b.value; }
__device__ __forceinline__ bool operator==(ScoreDual a, ScoreDual b) { return a.value == b.value; }
__device__ __forceinline__ bool operator!=(ScoreDual a, ScoreDual b) { return a.value != b.value; }

// f(a) with f'(a): the chain rule.
__device__ __forceinline__ ScoreDual chain(ScoreDual a, float f, float df) { return ScoreDual(f, df * a.derivative); }
__device__ __forceinline__ ScoreDual expf(ScoreDual a) { const float e = ::expf(a.value); return chain(a, e, e); }
__device__ __forceinline__ ScoreDual exp2f(ScoreDual a) {
  const float e = ::exp2f(a.value);
  return chain(a, e, e * 0.6931471805599453f);
}
__device__ __forceinline__ ScoreDual logf(ScoreDual a) { return chain(a, ::logf(a.value), 1.f / a.value); }
__device__ __forceinline__ ScoreDual log2f(ScoreDual a) { return chain(a, ::log2f(a.value), 1.4426950408889634f / a.value); }
__device__ __forceinline__ ScoreDual tanhf(ScoreDual a) { const float t = ::tanhf(a.value); return chain(a, t, 1.f - t * t); }
__device__ __forceinline__ ScoreDual sqrtf(ScoreDual a) { const float r = ::sqrtf(a.value); return chain(a, r, 0.5f / r); }
__device__ __forceinline__ ScoreDual rsqrtf(ScoreDual a) {
  const float r = ::rsqrtf(a.value);
  return chain(a, r, -0.5f * r * r * r);
}
__device__ __forceinline__ ScoreDual sinf(ScoreDual a) { return chain(a, ::sinf(a.value), ::cosf(a.value)); }
__device__ __forceinline__ ScoreDual cosf(ScoreDual a) { return chain(a, ::cosf(a.value), -::sinf(a.value)); }
__device__ __forceinline__ ScoreDual fabsf(ScoreDual a) { return a.value < 0.f ? -a : a; }
__device__ __forceinline__ ScoreDual powf(ScoreDual a, float e) {
  return chain(a, ::powf(a.value, e), e * ::powf(a.value, e - 1.f));
}
__device__ __forceinline__ ScoreDual fminf(ScoreDual a, ScoreDual b) { return b.value < a.value ? b : a; }
__device__ __forceinline__ ScoreDual fmaxf(ScoreDual a, ScoreDual b) { return b.value > a.value ? b : a; }
// The spellings without the f suffix, as CUDA's float overloads have them.
__device__ __forceinline__ ScoreDual exp(ScoreDual a) { return expf(a); }
__device__ __forceinline__ ScoreDual exp2(ScoreDual a) { return exp2f(a); }
__device__ __forceinline__ ScoreDual log(ScoreDual a) { return logf(a); }
__device__ __forceinline__ ScoreDual log2(ScoreDual a) { return log2f(a); }
__device__ __forceinline__ ScoreDual tanh(ScoreDual a) { return tanhf(a); }
__device__ __forceinline__ ScoreDual sqrt(ScoreDual a) { return sqrtf(a); }
__device__ __forceinline__ ScoreDual sin(ScoreDual a) { return sinf(a); }
__device__ __forceinline__ ScoreDual cos(ScoreDual a) { return cosf(a); }
__device__ __forceinline__ ScoreDual fabs(ScoreDual a) { return fabsf(a); }
__device__ __forceinline__ ScoreDual abs(ScoreDual a) { return fabsf(a); }
__device__ __forceinline__ ScoreDual pow(ScoreDual a, float e) { return powf(a, e); }
__device__ __forceinline__ ScoreDual fmin(ScoreDual a, ScoreDual b) { return fminf(a, b); }
__device__ __forceinline__ ScoreDual fmax(ScoreDual a, ScoreDual b) { return fmaxf(a, b); }
__device__ __forceinline__ ScoreDual min(ScoreDual a, ScoreDual b) { return fminf(a, b); }
__device__ __forceinline__ ScoreDual max(ScoreDual a, ScoreDual b) { return fmaxf(a, b); }

}  // namespace score_autodiff
using score_autodiff::ScoreDual;

struct NoModifiers {
  static constexpr bool kHasMask = false, kHasScore = false, kBlockSparse = false;
  static __device__ __forceinline__ bool mask(const AttentionFwdParams&, int, int, int, int) { return true; }
  static __device__ __forceinline__ float score(const AttentionFwdParams&, float s, int, int, int, int) { return s; }
  static __device__ __forceinline__ float score_and_gradient(const AttentionFwdParams&, float s, int, int, int, int,
                                                             float& gradient) {
    gradient = 1.f;
    return s;
  }
};
// Config::Modifiers where codegen rendered one, else NoModifiers.
template <class Config, class = void>
struct ModifiersOf {
  using type = NoModifiers;
};
template <class Config>
struct ModifiersOf<Config, typename VoidOf<typename Config::Modifiers>::type> {
  using type = typename Config::Modifiers;
};

// The tiles a CTA's row visits under one side of a block mask (BlockSparseParams: a query tile's
// key tiles in the forward, a key tile's query steps in the backward), as steps 0 .. count - 1: the
// row's fully visible blocks, then the partly visible ones, each block tiles_per_block kernel tiles
// in turn. sm90_fwd walks the steps from the last, so the partly visible tiles come first (where
// the built-in causal mask puts its diagonal tile), each list from its highest id.
struct SparseRow {
  // The row's lists as element offsets into indices and full_indices (32-bit, to spare the producer
  // thread's few registers: with 64-bit pointers it spilled).
  int partial_offset, full_offset;
  int full_steps, count;
};
// `row`: the row block (the CTA's tile lies in it: the kernel's tile divides row_block_size).
__device__ __forceinline__ SparseRow sparse_row(const BlockSparseParams& b, int batch, int head, int row) {
  auto clamped = [&](int n) { return min(max(n, 0), b.list_capacity); };
  SparseRow t;
  const int partial_blocks = clamped(__ldg(b.num_blocks + batch * b.num_batch_stride + head * b.num_head_stride + row));
  t.partial_offset = static_cast<int>(batch * b.indices_batch_stride + head * b.indices_head_stride + row * b.indices_row_stride);
  int full_blocks = 0;
  t.full_offset = 0;
  if (b.full_num_blocks != nullptr) {
    full_blocks = clamped(__ldg(b.full_num_blocks + batch * b.full_num_batch_stride + head * b.full_num_head_stride + row));
    t.full_offset = static_cast<int>(batch * b.full_indices_batch_stride + head * b.full_indices_head_stride +
                                     row * b.full_indices_row_stride);
  }
  t.full_steps = full_blocks * b.tiles_per_block;
  t.count = t.full_steps + partial_blocks * b.tiles_per_block;
  return t;
}
// Step `step`'s first index along the columns (a key in the forward, a query in the backward) and
// whether the mask modifier decides its elements. An id outside the column blocks yields a tile
// one block past their end, which the element mask hides whole.
struct SparseTile {
  int start;
  int partial;
};
template <int kTile>
__device__ __forceinline__ SparseTile sparse_tile(const BlockSparseParams& b, const SparseRow& t, int step) {
  const bool partial = step >= t.full_steps;
  const int within = partial ? step - t.full_steps : step;
  const int entry = within / b.tiles_per_block, sub = within - entry * b.tiles_per_block;
  const int id = __ldg(partial ? b.indices + t.partial_offset + entry : b.full_indices + t.full_offset + entry);
  if (id < 0 || id >= b.num_column_blocks) return {b.num_column_blocks * b.column_block_size, 1};
  return {id * b.column_block_size + sub * kTile, partial ? 1 : 0};
}

// One pass of the modifiers over a score tile in the mma.sync C layout (Shape::kMFrags m16 tiles of
// rows from thread_row0, kSFrags n8 tiles of keys from n0). kBounded: elements past the sequence
// are skipped by the user's functions and, with `hide`, become -inf; without it every element lies
// inside and the user's functions run unguarded on all of them, so that their loads of side tensors
// issue together and repeated ones (a row's doc[q_idx]) are loaded once. (Guarded element by
// element, each load sat in its own branch: a document mask's partly visible tile took seven times
// a full one's time at head dim 64.)
template <class Mods, class Shape, bool kBounded>
__device__ __forceinline__ void modify_scores_pass(float (&s)[Shape::kMFrags][Shape::kSFrags][4],
                                                   const AttentionFwdParams& p, int batch, int head, int seqlen_q,
                                                   int seqlen_k, int thread_row0, int n0, int lane, bool hide,
                                                   bool ask_mask) {
#pragma unroll
  for (int mi = 0; mi < Shape::kMFrags; ++mi)
#pragma unroll
    for (int ni = 0; ni < Shape::kSFrags; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = thread_row0 + mi * 16 + (e / 2) * 8;
        const int col = n0 + ni * 8 + (lane % 4) * 2 + e % 2;
        const bool inside = !kBounded || (row < seqlen_q && col < seqlen_k);
        if constexpr (Mods::kHasScore) {
          if (inside) s[mi][ni][e] = Mods::score(p, s[mi][ni][e] * p.softmax_scale, batch, head, row, col);
        }
        if (hide) {
          bool visible = inside;
          if constexpr (Mods::kHasMask) visible = visible && (!ask_mask || Mods::mask(p, batch, head, row, col));
          if (!visible) s[mi][ni][e] = -positive_infinity();
        }
      }
}

// The modifiers on one score tile, after q.k: with a score modifier every score becomes
// score(q.k * scale); with `hide`, elements past the sequence become -inf, and with `ask_mask` too
// those the mask modifier hides. Elements outside the sequence are never given to the user's
// functions. A warp whose elements all lie inside (every tile but the sequence's last) takes the
// unguarded pass, its flags fixed at compile time.
template <class Mods, class Shape>
__device__ __forceinline__ void modify_scores(float (&s)[Shape::kMFrags][Shape::kSFrags][4], const AttentionFwdParams& p,
                                              int batch, int head, int seqlen_q, int seqlen_k, int thread_row0, int n0,
                                              int lane, bool hide, bool ask_mask) {
  const int last_row = thread_row0 + (Shape::kMFrags - 1) * 16 + 8;
  const bool interior = __all_sync(0xffffffffu, last_row < seqlen_q) && n0 + Shape::kSFrags * 8 <= seqlen_k;
  if (!interior) {
    modify_scores_pass<Mods, Shape, /*kBounded=*/true>(s, p, batch, head, seqlen_q, seqlen_k, thread_row0, n0, lane,
                                                      hide, ask_mask);
  } else if (Mods::kHasMask && hide && ask_mask) {
    modify_scores_pass<Mods, Shape, false>(s, p, batch, head, seqlen_q, seqlen_k, thread_row0, n0, lane, true, true);
  } else if (Mods::kHasScore) {
    modify_scores_pass<Mods, Shape, false>(s, p, batch, head, seqlen_q, seqlen_k, thread_row0, n0, lane, false, false);
  }
}

}  // namespace flashjit::kernels
