// sm_90a building blocks as inline PTX: mbarriers, TMA tensor loads, wgmma synchronisation and
// shared-memory descriptors (128-byte swizzle), named barriers and register reallocation. Used by the
// Hopper families; layouts follow the PTX ISA's "asynchronous warpgroup level matrix" sections.
//   wgmma m64nNk16 accumulator fragment (thread t of warp w in the warpgroup, g = t / 4, q = t % 4):
//     d[4 j + 0, 1] = D(16 w + g,     8 j + 2 q + {0, 1})
//     d[4 j + 2, 3] = D(16 w + g + 8, 8 j + 2 q + {0, 1})      -- mma.sync's C layout per n8 tile
//   A fragment from registers (m64k16): the warp's 16 rows in mma.sync's m16k16 A layout.
#pragma once

#include "common/mma_sm80.cuh"

namespace flashjit::kernels {

// ---------------------------------------------------------------------------------------------
// mbarriers (shared::cta addresses as from shared_address()).

__device__ __forceinline__ void mbarrier_init(unsigned bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// Makes initialised barriers visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// The same where `pred` holds, predicated rather than branched on: a per-lane branch leaves ptxas
// unable to prove the warp converged after the branch it sits in (wgmma serialized, C7520).
__device__ __forceinline__ void mbarrier_arrive_if(bool pred, unsigned bar) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%1];\n}\n"
               ::"r"(int(pred)), "r"(bar) : "memory");
}
// One arrival that also announces `bytes` of TMA traffic the phase must wait for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Announces `bytes` of TMA traffic the current phase must wait for, without arriving.
__device__ __forceinline__ void mbarrier_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Blocks until the barrier's phase with parity `phase` has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned bar, unsigned phase) {
  unsigned done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(phase)
        : "memory");
  } while (!done);
}

// ---------------------------------------------------------------------------------------------
// TMA: a 4-D tile (dims innermost first) into shared memory, completing on `bar`.

__device__ __forceinline__ void tma_load_4d(unsigned smem, const TmaDescriptor& map, unsigned bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(smem),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

__device__ __forceinline__ void tma_load_5d(unsigned smem, const TmaDescriptor& map, unsigned bar, int c0, int c1,
                                            int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], "
      "[%2];\n" ::"r"(smem),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// Fetches a TMA map (a kernel parameter) into the descriptor cache ahead of its first copy.
__device__ __forceinline__ void prefetch_tma_map(const TmaDescriptor& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(&map)) : "memory");
}

// A 4-D tile from shared memory out to global memory (the map clips what lies past the tensor's
// extents), in this thread's current bulk async-group.
__device__ __forceinline__ void tma_store_4d(const TmaDescriptor& map, unsigned smem, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<unsigned long long>(&map)),
      "r"(smem), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// A 3-D tile of fp32 from shared memory added element by element into global memory (the TMA
// unit's reduction in L2; the map clips what lies past the tensor's extents), in this thread's
// current bulk async-group.
__device__ __forceinline__ void tma_reduce_add_3d(const TmaDescriptor& map, unsigned smem, int c0, int c1, int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
          reinterpret_cast<unsigned long long>(&map)),
      "r"(smem), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most kPending of this thread's bulk groups still read their shared memory (the
