// The one tolerance table for numerics tests, with the reasoning behind each row.
//
// Every check is |got - want| <= atol + rtol * |want| against the float64 reference computed from
// the same rounded inputs, so only the kernel's own arithmetic and its output rounding count.
// Inputs are N(0, 1): outputs are convex combinations of V rows, |O| <~ 3, LSE ~ log(seqlen_k).
#pragma once

#include "flashjit/codegen/kernel_spec.hpp"

namespace flashjit::test {

struct Tolerance {
  double atol;
  double rtol;
};

// reference_fwd: fp32 math throughout, then one rounding of O to the output type. Rounding costs
// at most half an ulp: 2^-9 relative for bf16 (8-bit significand), 2^-12 for fp16 (11-bit). fp32
// accumulation over <= 4k keys adds ~1e-6 absolute; atol covers it and values near zero.
inline Tolerance reference_output_tolerance(DType dtype) {
  return dtype == DType::bf16 ? Tolerance{2e-5, 1.0 / 256} : Tolerance{2e-5, 1.0 / 2048};
}

// LSE is fp32 and never rounded to 16 bits: fp32 sum and log over <= 4k terms.
inline Tolerance reference_lse_tolerance() { return {2e-5, 2e-6}; }

// fa2_fwd (and every tensor-core forward): P is rounded to the input type before P.V. Each weight
// then carries a relative error of up to half an ulp (2^-9 bf16, 2^-12 fp16), so O moves by at
// most that times the largest |v| (< 4.5 for N(0, 1) inputs at these sizes): atol = 2^-9 * 4 for
// bf16. The output's own rounding adds half an ulp of |O| (rtol), doubled for slack in exp2.approx
// and fp32 accumulation order.
inline Tolerance tensor_core_output_tolerance(DType dtype) {
  return dtype == DType::bf16 ? Tolerance{4.0 / 512, 1.0 / 256} : Tolerance{4.0 / 4096, 1.0 / 2048};
}

// The LSE stays fp32 from fp32 scores (exp2.approx has 2^-22 relative error): sums of <= 16k
// terms and one log lose ~1e-6 relative; |LSE| <~ 30.
inline Tolerance tensor_core_lse_tolerance() { return {1e-4, 1e-5}; }

// fa2_bwd gradients, per element: |got - want| <= mass_factor * mass + cancellation_factor *
// cancellation + rtol * |want| + atol. Every term of a gradient element has one factor rounded to the input type before its
// tensor-core GEMM (P for dV, dS for dK and dQ: relative error <= u_in = 2^-9 bf16, 2^-12 fp16),
// so the element moves by at most u_in times the sum of its |terms| (the reference's "mass");
// the factor 2 covers fp32 accumulation and exp2.approx. The output's own rounding is rtol (half
// an ulp, doubled). dS = P (dP - delta) is a difference of two fp32 dot products over head_dim
// (<= 256 terms: relative error <= 256 * 2^-24 = 2^-16 of their absolute sums), which matters when
// it cancels (one key dominating a row); cancellation_factor applies that to the reference's
// bound. atol covers elements whose bounds are ~0.
struct GradientTolerance {
  double mass_factor;  // times the element's mass
  double cancellation_factor;
  double rtol;
  double atol;
};
inline GradientTolerance tensor_core_gradient_tolerance(DType dtype) {
  return dtype == DType::bf16 ? GradientTolerance{2.0 / 512, 1.0 / 65536, 1.0 / 256, 1e-6}
                              : GradientTolerance{2.0 / 4096, 1.0 / 65536, 1.0 / 2048, 1e-6};
}

}  // namespace flashjit::test
