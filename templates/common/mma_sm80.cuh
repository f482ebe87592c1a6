// sm_80 building blocks as inline PTX: cp.async (global -> shared, zero-filling), ldmatrix,
// mma.sync m16n8k16 with fp32 accumulators, exp2, and 16-bit packing. Every FA2-style family uses
// these; fragment layouts are the PTX ISA's (g = lane / 4, t = lane % 4):
//   A (16x16, row):  a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B (16x8, col):   b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
//   C (16x8):        c0,c1 (g, 2t..2t+1)   c2,c3 (g+8, 2t..2t+1)
#pragma once

#include "common/types.cuh"

namespace flashjit::kernels {

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
  unsigned address;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(pointer));
  return address;
}

// 16 bytes global -> shared, asynchronously; when !valid, writes zeros and reads nothing.
__device__ __forceinline__ void cp_async_16(unsigned smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem));
}

// d += a * b, m16n8k16, fp32 accumulators.
template <class Element>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (is_same<Element, half_t>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats -> one register of two 16-bit values, `low` in the low half.
template <class Element>
__device__ __forceinline__ unsigned pack2(float low, float high) {
  unsigned r;
  if constexpr (is_same<Element, half_t>::value)
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(high), "f"(low));
  else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(high), "f"(low));
  return r;
}

// One register of two fp16 values -> two floats (exact), `low` from the low half.
__device__ __forceinline__ float2 unpack_f16x2(unsigned r) {
  float low, high;
  asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
      : "=f"(low), "=f"(high)
      : "r"(r));
  return make_float2(low, high);
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// tanh through exp2, accurate to a few fp32 ulps away from 0 (tanh.approx's 2^-11 relative error
// would move softcapped logits by up to softcap * 2^-11). |x| large saturates cleanly to +-1.
__device__ __forceinline__ float tanh_accurate(float x) {
  const float e = exp2_approx(-2.885390081777927f * fabsf(x));  // exp(-2|x|)
  const float t = __fdividef(1.f - e, 1.f + e);
  return copysignf(t, x);
}

}  // namespace flashjit::kernels