// source may then be overwritten; the global writes may still be in flight).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// Waits until at most kPending of this thread's bulk groups are incomplete, writes included.
template <int kPending>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 16-bit matrices to shared memory: lanes 8 j .. 8 j + 7 give the row addresses of matrix
// j, and register j of each thread holds its mma.sync C-layout pair of matrix j (row lane / 4,
// columns 2 (lane % 4) and the next).
__device__ __forceinline__ void stmatrix_x4(unsigned smem, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// The same, each matrix stored transposed: lanes 8 j .. 8 j + 7 give the addresses of its rows as
// stored, row r holding column r of the C-layout matrix (its 8 rows, 16 bytes).
__device__ __forceinline__ void stmatrix_x4_trans(unsigned smem, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Four floats -> one register of four e4m3 values, `b0` in the low byte (saturated to +-448, the
// wgmma A layout of an 8-bit k32 step: byte i holds element 4 (lane % 4) + i of its row).
__device__ __forceinline__ unsigned pack4_e4m3(float b0, float b1, float b2, float b3) {
  unsigned r;
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"  // (the first source goes to the upper byte)
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}\n"
      : "=r"(r)
      : "f"(b0), "f"(b1), "f"(b2), "f"(b3));
  return r;
}

// Four bytes picked from the eight of {b, a} (byte i of the result is byte selector nibble i; 0-3
// are a's, 4-7 b's).
__device__ __forceinline__ unsigned byte_permute(unsigned a, unsigned b, unsigned selector) {
  unsigned r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}

// ---------------------------------------------------------------------------------------------
// wgmma

// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads (wgmma
// operands, TMA stores) of the same bytes.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Orders this thread's global accesses through the generic proxy with its bulk (TMA) ones.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Shared-memory matrix descriptor for a 128-byte-swizzled tile (the layout TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B): 14-bit fields in 16-byte units: start address, leading and stride
// byte offsets; bits 62-63 = 1 selects the 128-byte swizzle.
//   K-major operand: rows of 64 16-bit values (128 bytes); stride = 1024 (8 rows), leading unused.
//   MN-major operand: leading = bytes between 64-value panels along MN, stride = 1024 (8 k rows).
__device__ __forceinline__ unsigned long long smem_descriptor_sw128(unsigned address, unsigned leading_bytes,
                                                                    unsigned stride_bytes) {
  return static_cast<unsigned long long>((address & 0x3FFFF) >> 4) |
         static_cast<unsigned long long>((leading_bytes >> 4) & 0x3FFF) << 16 |
         static_cast<unsigned long long>((stride_bytes >> 4) & 0x3FFF) << 32 | 1ull << 62;
}

// The descriptor of a tile `bytes` further on (the start address is its low field, in 16-byte
// units; shared addresses stay far below its 14-bit limit).
__device__ __forceinline__ unsigned long long smem_descriptor_advance(unsigned long long descriptor, unsigned bytes) {
  return descriptor + (bytes >> 4);
}

// Makes a value opaque to the optimiser, so that the descriptors derived from it are recomputed
// (one add each) where they are used instead of being hoisted out of the key loop and held in
// registers that the accumulators need.
__device__ __forceinline__ void launder(unsigned long long& value) { asm volatile("" : "+l"(value)); }

// The wgmma instructions themselves are rendered per spec into Config (codegen/src/wgmma.cpp):
// each tile width N needs its own asm statement of N / 2 accumulator operands.

// ---------------------------------------------------------------------------------------------
// Global memory outside TMA.

// Prefetches the 16-byte-aligned part of [begin, end) into L2 (one bulk request, no completion
// to wait for).
__device__ __forceinline__ void prefetch_l2(const void* begin, const void* end) {
  const unsigned long long first = (reinterpret_cast<unsigned long long>(begin) + 15) & ~15ull;
  const unsigned long long last = reinterpret_cast<unsigned long long>(end) & ~15ull;
  if (last > first)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(first), "r"(unsigned(last - first)) : "memory");
}

