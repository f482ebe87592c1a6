// runtime/launch: scratch device memory for one call (the backward's fp32 dQ accumulator and row
// statistics). Stream-ordered: allocated on the call's stream from a pool flashjit keeps per device
// and freed on that stream after the last kernel that uses it, so calls on concurrent streams never
// share a buffer and no call waits for the GPU. The pool keeps its memory between calls (like a
// framework's caching allocator), so steady-state calls do not map memory.
#pragma once

#include <cstddef>

#include "driver.hpp"

namespace flashjit::detail {

class StreamWorkspace {
 public:
  StreamWorkspace(int device, CUstream stream, size_t bytes);
  ~StreamWorkspace();
  StreamWorkspace(const StreamWorkspace&) = delete;
  StreamWorkspace& operator=(const StreamWorkspace&) = delete;

  CUdeviceptr get() const { return pointer_; }

 private:
  CUstream stream_;
  CUdeviceptr pointer_ = 0;
};

}  // namespace flashjit::detail
