// GPU tier. Exit 77 (CTest's skip) only where the hardware is absent: no CUDA driver library, or a
// driver that sees no GPU. Everything else that keeps the tests from running (a driver too old or
// lacking a symbol, cuInit failing otherwise, no context) is a failure with its reason. A full run
// (no test spec), or of the quick tier ([quick]), also fails when a family this device has ran no
// case (support/case_ledger.hpp).
#define CATCH_CONFIG_RUNNER
#include "support/catch_session.hpp"

#include <dlfcn.h>

#include <cstdio>

#include "driver.hpp"
#include "flashjit/device.hpp"
#include "module_cache.hpp"
#include "support/case_ledger.hpp"

namespace {

// Whether the hardware is absent: no libcuda.so.1 at all, or its cuInit reports no device.
bool hardware_absent() {
  void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return true;
  using Init = int (*)(unsigned);
  auto init = reinterpret_cast<Init>(dlsym(handle, "cuInit"));
  const bool no_device = init != nullptr && init(0) == 100;  // CUDA_ERROR_NO_DEVICE
  return no_device;
}

}  // namespace

int main(int argc, char** argv) {
  Catch::Session session;
  if (int rc = flashjit::test::parse_or_refuse(session, argc, argv); rc >= 0) return rc;
  if (!flashjit::detail::driver_available()) {
    if (hardware_absent()) {
      std::printf("flashjit_gpu_tests: no CUDA driver or no GPU, skipping\n");
      return 77;
    }
    try {
      flashjit::detail::driver();
    } catch (const std::exception& e) {
      std::printf("flashjit_gpu_tests: FAILED: the CUDA driver cannot be used: %s\n", e.what());
    }
    return 1;
  }
  try {
    flashjit::device_count();
  } catch (const flashjit::Error& e) {
    if (e.code() != flashjit::ErrorCode::no_driver) {
      std::printf("flashjit_gpu_tests: FAILED: counting the GPUs: %s\n", e.what());
      return 1;
    }
    std::printf("flashjit_gpu_tests: no GPU (%s), skipping\n", e.what());
    return 77;
  }
  try {
    flashjit::detail::make_context_current(0);
  } catch (const std::exception& e) {
    std::printf("flashjit_gpu_tests: FAILED: no context on device 0: %s\n", e.what());
    return 1;
  }
  const auto& device = flashjit::device_properties(0);
  std::printf("flashjit_gpu_tests on %s (sm_%d%d, %d SMs), driver %d\n", device.name.c_str(),
              device.cc_major, device.cc_minor, device.sm_count, device.driver_version);
  const int failed = session.run();
  const auto missing = flashjit::test::CaseLedger::get().report(device.arch());
  const auto& spec = session.configData().testsOrTags;
  const bool whole_tier = spec.empty() || (spec.size() == 1 && spec[0] == "[quick]");
  if (whole_tier && !missing.empty()) {
    std::printf("flashjit_gpu_tests: FAILED: a %s run in which these families ran no case:", spec.empty() ? "full" : "quick");
    for (auto f : missing) std::printf(" %s", std::string(flashjit::to_string(f)).c_str());
    std::printf("\n");
    return 1;
  }
  return failed;
}
