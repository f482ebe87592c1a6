// runtime/dispatch: ForwardProblem + device -> KernelSpec. Never times anything; a heuristic
// answer always exists for a supported problem.
#pragma once

#include "flashjit/device.hpp"
#include "flashjit/tuning.hpp"
#include "problem.hpp"

namespace flashjit::detail {

// The smallest kernel head dim of `family` that holds `head_dim`.
int kernel_head_dim(Family family, int head_dim);

// The forward family for a problem on `arch`: the backend's, or for the automatic backend sm90_fwd
// on sm_90 devices when TMA can read the tensors and fa2_fwd otherwise. Throws when a forced
// backend cannot run the problem here.
Family forward_family(const ForwardProblem& problem, const Arch& arch);

// The tuning key of a problem for `family` (fa2_fwd or fa2_bwd).
ProblemKey problem_key(const ForwardProblem& problem, Family family);

// Forced spec, else the tuned one (when `tuning` has an entry for this device and problem), else
// the heuristic's.
KernelSpec select_forward_kernel(const ForwardProblem& problem, const DeviceProperties& device,
                                 const TuningSources* tuning = nullptr);

// The fa2_bwd spec for a backward problem (`problem` is the backward's forward part).
KernelSpec select_backward_kernel(const ForwardProblem& problem, const DeviceProperties& device,
                                  const TuningSources* tuning = nullptr);

// What the runtime's backward runs: a forced spec (an sm90_bwd one only where sm90_bwd can run the
// problem); else a tuned one (likewise); else, on sm_90 devices in the atomic-dQ mode, sm90_bwd
// where it has a kernel of the problem's fa2_bwd head dim (64, 128 or 256) and TMA can read q, k, v
// and dout; else the fa2_bwd spec above.
KernelSpec select_backward_kernel(const BackwardProblem& problem, const DeviceProperties& device,
                                  const TuningSources* tuning = nullptr);

// The persistent Hopper forward's tail splits: its last `tiles` work tiles each run as `splits`
// items over a share of their key blocks, so the last round of whole tiles, which would leave the
// CTAs without one idle for a tile's time, is spread over all of them. `requested_splits`: 0
// chooses (none where the tiles fill whole rounds or splitting does not shorten the last one), 1
// never splits, n > 1 splits the remainder into n (at most one item per key block).
struct TailSplit {
  long long tiles = 0;
  int splits = 1;
};
TailSplit choose_tail_split(long long tiles, int ctas, int key_blocks, int requested_splits);

}  // namespace flashjit::detail
