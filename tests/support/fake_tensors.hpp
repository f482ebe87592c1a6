// C API tensors over host memory, for the CPU tests of argument checks: every check they reach
// happens before the driver is asked, so host buffers stand in for device memory.
#pragma once

#include <cstddef>
#include <vector>

#include "flashjit/flashjit.h"

namespace flashjit::test {

struct FakeTensors {
  alignas(16) static inline unsigned char arena[1 << 20];

  // A contiguous `shape` of `dtype` at `offset` bytes into the arena.
  static flashjit_tensor tensor(int dtype, std::vector<int64_t> shape, size_t offset = 0) {
    flashjit_tensor t{};
    t.data = arena + offset;
    t.dtype = dtype;
    t.device = 0;
    t.rank = static_cast<int32_t>(shape.size());
    int64_t stride = 1;
    for (int d = t.rank - 1; d >= 0; --d) {
      t.shape[d] = shape[d];
      t.strides[d] = stride;
      stride *= shape[d];
    }
    return t;
  }
};

}  // namespace flashjit::test
