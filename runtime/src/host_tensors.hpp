// Host-side helpers for the tools and the tuner that allocate their own test tensors: RAII device
// memory through the driver door, and 16-bit floats and FP8 (e4m3) values as storage bits (round to
// nearest even).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "driver.hpp"
#include "flashjit/codegen/kernel_spec.hpp"
#include "flashjit/flashjit.hpp"

namespace flashjit::detail {

class DeviceMemory {
 public:
  explicit DeviceMemory(size_t bytes) { FLASHJIT_CU(cuMemAlloc, &pointer_, std::max<size_t>(bytes, 16)); }
  ~DeviceMemory() {
    if (pointer_) driver().cuMemFree(pointer_);
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  void* get() const { return reinterpret_cast<void*>(pointer_); }
  CUdeviceptr address() const { return pointer_; }

 private:
  CUdeviceptr pointer_ = 0;
};

// The tensor type of a dtype's inputs, and of its output (FP8's is bf16).
inline ScalarType input_scalar_type(DType dtype) {
  return dtype == DType::e4m3 ? ScalarType::float8_e4m3 : dtype == DType::bf16 ? ScalarType::bfloat16 : ScalarType::float16;
}
inline ScalarType output_scalar_type(DType dtype) {
  return dtype == DType::e4m3 ? ScalarType::bfloat16 : input_scalar_type(dtype);
}

inline uint16_t to_half_bits(float f, DType dtype) {
  if (dtype == DType::bf16) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  const _Float16 h = static_cast<_Float16>(f);  // GCC >= 12 on x86-64: IEEE round to nearest even
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

inline float from_half_bits(uint16_t bits, DType dtype) {
  if (dtype == DType::bf16) {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

// N(0, 1) values as 16-bit floats: random data, since zeros would hide bugs and run fast.
inline std::vector<uint16_t> random_half_bits(size_t n, DType dtype, uint64_t seed) {
  std::vector<uint16_t> bits(n);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& b : bits) b = to_half_bits(normal(rng), dtype);
  return bits;
}

// e4m3 (PyTorch's float8_e4m3fn: bias 7, three mantissa bits, no infinities, 0x7f/0xff NaN), as
// cvt.rn.satfinite rounds: to nearest even, magnitudes past the largest (448) to it.
inline uint8_t to_e4m3_bits(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (std::isnan(f)) return sign | 0x7f;
  const float magnitude = std::fabs(f);
  if (magnitude >= 448.f) return sign | 0x7e;
  int binade;
  std::frexp(magnitude, &binade);                   // magnitude in [2^(binade-1), 2^binade)
  const int exponent = std::max(binade - 1, -6);    // below 2^-6: subnormals, spaced 2^-9
  const float steps = std::nearbyint(std::ldexp(magnitude, 3 - exponent));  // exact; ties to even
  // steps / 8 * 2^exponent, which may have rounded up to the next binade (steps 16).
  if (steps == 0.f) return sign;
  const int rounded_exponent = steps >= 16.f ? exponent + 1 : exponent;
  const int mantissa = static_cast<int>(steps >= 16.f ? steps / 2 : steps);  // 8..15 normal, 1..7 subnormal
  if (mantissa < 8) return sign | static_cast<uint8_t>(mantissa);
  return sign | static_cast<uint8_t>((rounded_exponent + 7) << 3 | (mantissa - 8));
}

inline float from_e4m3_bits(uint8_t bits) {
  const int exponent = (bits >> 3) & 15, mantissa = bits & 7;
  if (exponent == 15 && mantissa == 7) return NAN;
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                        : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  return bits & 0x80 ? -magnitude : magnitude;
}

// e4m3 values as bf16 storage bits (exact: bf16 holds every e4m3 value), for the reference kernel.
inline std::vector<uint16_t> e4m3_as_bf16_bits(const std::vector<uint8_t>& e4m3) {
  std::vector<uint16_t> bits(e4m3.size());
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = to_half_bits(from_e4m3_bits(e4m3[i]), DType::bf16);
  return bits;
}

// N(0, 1) values as e4m3.
inline std::vector<uint8_t> random_e4m3_bits(size_t n, uint64_t seed) {
  std::vector<uint8_t> bits(n);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& b : bits) b = to_e4m3_bits(normal(rng));
  return bits;
}

}  // namespace flashjit::detail