// Predicated loads and stores: one instruction stream for every lane, the predicate on the
// access. Inside the consumers' key loop a per-lane branch around a global access makes ptxas move
// the loop's uniform values (stages, descriptors) out of the uniform registers: a continuing tile's
// epilogue written with branches cost sm90_fwd 12% more instructions per key block. (The loads are
// not volatile, so that a row's loads may all issue before its first store: each store's value
// depends on its own load.)
__device__ __forceinline__ float load_global_if(bool pred, const float* address, float otherwise) {
  float value = otherwise;
  asm("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p ld.global.f32 %0, [%2];\n}\n"
      : "+f"(value) : "r"(int(pred)), "l"(address));
  return value;
}
__device__ __forceinline__ float2 load_global_pair_if(bool pred, const float* address) {
  float2 value = make_float2(0.f, 0.f);
  asm("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p ld.global.v2.f32 {%0, %1}, [%3];\n}\n"
      : "+f"(value.x), "+f"(value.y) : "r"(int(pred)), "l"(address));
  return value;
}
__device__ __forceinline__ void store_global_if(bool pred, float* address, float value) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p st.global.f32 [%1], %2;\n}\n"
               ::"r"(int(pred)), "l"(address), "f"(value) : "memory");
}
__device__ __forceinline__ void store_global_pair_if(bool pred, float* address, float2 value) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p st.global.v2.f32 [%1], {%2, %3};\n}\n"
               ::"r"(int(pred)), "l"(address), "f"(value.x), "f"(value.y) : "memory");
}
__device__ __forceinline__ void store_global_u32_if(bool pred, void* address, unsigned value) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p st.global.b32 [%1], %2;\n}\n"
               ::"r"(int(pred)), "l"(address), "r"(value) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Named barriers (ids 1..15; 0 is __syncthreads) between warpgroups.

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (the runtime's StreamOrder::overlapping_tail): the stream's next
// kernel may start once every CTA of this one has signalled; there it waits for this grid to
// complete and its writes to be visible. Without such a launch the wait returns at once.

__device__ __forceinline__ void allow_dependent_launch() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void wait_for_prerequisite_grids() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// ---------------------------------------------------------------------------------------------
// Thread-block clusters (a launch with the runtime's Grid::cluster_x > 1): the CTAs of a cluster
// read each other's shared memory between cluster-wide barriers. Without a cluster launch every CTA
// is a cluster of one.

__device__ __forceinline__ unsigned cluster_cta_rank() {
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}
// Every thread of every CTA of the cluster arrives; shared-memory writes before it are visible to
// the cluster's reads after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Shared-memory address `smem` (this CTA's, as from shared_address()) in CTA `rank` of the cluster.
__device__ __forceinline__ unsigned cluster_shared_address(unsigned smem, unsigned rank) {
  unsigned address;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(address) : "r"(smem), "r"(rank));
  return address;
}
__device__ __forceinline__ float load_cluster_f32(unsigned address) {
  float value;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(value) : "r"(address) : "memory");
  return value;
}
__device__ __forceinline__ float4 load_cluster_f32x4(unsigned address) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(address)
               : "memory");
  return v;
}

// ---------------------------------------------------------------------------------------------
// Register reallocation between warpgroups (producer gives registers to the consumers).

template <int kRegisters>
__device__ __forceinline__ void registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// ---------------------------------------------------------------------------------------------
// Keeping ptxas's view of the code warp-uniform, and wgmma operands in place.

// threadIdx.x read afresh where it is used: a volatile read is neither hoisted nor kept live, so
// code on a cold path (a per-tile epilogue) derives its thread coordinates there instead of
// holding them in registers (or spilling them) across the hot loop.
__device__ __forceinline__ int fresh_thread_index() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  return tid;
}

// `value` as lane 0 has it: the same in every lane, and visibly so to ptxas, which serializes a
// wgmma on a path it cannot prove warp-uniform (warning C7520).
__device__ __forceinline__ int warp_uniform(int value) { return __shfl_sync(0xffffffffu, value, 0); }

// Keeps the compiler from moving reads or writes of wgmma operands across the asynchronous MMA
// (it cannot see that the hardware still reads or writes them until wgmma.wait_group).
template <int kN>
__device__ __forceinline__ void fence_operands(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int kRows, int kN>
__device__ __forceinline__ void fence_operands(unsigned (&r)[kRows][kN]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int j = 0; j < kN; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

}  // namespace flashjit::kernels
