// The only door to the CUDA driver: libcuda.so.1 is dlopened on first use and every entry point is
// fetched with cuGetProcAddress, so the library, the CPU tests and flashjit-warm run on machines
// with no driver at all. Any use there throws Error(no_driver).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string_view>

namespace flashjit::detail {

// X(name, version): every driver function flashjit calls, pinned to one ABI version. The pointer
// type is cudaTypedefs.h's PFN_<name>_v<version> and cuGetProcAddress is asked for exactly that
// version, so a driver or header that adds a new variant (CUDA 13 changed cuCtxGetDevice's
// signature under the same name) cannot hand us a function of another shape. Member names follow
// cuda.h's macros (cuMemAlloc is the member cuMemAlloc_v2), so calls read like plain driver calls.
#define FLASHJIT_DRIVER_FUNCTIONS(X)    \
  X(cuGetErrorName, 6000)               \
  X(cuGetErrorString, 6000)             \
  X(cuInit, 2000)                       \
  X(cuDriverGetVersion, 2020)           \
  X(cuDeviceGetCount, 2000)             \
  X(cuDeviceGet, 2000)                  \
  X(cuDeviceGetName, 2000)              \
  X(cuDeviceGetAttribute, 2000)         \
  X(cuDeviceTotalMem, 3020)             \
  X(cuDevicePrimaryCtxRetain, 7000)     \
  X(cuCtxGetCurrent, 4000)              \
  X(cuCtxSetCurrent, 4000)              \
  X(cuCtxPushCurrent, 4000)             \
  X(cuCtxPopCurrent, 4000)              \
  X(cuCtxGetDevice, 2000)               \
  X(cuCtxSynchronize, 2000)             \
  X(cuLibraryLoadData, 12000)           \
  X(cuLibraryUnload, 12000)             \
  X(cuLibraryGetKernel, 12000)          \
  X(cuLibraryGetGlobal, 12000)          \
  X(cuKernelSetAttribute, 12000)        \
  X(cuKernelGetAttribute, 12000)        \
  X(cuKernelGetFunction, 12000)         \
  X(cuOccupancyMaxActiveBlocksPerMultiprocessor, 6050) \
  X(cuOccupancyMaxActiveClusters, 11070) \
  X(cuLaunchKernelEx, 11060)            \
  X(cuMemAlloc, 3020)                   \
  X(cuMemFree, 3020)                    \
  X(cuMemcpyHtoD, 3020)                 \
  X(cuMemcpyDtoH, 3020)                 \
  X(cuMemcpyDtoHAsync, 3020)            \
  X(cuMemsetD8, 3020)                   \
  X(cuMemsetD32Async, 3020)             \
  X(cuMemcpyHtoDAsync, 3020)            \
  X(cuMemcpyDtoDAsync, 3020)            \
  X(cuMemcpy2DAsync, 3020)              \
  X(cuMemPoolCreate, 11020)             \
  X(cuMemPoolSetAttribute, 11020)       \
  X(cuMemAllocFromPoolAsync, 11020)     \
  X(cuMemFreeAsync, 11020)              \
  X(cuStreamCreate, 2000)               \
  X(cuStreamDestroy, 4000)              \
  X(cuStreamSynchronize, 2000)          \
  X(cuStreamWaitEvent, 3020)            \
  X(cuStreamBeginCapture, 10010)        \
  X(cuStreamEndCapture, 10000)          \
  X(cuGraphInstantiateWithFlags, 11040) \
  X(cuGraphGetNodes, 10000)             \
  X(cuGraphLaunch, 10000)               \
  X(cuGraphExecDestroy, 10000)          \
  X(cuGraphDestroy, 10000)              \
  X(cuEventCreate, 2000)                \
  X(cuEventDestroy, 4000)               \
  X(cuEventRecord, 2000)                \
  X(cuEventSynchronize, 2000)           \
  X(cuEventElapsedTime, 2000)           \
  X(cuPointerGetAttribute, 4000)        \
  X(cuTensorMapEncodeTiled, 12000)

struct DriverApi {
#define FLASHJIT_DECLARE_POINTER(name, version) PFN_##name##_v##version name = nullptr;
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
