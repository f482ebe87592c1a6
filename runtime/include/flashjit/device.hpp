// What flashjit needs to know about a GPU: the compile target and the limits dispatch respects.
#pragma once

#include <cstdint>
#include <string>

#include "flashjit/codegen/kernel_spec.hpp"

namespace flashjit {

struct DeviceProperties {
  int ordinal = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  int max_smem_per_block_optin = 0;  // bytes a block may use after raising its dynamic limit
  int smem_per_sm = 0;
  int regs_per_sm = 0;
  int l2_bytes = 0;
  int64_t total_memory = 0;
  int driver_version = 0;

  // The target flashjit compiles for on this device: sm_90 -> sm_90a (wgmma needs it).
  Arch arch() const;
};

// Throw Error(no_driver) on a machine without a driver or GPU.
int device_count();
const DeviceProperties& device_properties(int ordinal);  // queried once per device

}  // namespace flashjit
