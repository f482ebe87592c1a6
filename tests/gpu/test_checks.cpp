// Tests of the checks themselves. A correct kernel passes the forward comparison, and each
// deliberate defect (what a broken kernel would compute: the softmax scale 2% off, one key block
// left out, q read with the wrong strides) fails it, at 4096 and 16k keys where outputs are small.
// And the Hopper kernels are what they claim: their SASS is built on wgmma (HGMMA), checked with
// the toolkit's disassembler, whose absence on a Hopper machine is a failure, not a skip.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "support/attention_checks.hpp"
#include "support/subprocess.hpp"
#include "support/temp_dir.hpp"

using namespace flashjit;
using namespace flashjit::test;

namespace {

// nvdisasm (or cuobjdump) from CUDA_HOME/bin, /usr/local/cuda/bin or PATH: the command that prints
// a cubin's SASS, or empty where this machine has neither.
std::vector<std::string> find_disassembler() {
  std::vector<std::string> dirs;
  if (const char* home = std::getenv("CUDA_HOME")) dirs.push_back(std::string(home) + "/bin");
  dirs.push_back("/usr/local/cuda/bin");
  if (const char* path = std::getenv("PATH")) {
    std::stringstream entries(path);
    for (std::string dir; std::getline(entries, dir, ':');)
      if (!dir.empty()) dirs.push_back(dir);
  }
  for (const auto& dir : dirs)
    if (std::filesystem::exists(dir + "/nvdisasm")) return {dir + "/nvdisasm"};
  for (const auto& dir : dirs)
    if (std::filesystem::exists(dir + "/cuobjdump")) return {dir + "/cuobjdump", "-sass"};
  return {};
}

}  // namespace

TEST_CASE("checks: a 2% scale error, a dropped key block and a wrong stride fail the comparison", "[checks][quick]") {
  uint64_t seed = 30000;
  const Tolerance tolerance = tensor_core_output_tolerance(DType::bf16);
  for (int seqlen : {4096, 16384})
    for (bool causal : {false, true}) {
      AttentionShape shape = AttentionShape::make(1, seqlen, seqlen, 2, 1, 128);
      shape.causal = causal;
      AttentionCase c(shape, DType::bf16, seed++);  // float64, every few rows (reference_row_step)
      AttentionOptions options;
      c.run(test_runtime(), options);
      {
        INFO(c.describe() << ": the correct kernel");
        check_against_oracle(c, tolerance, tensor_core_lse_tolerance());
      }
      struct Named {
        const char* what;
        Defect defect;
      };
      const Named defects[] = {{"softmax scale 2% high", Defect{1.02}},
                               {"softmax scale 2% low", Defect{0.98}},
                               {"keys 1024..1151 left out", Defect{1, 1024, 128}},
                               {"q read with the other layout's strides", Defect{1, -1, 0, true}}};
      for (const Named& n : defects) {
        c.run(test_runtime(), options, n.defect);
        const Comparison out = c.check_output(tolerance);
        INFO(c.describe() << ": " << n.what << ": " << out.bad << " of " << out.checked << " elements and "
                          << out.bad_heads << " heads outside tolerance, worst head at " << out.worst_head_rms);
        CHECK_FALSE(out.ok());
      }
    }
}

TEST_CASE("sm90 kernels are built on wgmma (HGMMA in their SASS)", "[checks][sm90][quick]") {
  const Arch arch = device_properties(0).arch();
  if (arch.name() != "sm_90a") {
    CaseLedger::get().skipped(Catch::getResultCapture().getCurrentTestName(), "sm90 kernels need an sm_90 device");
    return;
  }
  const std::vector<std::string> disassembler = find_disassembler();
  INFO("no nvdisasm or cuobjdump in CUDA_HOME/bin, /usr/local/cuda/bin or PATH");
  REQUIRE_FALSE(disassembler.empty());
  const TempDir dir;
  auto sass_of = [&](const KernelSpec& spec) {
    const std::string file = dir / (spec.name() + ".cubin");
    std::ofstream(file, std::ios::binary) << test_runtime().kernel_cache().get(spec)->cubin;
    std::vector<std::string> command = disassembler;
    command.push_back(file);
    Subprocess run(command);
    const int rc = run.wait();
    INFO(spec.name() << ": " << command.front() << " exit status " << rc);
    REQUIRE(rc == 0);
    return run.output();
  };
  for (Family family : {Family::sm90_fwd, Family::sm90_bwd})
    for (int d : {64, 128, 256})
      for (MaskKind mask : {MaskKind::none, MaskKind::causal}) {
        const KernelSpec spec = default_spec(family, arch, DType::bf16, d, mask);
        INFO(spec.name());
        CHECK(sass_of(spec).find("HGMMA") != std::string::npos);
      }
  // And the check can fail: an fa2_fwd kernel (mma.sync) has HMMA but no HGMMA.
  const std::string fa2 = sass_of(default_spec(Family::fa2_fwd, arch, DType::bf16, 128));
  CHECK(fa2.find("HGMMA") == std::string::npos);
  CHECK(fa2.find("HMMA") != std::string::npos);
}
