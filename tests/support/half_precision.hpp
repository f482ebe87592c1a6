// Host-side fp16 / bf16 storage conversions (round to nearest even), matching the device's cvt.rn.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "flashjit/codegen/kernel_spec.hpp"

namespace flashjit::test {

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_fp16(float f) {
  _Float16 h = static_cast<_Float16>(f);  // GCC >= 12 on x86-64: IEEE round to nearest even
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

inline float fp16_to_float(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

inline uint16_t to_storage(DType dtype, float f) {
  return dtype == DType::bf16 ? float_to_bf16(f) : float_to_fp16(f);
}

inline float from_storage(DType dtype, uint16_t bits) {
  return dtype == DType::bf16 ? bf16_to_float(bits) : fp16_to_float(bits);
}

// All-ones is a NaN in both formats: an output element the kernel never wrote stays NaN.
constexpr uint16_t kPoison16 = 0xffff;

}  // namespace flashjit::test
