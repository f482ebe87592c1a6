// Host-side helpers for the tools and the tuner that allocate their own test tensors: RAII device
// memory through the driver door, and 16-bit floats as storage bits (round to nearest even).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "driver.hpp"
#include "flashjit/codegen/kernel_spec.hpp"

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

}  // namespace flashjit::detail
