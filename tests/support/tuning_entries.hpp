// Tuning-database entries for the CPU tests: a made-up device and numbered problem keys.
#pragma once

#include "flashjit/tuning.hpp"

namespace flashjit::test {

inline DeviceStamp test_stamp(const char* name = "Test GPU") {
  DeviceStamp s;
  s.name = name;
  s.cc_major = 9;
  s.cc_minor = 0;
  s.sm_count = 132;
  s.memory_bytes = int64_t(141) << 30;
  s.driver_version = 13000;
  s.nvrtc_version = "13.0";
  return s;
}

// Entry i: a distinct problem key (seqlen and batch x heads buckets from i) served by a legal
// fa2_fwd spec for sm_90a.
inline TunedEntry numbered_entry(int i, const DeviceStamp& device = test_stamp()) {
  TunedEntry e;
  e.device = device;
  e.problem.family = Family::fa2_fwd;
  e.problem.dtype = DType::bf16;
  e.problem.head_dim = 128;
  e.problem.mask = MaskKind::causal;
  e.problem.seqlen_bucket = 64 << (i % 10);
  e.problem.batch_heads_bucket = 64 << (i / 10);
  e.spec = default_spec(Family::fa2_fwd, Arch::parse("sm_90a"), DType::bf16, 128, MaskKind::causal);
  e.median_ms = 1.0 + i;
  KernelSpec runner_up = e.spec;
  runner_up.num_stages = 1;
  e.runner_ups.emplace_back(runner_up, 1.5 + i);
  e.tuned_at = "2026-11-30T00:00:00Z";
  return e;
}

}  // namespace flashjit::test
