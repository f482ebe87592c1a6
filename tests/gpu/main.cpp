// GPU tier. Exit 77 (CTest's skip) only where the hardware is absent: no CUDA driver library, or a
// driver that sees no GPU. Everything else that keeps the tests from running (a driver too old or
// lacking a symbol, cuInit failing otherwise, no context) is a failure with its reason. A full run
// (no test spec), or of the quick tier ([quick]), also fails when a family this device has ran no
// case (support/case_ledger.hpp).
#define CATCH_CONFIG_RUNNER
#include "support/catch_session.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "driver.hpp"
#include "flashjit/device.hpp"
#include "module_cache.hpp"
#include "support/attention_case.hpp"
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

// The kernels a run of the quick tier loads (tests/gpu/quick_specs.json, gathered from a cold run's
// cache by tests/gpu/quick_specs.py), compiled on every core into the test runtime's cache while the
// cases run: compiled one by one as the cases reached them, they were most of the tier's time. A
// case that needs a kernel being compiled waits for it (KernelCache compiles a spec once); a stale
// list costs time, never a result.
class BackgroundCompiles {
 public:
  explicit BackgroundCompiles(const flashjit::Arch& arch) {
    // The source tree's list where the build was made, else the working directory's (a build
    // carried to another machine runs from a copy of the tree elsewhere).
    std::ifstream file(FLASHJIT_QUICK_SPECS);
    if (!file) file = std::ifstream("tests/gpu/quick_specs.json");
    if (!file) {
      std::printf("flashjit_gpu_tests: %s (or tests/gpu/quick_specs.json here) is missing; kernels compile as the "
                  "cases reach them\n", FLASHJIT_QUICK_SPECS);
      return;
    }
    for (const auto& j : nlohmann::json::parse(file)) {
      flashjit::KernelSpec spec = flashjit::KernelSpec::from_json(j);
      if (spec.arch == arch) specs_.push_back(spec);
    }
    const unsigned threads = std::max(1u, std::min(std::thread::hardware_concurrency(), 32u));
    for (unsigned t = 0; t < threads; ++t) pool_.emplace_back([this] { work(); });
  }
  ~BackgroundCompiles() {
    for (auto& t : pool_) t.join();
    if (!pool_.empty())
      std::printf("flashjit_gpu_tests: %zu kernels of the quick tier compiled or loaded on %zu threads in %.1f s\n",
                  specs_.size(), pool_.size(), seconds_.load());
  }

 private:
  void work() {
    auto& cache = flashjit::test::test_runtime().kernel_cache();
    for (size_t i; (i = next_++) < specs_.size();) {
      try {
        cache.get(specs_[i]);
      } catch (const std::exception&) {  // the case that uses the kernel reports the failure
      }
    }
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    for (double seen = seconds_; elapsed > seen && !seconds_.compare_exchange_weak(seen, elapsed);) {
    }
  }

  std::vector<flashjit::KernelSpec> specs_;
  std::atomic<size_t> next_{0};
  std::atomic<double> seconds_{0};
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::vector<std::thread> pool_;
};

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
  const auto& spec = session.configData().testsOrTags;
  const bool quick_tier = spec.size() == 1 && spec[0] == "[quick]";
  const bool whole_tier = spec.empty() || quick_tier;
  std::optional<BackgroundCompiles> compiles;
  if (quick_tier) compiles.emplace(device.arch());
  const int failed = session.run();
  compiles.reset();
  const auto missing = flashjit::test::CaseLedger::get().report(device.arch());
  if (whole_tier && !missing.empty()) {
    std::printf("flashjit_gpu_tests: FAILED: a %s run in which these families ran no case:", spec.empty() ? "full" : "quick");
    for (auto f : missing) std::printf(" %s", std::string(flashjit::to_string(f)).c_str());
    std::printf("\n");
    return 1;
  }
  return failed;
}
