// sm90_fwd (DRAFT family) forced, on the forward's awkward-shape set against the float64 reference
// (and the GPU reference kernel for 4224 x 4224). Skipped on devices other than sm_90.
#include <catch2/catch.hpp>

#include "support/attention_checks.hpp"

using namespace flashjit;
using namespace flashjit::test;

namespace {

bool on_hopper() {
  if (device_properties(0).arch().name() == "sm_90a") return true;
  WARN("sm90_fwd needs an sm_90 device; skipped");
  return false;
}

void check(const AttentionShape& shape, DType dtype, uint64_t seed, Oracle oracle = Oracle::cpu_float64,
           Layout layout = Layout::bshd) {
  AttentionCase c(shape, dtype, seed, layout, oracle);
  AttentionOptions options;
  options.backend = Backend::sm90;
  c.run(test_runtime(), options);
  INFO(c.describe());
  check_against_oracle(c, tensor_core_output_tolerance(dtype), tensor_core_lse_tolerance());
}

}  // namespace

TEST_CASE("sm90_fwd: head dims, causal, GQA", "[sm90]") {
  if (!on_hopper()) return;
  uint64_t seed = 21000;
  for (int d : {40, 64, 96, 128, 192, 256})
    for (bool causal : {false, true}) {
      AttentionShape s = AttentionShape::make(3, 113, 203, 8, 2, d);
      s.causal = causal;
      check(s, d % 16 == 0 ? DType::bf16 : DType::fp16, seed++);
    }
}

TEST_CASE("sm90_fwd: awkward seqlen pairs, windows, softcap, strides", "[sm90]") {
  if (!on_hopper()) return;
  uint64_t seed = 22000;
  for (auto [sq, sk] : {std::pair{1, 1}, {1, 4096}, {239, 1}, {1023, 1024}})
    for (bool causal : {false, true}) {
      AttentionShape s = AttentionShape::make(1, sq, sk, 8, 1, 128);
      s.causal = causal;
      check(s, DType::bf16, seed++);
    }
  for (float softcap : {0.f, 30.f}) {
    AttentionShape s = AttentionShape::make(2, 157, 301, 4, 2, 64);
    s.window_left = 64;
    s.window_right = 16;
    s.softcap = softcap;
    check(s, DType::bf16, seed++);
  }
  AttentionShape bhsd = AttentionShape::make(2, 300, 300, 4, 4, 128);
  check(bhsd, DType::fp16, seed++, Oracle::cpu_float64, Layout::bhsd);
  for (bool causal : {false, true}) {
    AttentionShape big = AttentionShape::make(1, 4224, 4224, 4, 2, 128);
    big.causal = causal;
    check(big, DType::bf16, seed++, Oracle::gpu_reference);
  }
}

TEST_CASE("sm90_fwd: varlen with empty, single and long sequences", "[sm90]") {
  if (!on_hopper()) return;
  uint64_t seed = 23000;
  for (bool causal : {false, true}) {
    AttentionShape s = AttentionShape::make(4, 0, 0, 8, 2, 128);
    s.seqlens_q = {0, 1, 2049, 77};
    s.seqlens_k = {5, 0, 2049, 300};
    s.causal = causal;
    check(s, DType::bf16, seed++);
  }
}
