// Catch2 assertions over an AttentionCase that has run: output and LSE within tolerance, with the
// first bad element and the largest error in the failure message; and the gate of Hopper-only cases.
#pragma once

#include <catch2/catch.hpp>

#include "support/attention_case.hpp"

namespace flashjit::test {

inline void check_against_oracle(const AttentionCase& c, Tolerance out_tolerance, Tolerance lse_tolerance) {
  const Comparison out = c.check_output(out_tolerance);
  INFO("out: " << out.bad << " of " << out.checked << " outside tolerance; first " << out.first_bad
               << "; max abs error " << out.max_abs << "; " << out.bad_heads << " heads over "
               << out_tolerance.head_rms << ", worst " << out.worst_head << " at " << out.worst_head_rms);
  CHECK(out.ok());
  const Comparison lse = c.check_lse(lse_tolerance);
  INFO("lse: " << lse.bad << " of " << lse.checked << " bad; first " << lse.first_bad);
  CHECK(lse.ok());
}

// For cases only the Hopper families run: false, with the case recorded as skipped, elsewhere.
inline bool hopper_or_skip(const char* why = "sm90_fwd needs an sm_90 device") {
  if (device_properties(0).arch().name() == "sm_90a") return true;
  CaseLedger::get().skipped(Catch::getResultCapture().getCurrentTestName(), why);
  return false;
}

}  // namespace flashjit::test
