// 16-bit (and FP8) element types as plain storage with PTX conversions (no toolkit headers under NVRTC),
// plus the warp-level helpers every family uses.
#pragma once

#include "common/params.cuh"

namespace flashjit::kernels {

enum class MaskKind { kNone, kCausal, kWindow };

template <class A, class B>
struct is_same {
  static constexpr bool value = false;
};
template <class A>
struct is_same<A, A> {
  static constexpr bool value = true;
};

struct half_t {
  unsigned short bits;
};
struct bfloat16_t {
  unsigned short bits;
};
// FP8 e4m3 (PyTorch's float8_e4m3fn), an sm90_fwd input type: converted only in pairs by PTX.
struct float8_e4m3_t {
  unsigned char bits;
};

__device__ __forceinline__ float to_float(half_t x) {
  float f;
  asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(x.bits));
  return f;
}
__device__ __forceinline__ float to_float(bfloat16_t x) {
  return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
}

template <class T>
__device__ __forceinline__ T from_float(float f);
template <>
__device__ __forceinline__ half_t from_float<half_t>(float f) {
  half_t x;
  asm("{ .reg .f16 h; cvt.rn.f16.f32 h, %1; mov.b16 %0, h; }" : "=h"(x.bits) : "f"(f));
  return x;
}
template <>
__device__ __forceinline__ bfloat16_t from_float<bfloat16_t>(float f) {
  bfloat16_t x;
  asm("{ .reg .b16 h; cvt.rn.bf16.f32 h, %1; mov.b16 %0, h; }" : "=h"(x.bits) : "f"(f));
  return x;
}

// A compile-time flag as a value, for generic lambdas that specialise on it (NVRTC has no <type_traits>).
template <bool kValue>
struct BoolConstant {
  static constexpr bool value = kValue;
};
// void for any type: detects an optional member of a rendered Config (SFINAE).
template <class T>
struct VoidOf {
  using type = void;
};

// Config::kContinues where codegen rendered it (specs that continue a running result), else false.
template <class Config, class = void>
struct ContinuesOf {
  static constexpr bool value = false;
};
template <class Config>
struct ContinuesOf<Config, typename VoidOf<decltype(Config::kContinues)>::type> {
  static constexpr bool value = Config::kContinues;
};

// Config::kOrderedDq where codegen rendered it (sm90_bwd's deterministic mode), else false.
template <class Config, class = void>
struct OrderedDqOf {
  static constexpr bool value = false;
};
template <class Config>
struct OrderedDqOf<Config, typename VoidOf<decltype(Config::kOrderedDq)>::type> {
  static constexpr bool value = Config::kOrderedDq;
};

// NVRTC has no <cmath>: INFINITY and friends are spelled out.
__device__ __forceinline__ float positive_infinity() { return __int_as_float(0x7f800000); }

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Where one sequence of the batch starts in the (possibly packed) tensors, and how long it is.
struct SequenceExtent {
  int q_start, k_start;    // row offsets inside the packed dim (0 unless varlen)
  int seqlen_q, seqlen_k;
  long long q_batch_offset, k_batch_offset, v_batch_offset, o_batch_offset;  // elements
};

// kSeqused: the kernel honours p.seqused_q/k (families that take seqused; the others never load it).
template <bool kSeqused = false>
__device__ __forceinline__ SequenceExtent sequence_extent(const AttentionFwdParams& p, int batch) {
  SequenceExtent e;
  if (p.cu_seqlens_q != nullptr) {
    e.q_start = p.cu_seqlens_q[batch];
    e.k_start = p.cu_seqlens_k[batch];
    e.seqlen_q = kSeqused && p.seqused_q != nullptr ? p.seqused_q[batch] : p.cu_seqlens_q[batch + 1] - e.q_start;
    e.seqlen_k = kSeqused && p.seqused_k != nullptr ? p.seqused_k[batch] : p.cu_seqlens_k[batch + 1] - e.k_start;
    e.q_batch_offset = e.k_batch_offset = e.v_batch_offset = e.o_batch_offset = 0;
  } else {
    e.q_start = e.k_start = 0;
    e.seqlen_q = p.seqlen_q;
    e.seqlen_k = p.seqlen_k;
    e.q_batch_offset = batch * p.q_batch_stride;
    e.k_batch_offset = batch * p.k_batch_stride;
    e.v_batch_offset = batch * p.v_batch_stride;
    e.o_batch_offset = batch * p.o_batch_stride;
  }
  return e;
}

}  // namespace flashjit::kernels
