// flashjit::tune on the GPU: a small shape per pass. The winner is checked here against the float64
// reference on the tuned shape (the tuner's own check only passes finalists within its tolerance,
// so its reported error cannot fail a test), and the heuristic's spec, re-timed beside the
// finalists, keeps the entry unless a candidate beats it by 1%.
#include <catch2/catch.hpp>

#include <algorithm>

#include "support/attention_checks.hpp"
#include "support/backward_case.hpp"
#include "support/fp8_case.hpp"

using namespace flashjit;
using namespace flashjit::test;

TEST_CASE("tune: the heuristic's spec stays unless a candidate beats it by 1%", "[tune]") {
  for (bool backward : {false, true}) {
    TuneShape shape;
    shape.backward = backward;
    shape.batch = 2;
    shape.seqlen_q = shape.seqlen_k = 1000;
    shape.heads_q = 4;
    shape.heads_kv = 2;
    shape.head_dim = 64;
    shape.causal = true;
    TuneOptions options;
    options.iters = 5;
    options.finalists = 2;
    const TuneResult r = tune(test_runtime(), shape, options);
    INFO(shape.describe() << ": " << r.entry.spec.name() << " " << r.entry.median_ms << " ms, heuristic "
                          << r.heuristic_ms << " ms");
    CHECK(r.timed >= 2);
    AttentionShape reference_shape = AttentionShape::make(shape.batch, shape.seqlen_q, shape.seqlen_k, shape.heads_q,
                                                          shape.heads_kv, shape.head_dim);
    reference_shape.causal = shape.causal;
    AttentionOptions winner;
    winner.kernel = r.entry.spec;
    if (backward) {
      BackwardCase c(reference_shape, DType::bf16, 25000);
      c.run(test_runtime(), winner);
      const GradientComparison g = c.check(tensor_core_gradient_tolerance(DType::bf16));
      INFO("the winner's gradients: dq " << g.dq.bad << ", dk " << g.dk.bad << ", dv " << g.dv.bad << " bad; first "
                                         << g.dq.first_bad << g.dk.first_bad << g.dv.first_bad);
      CHECK(g.ok());
    } else {
      AttentionCase c(reference_shape, DType::bf16, 25001);
      c.run(test_runtime(), winner);
      check_against_oracle(c, tensor_core_output_tolerance(DType::bf16), tensor_core_lse_tolerance());
    }
    REQUIRE(r.heuristic_ms > 0);
    CHECK(r.entry.median_ms <= r.heuristic_ms);
    if (r.entry.median_ms > 0.99 * r.heuristic_ms) CHECK(r.entry.median_ms == r.heuristic_ms);  // the heuristic kept
    else  // the heuristic became a runner-up, with its re-timed median
      CHECK(std::any_of(r.entry.runner_ups.begin(), r.entry.runner_ups.end(),
                        [&](const auto& runner_up) { return runner_up.second == r.heuristic_ms; }));
    CHECK_FALSE(r.entry.spec.validate().has_value());
  }
}

TEST_CASE("tune: the FP8 forward's tiles, its winner against float64", "[tune][fp8]") {
  if (!hopper_or_skip("FP8 attention runs on sm_90")) return;
  TuneShape shape;
  shape.dtype = DType::e4m3;
  shape.batch = 2;
  shape.seqlen_q = shape.seqlen_k = 1000;
  shape.heads_q = 4;
  shape.heads_kv = 2;
  shape.head_dim = 128;
  TuneOptions options;
  options.iters = 5;
  options.finalists = 2;
  const TuneResult r = tune(test_runtime(), shape, options);
  INFO(shape.describe() << ": " << r.entry.spec.name() << " " << r.entry.median_ms << " ms, heuristic " << r.heuristic_ms
                        << " ms");
  CHECK(r.timed >= 2);
  CHECK(r.entry.spec.dtype == DType::e4m3);
  AttentionOptions winner;
  winner.kernel = r.entry.spec;
  Fp8Case(AttentionShape::make(shape.batch, shape.seqlen_q, shape.seqlen_k, shape.heads_q, shape.heads_kv,
                               shape.head_dim),
          25002)
      .run_and_check(winner);
  CHECK(r.entry.median_ms <= r.heuristic_ms);
}
