#include "driver.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <mutex>
#include <string>

#include <fmt/format.h>

#include "flashjit/error.hpp"

namespace flashjit::detail {
namespace {

using GetProcAddress = CUresult (*)(const char*, void**, int, cuuint64_t,
                                    CUdriverProcAddressQueryResult*);

struct LoadResult {
  DriverApi api;
  std::string failure;  // empty on success
};

LoadResult load_driver() {
  LoadResult result;
  void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    result.failure = fmt::format("libcuda.so.1 could not be loaded ({}); this machine has no "
                                 "NVIDIA driver, so only compiling (flashjit-warm) works here",
                                 why ? why : "not found");
    return result;
  }
  auto get_proc = reinterpret_cast<GetProcAddress>(dlsym(handle, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    result.failure = "libcuda.so.1 has no cuGetProcAddress_v2: the driver predates CUDA 12, "
                     "flashjit needs a CUDA 12 or newer driver";
    return result;
  }
  DriverApi& api = result.api;
  // cuDriverGetVersion first, to refuse drivers older than the cuLibrary API (CUDA 12.0).
  void* pointer = nullptr;
  CUdriverProcAddressQueryResult status;
  if (get_proc("cuDriverGetVersion", &pointer, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &status) !=
          CUDA_SUCCESS || pointer == nullptr) {
    result.failure = "cuGetProcAddress could not find cuDriverGetVersion";
    return result;
  }
  reinterpret_cast<decltype(&::cuDriverGetVersion)>(pointer)(&api.driver_version);
  if (api.driver_version < 12000) {
    result.failure = fmt::format("the CUDA driver is version {}; flashjit needs 12.0 or newer",
                                 api.driver_version);
    return result;
  }

#define FLASHJIT_LOAD_POINTER(name, version)                                                 \
  pointer = nullptr;                                                                         \
  if (get_proc(#name, &pointer, version, CU_GET_PROC_ADDRESS_DEFAULT, &status) !=            \
          CUDA_SUCCESS || pointer == nullptr) {                                              \
    result.failure = fmt::format("the CUDA driver (version {}) lacks {}", api.driver_version, \
                                 #name);                                                     \
    return result;                                                                           \
  }                                                                                          \
  api.name = reinterpret_cast<decltype(api.name)>(pointer);
  FLASHJIT_DRIVER_FUNCTIONS(FLASHJIT_LOAD_POINTER)
#undef FLASHJIT_LOAD_POINTER

  if (CUresult r = api.cuInit(0); r != CUDA_SUCCESS) {
    const char* name = nullptr;
    api.cuGetErrorName(r, &name);
    result.failure = fmt::format("cuInit failed with {}: the NVIDIA driver is installed but no "
                                 "usable GPU was found", name ? name : std::to_string(r));
  }
  return result;
}

const LoadResult& loaded() {
  static const LoadResult result = load_driver();
  return result;
}

}  // namespace

const DriverApi& driver() {
  const LoadResult& result = loaded();
  if (!result.failure.empty()) throw Error(ErrorCode::no_driver, "driver", result.failure);
  return result.api;
}

bool driver_available() { return loaded().failure.empty(); }

void check_cuda(CUresult result, std::string_view call) {
  if (result == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const char* text = nullptr;
  const DriverApi& api = loaded().api;
  if (api.cuGetErrorName) api.cuGetErrorName(result, &name);
  if (api.cuGetErrorString) api.cuGetErrorString(result, &text);
  throw Error(ErrorCode::cuda_error, std::string(call),
              fmt::format("{} ({}): {}", name ? name : "CUDA error", static_cast<int>(result),
                          text ? text : "no description"));
}

}  // namespace flashjit::detail
