// The 16 specs the multi-process cache tests compile: reference_fwd, every head dim, fp16 and bf16.
#pragma once

#include <vector>

#include "flashjit/codegen/kernel_spec.hpp"

namespace flashjit::test {

inline std::vector<KernelSpec> worker_specs() {
  std::vector<KernelSpec> specs;
  for (int d : {32, 64, 96, 128, 160, 192, 224, 256})
    for (DType t : {DType::fp16, DType::bf16})
      specs.push_back(default_spec(Family::reference_fwd, Arch::parse("sm_80"), t, d));
  return specs;
}

}  // namespace flashjit::test
