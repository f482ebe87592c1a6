// The Hopper families' producer/consumer pipeline: a ring of kStages shared-memory stages, each with
// a full mbarrier (the producer's loads have landed) and an empty one (every consumer is done with
// the stage). Loads are numbered in order by a running count, their slot: slot i uses stage
// i % kStages in that stage's (i / kStages)-th phase, so neither side keeps per-stage state.
#pragma once

#include "common/sm90.cuh"

namespace flashjit::kernels {

// The barriers sit at compile-time offsets from one shared address (`base`): kFullOffset bytes to
// the kStages full ones, kEmptyOffset to the empty ones, 8 bytes apart. Offsets rather than
// addresses keep the code the kernels had with the offsets written out (two addresses held
// registers and moved ptxas's schedule).
template <int kStages, int kFullOffset, int kEmptyOffset>
struct PipelineRing {
  unsigned base;

  static __device__ __forceinline__ int stage(int slot) { return slot % kStages; }
  static __device__ __forceinline__ unsigned phase(int slot) { return (slot / kStages) & 1; }
  __device__ __forceinline__ unsigned full_barrier(int stage) const { return base + kFullOffset + 8 * stage; }
  __device__ __forceinline__ unsigned empty_barrier(int stage) const { return base + kEmptyOffset + 8 * stage; }

  // One thread, before the CTA's first __syncthreads (then fence_barrier_init()).
  __device__ __forceinline__ void init(unsigned full_arrivals, unsigned empty_arrivals) const {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full_barrier(s), full_arrivals);
      mbarrier_init(empty_barrier(s), empty_arrivals);
    }
  }
  // A consumer: until slot `slot`'s loads have landed. The second form takes its stage (slot %
  // kStages) from a caller that carries it from step to step: recomputed, it cost a signed modulo
  // per step (sm90_fwd's main loop).
  __device__ __forceinline__ void wait_full(int slot) const { wait_full(slot, stage(slot)); }
  __device__ __forceinline__ void wait_full(int slot, int stage) const {
    mbarrier_wait(full_barrier(stage), phase(slot));
  }
  // The producer: until the consumers have freed the stage of slot `slot` from its previous use (a
  // fresh barrier passes parity 1, so the first round does not wait).
  __device__ __forceinline__ void wait_empty(int slot) const {
    mbarrier_wait(empty_barrier(stage(slot)), phase(slot) ^ 1);
  }
};

}  // namespace flashjit::kernels
