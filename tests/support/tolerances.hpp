// The one tolerance table for numerics tests, with the reasoning behind each row.
//
// An output element passes when |got - want| <= atol + rtol * |want| + row * magnitude, against the
// float64 reference computed from the same rounded inputs, so only the kernel's own arithmetic and
// its output rounding count. `magnitude` is the row's natural scale (attention_reference.hpp:
// sqrt(sum_j p_j^2 |v_j|^2 / d), the RMS of O for independent values; the row's RMS where the
// oracle is the GPU reference kernel). Each head must also pass as a whole: the RMS over its rows
// of (the row's RMS error / its magnitude) at most `head_rms`. Both scale with the output, which
// shrinks like 1 / sqrt(keys seen) for N(0, 1) inputs: an absolute atol that covers short rows
// (|O| ~ 1) would pass a 5% error on every element of a 4k row (|O| ~ 0.02). The head check
// catches small errors everywhere (a scale 2% off, a dropped key block), which no single element
// shows; tests/gpu/test_checks.cpp shows that it does.
#pragma once

#include "flashjit/codegen/kernel_spec.hpp"

namespace flashjit::test {

struct Tolerance {
  double atol;
  double rtol;
  double row = 0;       // times the row's magnitude, per element
  double head_rms = 0;  // bound on a head's RMS of row errors relative to their magnitudes; 0: unchecked
};

// reference_fwd: fp32 math throughout, then one rounding of O to the output type. Rounding costs
// at most half an ulp: 2^-9 relative for bf16 (8-bit significand), 2^-12 for fp16 (11-bit). fp32
// accumulation over <= 4k keys adds ~1e-6 absolute; atol covers it and values near zero.
inline Tolerance reference_output_tolerance(DType dtype) {
  return dtype == DType::bf16 ? Tolerance{2e-5, 1.0 / 256} : Tolerance{2e-5, 1.0 / 2048};
}

// LSE is fp32 and never rounded to 16 bits: fp32 sum and log over <= 4k terms.
inline Tolerance reference_lse_tolerance() { return {2e-5, 2e-6}; }

// fa2_fwd and sm90_fwd (every tensor-core forward): P is rounded to the input type before P.V, so
// each weight carries a relative error of up to u = 2^-8 (bf16, 8-bit significand) or 2^-11
// (fp16, 11-bit): O moves by sum_j p_j e_j v_j, whose RMS for independent rounding errors (each
// ~u / sqrt(3)) is 0.58 u times the row's magnitude. Over millions of elements the largest is some
// 5.5 of those, 3.2 u: `row` = 6 u per element leaves 2x. The output's own rounding is half an ulp,
// at most u relative (rtol). Per head, the two RMS errors add to ~0.8 u (0.58 u for P, 0.58 u of
// |O| ~ magnitude for the output): head_rms = 2 u leaves 2.5x, and a softmax scale 2% off (5-10 u
// here) or one dropped key block of 16k (8.8%: sqrt(128 / 16384) of the row) is far outside.
// atol only covers elements that are zero in the reference (rows that see no key).
inline Tolerance tensor_core_output_tolerance(DType dtype) {
  const double u = dtype == DType::bf16 ? 1.0 / 256 : 1.0 / 2048;
  return Tolerance{1e-6, u, 6 * u, 2 * u};
}

// The FP8 forward (e4m3 q, k and v, bf16 out; the float64 reference reads the dequantised inputs,
// so their quantisation is not an error): P is rounded to e4m3 for P V, a 4-bit significand, so
// the P term above with u = 2^-4 (the kernel offsets P by 2^6: only weights under 2^-12 of the
// row's largest lose more, to subnormals, and they add little). Per head that leaves 3.4x over
// independent roundings (0.58 u of the magnitude); a V transpose, key order or descale gone wrong
// moves O by about its own size. O's own rounding is bf16's half ulp (rtol).
inline Tolerance fp8_output_tolerance() {
  const double u = 1.0 / 16;
  return Tolerance{1e-6, 1.0 / 256, 6 * u, 2 * u};
}

// FP8 scores: wgmma sums the e4m3 products with fewer bits than fp32 (Hopper's FP8 accumulation is
// known to keep about 13 of the significand; DeepGEMM adds its partial sums in fp32 for that), so
// a score moves by up to ~2^-13 of its sum of |terms| (<~ 30 here): the LSE by a few 1e-3.
inline Tolerance fp8_lse_tolerance() { return {2e-2, 1e-3}; }

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
