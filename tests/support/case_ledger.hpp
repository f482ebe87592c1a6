// What the GPU tier ran, per kernel family, and what it skipped and why. The test cases record
// every launch; main prints the tally at the end, and a full run (no test spec) in which a family
// this device has kernels for ran no case fails: a family silently dropped from every case (by a
// renamed backend, a skip that spread) must not pass.
#pragma once

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "flashjit/dispatch.hpp"
#include "flashjit/flashjit.hpp"
#include "support/attention_reference.hpp"

namespace flashjit::test {

class CaseLedger {
 public:
  static CaseLedger& get() {
    static CaseLedger ledger;
    return ledger;
  }

  void ran(Family family) { ++ran_[family]; }
  void skipped(const std::string& what, const std::string& why) { skipped_[why].push_back(what); }

  // The family a launch with `options` runs: the forced kernel's, the named backend's, or the
  // heuristic's (dispatch may tune the tile, never the family).
  static Family family_of(const AttentionOptions& options, bool backward, const Arch& arch, DType dtype,
                          int head_dim, MaskKind mask, bool softcap) {
    if (options.kernel) return options.kernel->family;
    switch (options.backend) {
      case Backend::reference: return Family::reference_fwd;
      case Backend::fa2: return backward ? Family::fa2_bwd : Family::fa2_fwd;
      case Backend::sm90: return backward ? Family::sm90_bwd : Family::sm90_fwd;
      case Backend::automatic: break;
    }
    return backward ? heuristic_backward_spec(arch, dtype, head_dim, mask, softcap).family
                    : heuristic_forward_spec(arch, dtype, head_dim, mask, softcap).family;
  }

  // Records a launch of `shape` with `options` on device 0.
  void ran(const AttentionOptions& options, bool backward, const AttentionShape& shape, DType dtype) {
    const MaskKind mask = shape.causal ? MaskKind::causal
                          : shape.window_left >= 0 || shape.window_right >= 0 ? MaskKind::window
                                                                                : MaskKind::none;
    ran(family_of(options, backward, device_properties(0).arch(), dtype, shape.head_dim, mask, shape.softcap > 0));
  }

  // Prints the tally; returns the families `arch` has kernels for that ran no case.
  std::vector<Family> report(const Arch& arch) const {
    std::vector<Family> missing;
    std::printf("flashjit_gpu_tests: cases per family:");
    for (Family f : all_families()) {
      bool present = false;
      for (int d = 8; d <= 256 && !present; d += 8) present = family_covers(f, arch, d);
      if (!present) continue;
      const auto it = ran_.find(f);
      const int count = it == ran_.end() ? 0 : it->second;
      std::printf(" %s %d", std::string(to_string(f)).c_str(), count);
      if (count == 0) missing.push_back(f);
    }
    std::printf("\n");
    size_t skips = 0;
    for (const auto& [why, what] : skipped_) skips += what.size();
    std::printf("flashjit_gpu_tests: %zu skipped\n", skips);
    for (const auto& [why, what] : skipped_) {
      std::printf("  %zu because %s:", what.size(), why.c_str());
      for (const auto& w : what) std::printf(" %s", w.c_str());
      std::printf("\n");
    }
    return missing;
  }

 private:
  std::map<Family, int> ran_;
  std::map<std::string, std::vector<std::string>> skipped_;
};

}  // namespace flashjit::test
