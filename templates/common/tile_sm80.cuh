// Shared-memory tiles for the mma.sync families: cp.async loads of (rows x head_dim) tiles into
// padded shared tiles, and a warp-level GEMM whose operands both come from shared memory, in
// either orientation. Tile "Shape" types provide Element, kThreads, kChunks, kLoadThreadsPerRow and
// kRowStride (elements per padded row; rows are padded by 16 bytes so the eight row addresses of
// an ldmatrix hit distinct bank groups).
#pragma once

#include "common/mma_sm80.cuh"

namespace flashjit::kernels {

// Rows [0, kRows) of a global (rows x head_dim) tile into a padded shared tile; rows at or past
// valid_rows and columns at or past head_dim are zero-filled (garbage there could be NaN, and
// 0 * NaN would reach the output). Each thread owns one 16-byte column chunk and walks down the
// rows; the row stride is made opaque to the optimiser so the row addresses are recomputed at each
// use instead of being hoisted out of the key loop into a dozen 64-bit registers (which spilled).
template <class Shape, int kRows>
__device__ __forceinline__ void load_tile_async(unsigned smem, const typename Shape::Element* gmem,
                                                long long row_stride, int valid_rows, int head_dim,
                                                int tid) {
  constexpr int kThreadsPerRow = Shape::kLoadThreadsPerRow;
  constexpr int kRowsPerPass = Shape::kThreads / kThreadsPerRow;
  const int chunk = tid % kThreadsPerRow, row0 = tid / kThreadsPerRow;
  if (kThreadsPerRow != Shape::kChunks && chunk >= Shape::kChunks) return;
  asm volatile("" : "+l"(row_stride));
  const bool column_valid = chunk * 8 < head_dim;
#pragma unroll
  for (int pass = 0; pass < (kRows + kRowsPerPass - 1) / kRowsPerPass; ++pass) {
    const int row = row0 + pass * kRowsPerPass;
    if (kRows % kRowsPerPass == 0 || row < kRows) {
      const bool valid = column_valid && row < valid_rows;
      const auto* src = valid ? gmem + row * row_stride + chunk * 8 : gmem;
      cp_async_16(smem + (row * Shape::kRowStride + chunk * 8) * 2, src, valid);
    }
  }
}

// acc (kMFrags m16 x kNFrags n8 tiles) += A (m x k) * B (k x n) over kKSteps k16 steps, for one
// warp. Each operand is a shared address of the warp's tile origin and a row stride in elements:
//   A stored m-major (m x k rows, like Q for QK^T)   kATransposed = false, origin &A[m0][k0]
//   A stored k-major (k x m rows, like dS^T for dS K) kATransposed = true,  origin &At[k0][m0]
//   B stored n-major (n x k rows, like K for QK^T)   kBTransposed = false, origin &Bt[n0][k0]
//   B stored k-major (k x n rows, like V for PV)     kBTransposed = true,  origin &B[k0][n0]
template <class Element, int kMFrags, int kNFrags, int kKSteps, bool kATransposed, bool kBTransposed>
__device__ __forceinline__ void warp_gemm_ss(float (&acc)[kMFrags][kNFrags][4], unsigned sA, int a_stride,
                                             unsigned sB, int b_stride, int lane) {
  static_assert(kNFrags % 2 == 0, "B is loaded two n8 tiles at a time");
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    unsigned a[kMFrags][4];
#pragma unroll
    for (int mi = 0; mi < kMFrags; ++mi) {
      if constexpr (kATransposed) {
        const int matrix = lane / 8;  // (m half, k half) = (matrix % 2, matrix / 2)
        const int k = ks * 16 + lane % 8 + (matrix / 2) * 8, m = mi * 16 + (matrix % 2) * 8;
        ldmatrix_x4_trans(a[mi], sA + (k * a_stride + m) * 2);
      } else {
        const int m = mi * 16 + lane % 16, k = ks * 16 + (lane / 16) * 8;
        ldmatrix_x4(a[mi], sA + (m * a_stride + k) * 2);
      }
    }
#pragma unroll
    for (int ni2 = 0; ni2 < kNFrags / 2; ++ni2) {
      unsigned b[4];
      if constexpr (kBTransposed) {
        const int k = ks * 16 + lane % 8 + ((lane / 8) % 2) * 8, n = (ni2 * 2 + lane / 16) * 8;
        ldmatrix_x4_trans(b, sB + (k * b_stride + n) * 2);
      } else {
        const int n = ni2 * 16 + lane % 8 + (lane / 16) * 8, k = ks * 16 + ((lane / 8) % 2) * 8;
        ldmatrix_x4(b, sB + (n * b_stride + k) * 2);
      }
#pragma unroll
      for (int mi = 0; mi < kMFrags; ++mi) {
        mma_16816<Element>(acc[mi][2 * ni2], a[mi], b[0], b[1]);
        mma_16816<Element>(acc[mi][2 * ni2 + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// o (kMFrags m16 x kOFrags n8 tiles) += P V for one warp over kKeySteps k16 steps of keys, with P
// converted from the warp's S accumulators (the C layout of two n8 tiles is the A layout of one
// k16 step) and V read k-major through v_at(key, dim), the shared address of V[key][dim] (dim a
// multiple of 8), so any layout of V's rows serves.
template <class Element, int kKeySteps, int kMFrags, int kOFrags, int kSFrags, class VAddress>
__device__ __forceinline__ void warp_accumulate_pv_at(float (&o)[kMFrags][kOFrags][4],
                                                      const float (&s)[kMFrags][kSFrags][4], VAddress v_at, int lane) {
  static_assert(kSFrags >= 2 * kKeySteps, "P covers the keys");
#pragma unroll
  for (int ks = 0; ks < kKeySteps; ++ks) {
    unsigned a[kMFrags][4];
#pragma unroll
    for (int mi = 0; mi < kMFrags; ++mi) {
      a[mi][0] = pack2<Element>(s[mi][2 * ks][0], s[mi][2 * ks][1]);
      a[mi][1] = pack2<Element>(s[mi][2 * ks][2], s[mi][2 * ks][3]);
      a[mi][2] = pack2<Element>(s[mi][2 * ks + 1][0], s[mi][2 * ks + 1][1]);
      a[mi][3] = pack2<Element>(s[mi][2 * ks + 1][2], s[mi][2 * ks + 1][3]);
    }
#pragma unroll
    for (int nd2 = 0; nd2 < kOFrags / 2; ++nd2) {
      unsigned b[4];
      const int key = ks * 16 + lane % 8 + ((lane / 8) % 2) * 8;
      ldmatrix_x4_trans(b, v_at(key, (nd2 * 2 + lane / 16) * 8));
#pragma unroll
      for (int mi = 0; mi < kMFrags; ++mi) {
        mma_16816<Element>(o[mi][2 * nd2], a[mi], b[0], b[1]);
        mma_16816<Element>(o[mi][2 * nd2 + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// The same with V in a padded tile at sV, `row_stride` elements per key.
template <class Element, int kKeySteps, int kMFrags, int kOFrags, int kSFrags>
__device__ __forceinline__ void warp_accumulate_pv(float (&o)[kMFrags][kOFrags][4], const float (&s)[kMFrags][kSFrags][4],
                                                   unsigned sV, int row_stride, int lane) {
  warp_accumulate_pv_at<Element, kKeySteps>(
      o, s, [&](int key, int dim) { return sV + (key * row_stride + dim) * 2; }, lane);
}

// acc (kMFrags m16 x kNFrags n8 tiles) += A B^T for one warp over kKSteps k16 steps: A m-major in a
// padded shared tile (like Q), B n-major through b_at(n, k), the shared address of B^T[n][k] (k a
// multiple of 8), so any layout of B's rows serves (like a swizzled TMA tile of K).
template <class Element, int kMFrags, int kNFrags, int kKSteps, class BAddress>
__device__ __forceinline__ void warp_gemm_sb(float (&acc)[kMFrags][kNFrags][4], unsigned sA, int a_stride, BAddress b_at,
                                             int lane) {
  static_assert(kNFrags % 2 == 0, "B is loaded two n8 tiles at a time");
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    unsigned a[kMFrags][4];
#pragma unroll
    for (int mi = 0; mi < kMFrags; ++mi) {
      const int m = mi * 16 + lane % 16, k = ks * 16 + (lane / 16) * 8;
      ldmatrix_x4(a[mi], sA + (m * a_stride + k) * 2);
    }
#pragma unroll
    for (int ni2 = 0; ni2 < kNFrags / 2; ++ni2) {
      unsigned b[4];
      ldmatrix_x4(b, b_at(ni2 * 16 + lane % 8 + (lane / 16) * 8, ks * 16 + ((lane / 8) % 2) * 8));
#pragma unroll
      for (int mi = 0; mi < kMFrags; ++mi) {
        mma_16816<Element>(acc[mi][2 * ni2], a[mi], b[0], b[1]);
        mma_16816<Element>(acc[mi][2 * ni2 + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// Traps when the launch gave less dynamic shared memory than the kernel's layout uses: the host's
// byte formula (codegen/src/families) and the template's must agree, and a shortfall would
// otherwise corrupt memory silently.
__device__ __forceinline__ void require_dynamic_smem(unsigned bytes) {
  unsigned given;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(given));
  if (given < bytes) __trap();
}

template <int kMFrags, int kNFrags>
__device__ __forceinline__ void zero_fragments(float (&acc)[kMFrags][kNFrags][4]) {
#pragma unroll
  for (int mi = 0; mi < kMFrags; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNFrags; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;
}

}  // namespace flashjit::kernels
