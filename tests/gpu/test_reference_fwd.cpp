// The reference forward kernel against the float64 CPU reference on awkward shapes, plus the
// pipeline's costs on a real GPU: cold compile, disk-cache hit in a second process, launch overhead.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "support/attention_checks.hpp"
#include "support/subprocess.hpp"
#include "support/temp_dir.hpp"

using namespace flashjit;
using namespace flashjit::test;

namespace {

void check_case(const AttentionShape& shape, DType dtype, uint64_t seed, Layout layout = Layout::bshd) {
  AttentionCase c(shape, dtype, seed, layout);
  AttentionOptions options;
  options.backend = Backend::reference;
  c.run(test_runtime(), options);
  INFO(c.describe());
  check_against_oracle(c, reference_output_tolerance(dtype), reference_lse_tolerance());
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

TEST_CASE("reference_fwd matches float64 on awkward shapes", "[reference][quick]") {
  const std::pair<int, int> seqlens[] = {{1, 1}, {113, 203}, {1023, 1024}};
  uint64_t seed = 1;
  for (auto [sq, sk] : seqlens)
    for (int d : {64, 128, 256})
      for (bool causal : {false, true}) {
        AttentionShape s = AttentionShape::make(sq > 1000 ? 1 : 3, sq, sk, 4, 2, d);
        s.causal = causal;
        check_case(s, DType::bf16, seed++);
      }
}

TEST_CASE("reference_fwd covers fp16, GQA, windows, softcap, strides and varlen", "[reference]") {
  AttentionShape s = AttentionShape::make(2, 239, 1, 8, 1, 96);
  check_case(s, DType::fp16, 101);  // MQA, seqlen_k 1
  s.seqlen_q = 77;
  s.seqlen_k = 300;
  s.heads_kv = 2;
  s.head_dim = 72;  // not a kernel head dim: rounded up to 96 with masked loads
  s.causal = true;
  s.window_left = 40;
  check_case(s, DType::bf16, 102);
  s.causal = false;
  s.window_left = 10;
  s.window_right = 25;
  s.softcap = 5.f;
  check_case(s, DType::fp16, 103);
  // Causal with seqlen_q > seqlen_k: the first rows see no key (O = 0, LSE = inf).
  s = AttentionShape::make(3, 300, 100, 2, 2, 128);
  s.causal = true;
  check_case(s, DType::bf16, 104, Layout::bhsd);
  s = AttentionShape::make(4, 0, 0, 4, 4, 64);
  s.seqlens_q = {0, 1, 2049, 17};
  s.seqlens_k = {5, 0, 2049, 40};
  s.causal = true;
  check_case(s, DType::bf16, 105);
}

TEST_CASE("reference_fwd is deterministic", "[reference]") {
  AttentionCase c(AttentionShape::make(2, 500, 700, 4, 4, 128), DType::bf16, 7);
  AttentionOptions options;
  options.backend = Backend::reference;
  c.run(test_runtime(), options);
  const auto first_out = c.output_bits();
  const auto first_lse = c.lse_values();
  c.run(test_runtime(), options);
  CHECK(c.output_bits() == first_out);
  CHECK(std::memcmp(c.lse_values().data(), first_lse.data(), first_lse.size() * 4) == 0);
}

// Runs in a child process started by the test below, with FLASHJIT_CACHE_DIR set to the parent's
// freshly filled cache: the kernel must come from disk, with no compile.
TEST_CASE("second process: forward finds its kernel on disk", "[.second-process]") {
  const char* dir = std::getenv("FLASHJIT_CACHE_DIR");
  REQUIRE(dir != nullptr);
  Runtime runtime(CacheConfig::from_environment());
  AttentionShape s;
  s.seqlen_q = s.seqlen_k = 64;
  s.head_dim = 128;
  AttentionCase c(s, DType::bf16, 3);
  AttentionOptions options;
  options.backend = Backend::reference;
  const auto start = std::chrono::steady_clock::now();
  c.run(runtime, options);
  const double first_call_ms = ms_since(start);
  CHECK(c.check_output(reference_output_tolerance(DType::bf16)).ok());
  const CacheStats stats = runtime.kernel_cache().stats();
  CHECK(stats.compiles == 0);
  CHECK(stats.disk_hits == 1);
  std::printf("second process: disk hit, first call (load + launch + run + copies) %.2f ms\n",
              first_call_ms);
}

TEST_CASE("pipeline costs: cold compile, disk hit, launch overhead", "[reference][timing]") {
  TempDir dir;
  KernelSpec spec;
  {
    // Cold: an empty cache directory.
    CacheConfig config;
    config.directory = dir.path();
    Runtime runtime(config);
    AttentionShape s;
    s.seqlen_q = s.seqlen_k = 64;
    s.head_dim = 128;
    AttentionCase c(s, DType::bf16, 3);
    AttentionOptions options;
    options.backend = Backend::reference;
    c.run(runtime, options);
    CHECK(runtime.kernel_cache().stats().compiles == 1);
  }
  // A second process: the kernel must be a disk hit there.
  // The child execs /proc/self/exe while still a copy of this process: this very test binary.
  Subprocess child({"/proc/self/exe", "[.second-process]"}, {"FLASHJIT_CACHE_DIR=" + dir.path()});
  const int status = child.wait();
  std::printf("%s", child.output().c_str());
  CHECK(status == 0);

  // Disk hit in this process, timed alone: read + verify + cuLibraryLoadData + attribute set.
  CacheConfig config;
  config.directory = dir.path();
  Runtime warm(config);
  AttentionShape tiny;
  tiny.seqlen_q = tiny.seqlen_k = 64;
  tiny.head_dim = 128;
  DeviceBuffer q(64 * 128 * 2), out(64 * 128 * 2);
  FLASHJIT_CU(cuMemsetD8, reinterpret_cast<CUdeviceptr>(q.get()), 0x3c, q.bytes());  // bf16 0.0115
  auto qv = TensorView::contiguous(q.get(), ScalarType::bfloat16, {1, 64, 1, 128});
  auto ov = TensorView::contiguous(out.get(), ScalarType::bfloat16, {1, 64, 1, 128});
  AttentionOptions reference;
  reference.backend = Backend::reference;
  auto start = std::chrono::steady_clock::now();
  warm.forward(qv, qv, qv, ov, nullptr, reference);
  const double disk_hit_ms = ms_since(start);
  synchronize();
  CHECK(warm.kernel_cache().stats().disk_hits == 1);

  // Launch overhead of a cached kernel: host time per forward() call. One query row and one key
  // tile keep each kernel shorter than the call itself, and 500 calls stay well inside the
  // driver's launch queue, so the host never waits for the GPU and this times the host alone.
  constexpr int kCalls = 500;
  DeviceBuffer one_row(128 * 2);
  FLASHJIT_CU(cuMemsetD8, reinterpret_cast<CUdeviceptr>(one_row.get()), 0x3c, one_row.bytes());
  auto row_view = TensorView::contiguous(one_row.get(), ScalarType::bfloat16, {1, 1, 1, 128});
  for (int i = 0; i < 100; ++i) warm.forward(row_view, qv, qv, row_view, nullptr);
  synchronize();
  start = std::chrono::steady_clock::now();
  for (int i = 0; i < kCalls; ++i) warm.forward(row_view, qv, qv, row_view, nullptr);
  const double per_call_us = ms_since(start) * 1000 / kCalls;
  synchronize();

  // Cold compile alone, as NVRTC reports it for this spec.
  KernelCache memory_only(CacheConfig{});
  auto compiled = memory_only.get(default_spec(Family::reference_fwd, device_properties(0).arch(),
                                               DType::bf16, 128));
  std::printf("pipeline costs: cold compile %.0f ms (NVRTC, reference_fwd d128); disk hit %.3f ms "
              "(first forward() call incl. load); launch overhead %.2f us per forward() call (fa2_fwd, one "
              "query row)\n",
              compiled->compile_ms, disk_hit_ms, per_call_us);
  if (const char* report = std::getenv("GPU_TEST_REPORT"))
    std::ofstream(report, std::ios::app)
        << "{\"cold_compile_ms\": " << compiled->compile_ms << ", \"disk_hit_ms\": " << disk_hit_ms
        << ", \"launch_overhead_us\": " << per_call_us << "}\n";
}

TEST_CASE("memory that is not the GPU's, or too small for the view, is refused", "[reference]") {
  // Allocation sizes are rounded up to the driver's granularity (2 MB), so "too small" is judged
  // against an 8 MB buffer viewed as 10 MB.
  constexpr int64_t kRows = 40960;  // x 128 bf16 = 10 MB
  DeviceBuffer q(kRows * 128 * 2), small(8 << 20);
  auto qv = TensorView::contiguous(q.get(), ScalarType::bfloat16, {1, kRows, 1, 128});
  auto run = [&](const TensorView& out) { test_runtime().forward(qv, qv, qv, out, nullptr); };
  CHECK_THROWS_WITH(run(TensorView::contiguous(small.get(), ScalarType::bfloat16, {1, kRows, 1, 128})),
                    Catch::Contains("out: shape (1, 40960, 1, 128)") &&
                        Catch::Contains("past the end of its allocation"));
  alignas(16) static unsigned char host[64 * 128 * 2];
  auto small_q = TensorView::contiguous(q.get(), ScalarType::bfloat16, {1, 64, 1, 128});
  CHECK_THROWS_WITH(test_runtime().forward(small_q, small_q, small_q,
                                             TensorView::contiguous(host, ScalarType::bfloat16, {1, 64, 1, 128}),
                                             nullptr),
                    Catch::Contains("out:") && Catch::Contains("is not CUDA device memory"));
}
