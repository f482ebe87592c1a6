// Device memory for the GPU tests, through the library's driver door (no runtime API).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "driver.hpp"

namespace flashjit::test {

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    FLASHJIT_CU(cuMemAlloc, &pointer_, bytes_ > 0 ? bytes_ : 16);
  }
  ~DeviceBuffer() {
    if (pointer_) detail::driver().cuMemFree(pointer_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return reinterpret_cast<void*>(pointer_); }
  size_t bytes() const { return bytes_; }

  template <class T>
  void upload(const std::vector<T>& host) {
    FLASHJIT_CU(cuMemcpyHtoD, pointer_, host.data(), host.size() * sizeof(T));
  }
  template <class T>
  std::vector<T> download() const {
    std::vector<T> host(bytes_ / sizeof(T));
    FLASHJIT_CU(cuMemcpyDtoH, host.data(), pointer_, host.size() * sizeof(T));
    return host;
  }
  // 0xff bytes: NaN in fp16, bf16 and fp32, so any element the kernel fails to write is caught.
  void poison() { FLASHJIT_CU(cuMemsetD8, pointer_, 0xff, bytes_); }

 private:
  CUdeviceptr pointer_ = 0;
  size_t bytes_;
};

inline void synchronize() { FLASHJIT_CU(cuStreamSynchronize, nullptr); }

}  // namespace flashjit::test
