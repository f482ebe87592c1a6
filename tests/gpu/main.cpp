// GPU tier: exits 77 (CTest's skip code) when there is no driver or device, so CI on CPU
// machines reports the suite as skipped rather than passed.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>

#include "driver.hpp"
#include "flashjit/device.hpp"
#include "module_cache.hpp"

int main(int argc, char** argv) {
  if (!flashjit::detail::driver_available()) {
    std::printf("flashjit_gpu_tests: no CUDA driver, skipping\n");
    return 77;
  }
  try {
    flashjit::device_count();
    flashjit::detail::make_context_current(0);
  } catch (const std::exception& e) {
    std::printf("flashjit_gpu_tests: no usable GPU (%s), skipping\n", e.what());
    return 77;
  }
  const auto& device = flashjit::device_properties(0);
  std::printf("flashjit_gpu_tests on %s (sm_%d%d, %d SMs), driver %d\n", device.name.c_str(),
              device.cc_major, device.cc_minor, device.sm_count, device.driver_version);
  return Catch::Session().run(argc, argv);
}
