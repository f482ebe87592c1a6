#include "flashjit/device.hpp"

#include <memory>
#include <mutex>
#include <vector>

#include <fmt/format.h>

#include "driver.hpp"
#include "flashjit/error.hpp"

namespace flashjit {

using detail::driver;

Arch DeviceProperties::arch() const {
  Arch a;
  a.sm = cc_major * 10 + cc_minor;
  a.arch_specific = a.sm == 90;
  return a;
}

int device_count() {
  int count = 0;
  FLASHJIT_CU(cuDeviceGetCount, &count);
  if (count == 0) throw Error(ErrorCode::no_driver, "device", "the CUDA driver reports no GPU");
  return count;
}

namespace {

DeviceProperties query(int ordinal) {
  const int count = device_count();
  if (ordinal < 0 || ordinal >= count)
    throw Error(ErrorCode::invalid_argument, "device",
                fmt::format("device ordinal {} does not exist (this machine has {} GPU{})", ordinal,
                            count, count == 1 ? "" : "s"));
  CUdevice device;
  FLASHJIT_CU(cuDeviceGet, &device, ordinal);
  DeviceProperties p;
  p.ordinal = ordinal;
  char name[256] = {};
  FLASHJIT_CU(cuDeviceGetName, name, sizeof name, device);
  p.name = name;
  auto attribute = [&](CUdevice_attribute a) {
    int value = 0;
    FLASHJIT_CU(cuDeviceGetAttribute, &value, a, device);
    return value;
  };
  p.cc_major = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  p.cc_minor = attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  p.sm_count = attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  p.max_smem_per_block_optin = attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
  p.smem_per_sm = attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR);
  p.regs_per_sm = attribute(CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR);
  p.l2_bytes = attribute(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
  size_t bytes = 0;
  FLASHJIT_CU(cuDeviceTotalMem, &bytes, device);
  p.total_memory = static_cast<int64_t>(bytes);
  p.driver_version = driver().driver_version;
  return p;
}

}  // namespace

const DeviceProperties& device_properties(int ordinal) {
  static std::mutex mutex;
  static std::vector<std::unique_ptr<DeviceProperties>> known;
  std::lock_guard<std::mutex> lock(mutex);
  if (ordinal >= 0 && ordinal < static_cast<int>(known.size()) && known[ordinal]) return *known[ordinal];
  auto properties = std::make_unique<DeviceProperties>(query(ordinal));
  if (static_cast<int>(known.size()) <= ordinal) known.resize(ordinal + 1);
  known[ordinal] = std::move(properties);
  return *known[ordinal];
}

}  // namespace flashjit
