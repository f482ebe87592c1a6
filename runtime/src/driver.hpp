// The only door to the CUDA driver: libcuda.so.1 is dlopened on first use and every entry point is
// fetched with cuGetProcAddress, so the library, the CPU tests and flashjit-warm run on machines
// with no driver at all. Any use there throws Error(no_driver).
#pragma once

#include <cuda.h>

#include <string_view>

namespace flashjit::detail {

// X(name): every driver function flashjit calls. decltype(&name) gives the pointer type declared by
// the toolkit's cuda.h (versioned names such as cuMemAlloc -> cuMemAlloc_v2 are resolved by its
// macros, and cuGetProcAddress is asked for the base name at the header's CUDA_VERSION).
#define FLASHJIT_DRIVER_FUNCTIONS(X) \
  X(cuGetErrorName)                  \
  X(cuGetErrorString)                \
  X(cuInit)                          \
  X(cuDriverGetVersion)              \
  X(cuDeviceGetCount)                \
  X(cuDeviceGet)                     \
  X(cuDeviceGetName)                 \
  X(cuDeviceGetAttribute)            \
  X(cuDeviceTotalMem)                \
  X(cuDevicePrimaryCtxRetain)        \
  X(cuCtxGetCurrent)                 \
  X(cuCtxSetCurrent)                 \
  X(cuCtxGetDevice)                  \
  X(cuCtxSynchronize)                \
  X(cuLibraryLoadData)               \
  X(cuLibraryUnload)                 \
  X(cuLibraryGetKernel)              \
  X(cuKernelSetAttribute)            \
  X(cuKernelGetAttribute)            \
  X(cuLaunchKernelEx)                \
  X(cuMemAlloc)                      \
  X(cuMemFree)                       \
  X(cuMemcpyHtoD)                    \
  X(cuMemcpyDtoH)                    \
  X(cuMemcpyDtoHAsync)               \
  X(cuMemsetD8)                      \
  X(cuStreamCreate)                  \
  X(cuStreamDestroy)                 \
  X(cuStreamSynchronize)             \
  X(cuEventCreate)                   \
  X(cuEventDestroy)                  \
  X(cuEventRecord)                   \
  X(cuEventSynchronize)              \
  X(cuEventElapsedTime)              \
  X(cuPointerGetAttribute)           \
  X(cuTensorMapEncodeTiled)

struct DriverApi {
#define FLASHJIT_DECLARE_POINTER(name) decltype(&::name) name = nullptr;
  FLASHJIT_DRIVER_FUNCTIONS(FLASHJIT_DECLARE_POINTER)
#undef FLASHJIT_DECLARE_POINTER
  int driver_version = 0;  // e.g. 13000
};

// Loads libcuda and calls cuInit(0) once; throws Error(no_driver) with the reason when that fails
// (and again on every later call: a missing driver does not appear while a process runs).
const DriverApi& driver();

// True when driver() would succeed; never throws.
bool driver_available();

// Throws Error(cuda_error) naming the call and the driver's error name and text.
void check_cuda(CUresult result, std::string_view call);

}  // namespace flashjit::detail

#define FLASHJIT_CU(call_expr, ...) \
  ::flashjit::detail::check_cuda(::flashjit::detail::driver().call_expr(__VA_ARGS__), #call_expr)
