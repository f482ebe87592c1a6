// runtime/driver side of the cache: cubins loaded as context-independent CUlibrary objects, with
// each entry's launch attributes set once per device. Lookups by spec are the hot path of every
// call, so they hash the spec's fields, never the source.
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "driver.hpp"
#include "flashjit/device.hpp"
#include "flashjit/codegen/render.hpp"
#include "flashjit/kernel_cache.hpp"

namespace flashjit::detail {

// The most CTAs of one thread-block cluster (Hopper's non-portable limit).
constexpr int kMaxClusterCtas = 16;

// The dynamic shared memory a launch of `entry` in clusters asks for: enough that one CTA fills an
// SM. The cluster scheduler otherwise packs a cluster's CTAs two to an SM of one GPC, and a decode
// split streams through its SM's share of the L2: 16 splits at batch 1 x 64k read 3.45 TB/s packed,
// the same as 8 (H200, bench/results/decode_splits_h200_cluster_packed.json).
int cluster_launch_smem_bytes(const KernelEntry& entry, const DeviceProperties& device);

struct LoadedKernel {
  std::shared_ptr<const CompiledKernel> compiled;
  CUlibrary library = nullptr;
  KernelLayout layout;                 // threads, entries' shared memory, the rendered constants
  std::vector<CUkernel> entries;       // in layout.entries' order
  std::atomic<uint64_t> configured_devices{0};  // bit d: attributes set for device d
  // [entry][device & 63]: the CTAs of that entry one SM of the device holds at once (the driver's
  // occupancy for its threads and shared memory), read when the attributes are set.
  std::vector<std::array<std::atomic<int>, 64>> resident_ctas_per_sm;
  // [entry][device & 63][s]: the thread-block clusters of s CTAs along x, one CTA per SM, the device
  // holds of that entry at once, for s up to its layout's max_cluster_ctas (0 elsewhere), read
  // likewise.
  std::vector<std::array<std::array<std::atomic<int>, kMaxClusterCtas + 1>, 64>> clusters_per_device;

  int resident_ctas(std::string_view entry, int device) const {
    return resident_ctas_per_sm[layout.entry_index(entry)][device & 63].load(std::memory_order_relaxed);
  }
  // [s]: the clusters of s CTAs (one per SM) the device holds of `entry` at once.
  std::array<int, kMaxClusterCtas + 1> clusters_at_once(std::string_view entry, int device) const {
    const auto& counts = clusters_per_device[layout.entry_index(entry)][device & 63];
    std::array<int, kMaxClusterCtas + 1> at_once{};
    for (int s = 0; s <= kMaxClusterCtas; ++s) at_once[s] = counts[s].load(std::memory_order_relaxed);
    return at_once;
  }

  ~LoadedKernel();
};

// Throws Error(out_of_resources) when an entry's static shared memory and the dynamic shared memory
// it is launched with exceed what `device` allows a block (ptxas' static figure comes from the
// compiled kernel's stats).
void check_shared_memory(const CompiledKernel& kernel, const KernelLayout& layout, const DeviceProperties& device);

class ModuleCache {
 public:
  explicit ModuleCache(KernelCache& kernels) : kernels_(kernels) {}

  // Compiles or loads on first use; sets the dynamic smem limit for `device` on first use there.
  const LoadedKernel& get(const KernelSpec& spec, const DeviceProperties& device);
  // Whether `spec` is loaded (get() then neither compiles nor reads the disk).
  bool contains(const KernelSpec& spec);

 private:
  KernelCache& kernels_;
  std::mutex mutex_;
  std::unordered_map<KernelSpec, std::shared_ptr<LoadedKernel>, KernelSpecHash> loaded_;
};

// Makes the device's primary context current unless a context of that device already is.
void make_context_current(int device);

// make_context_current for the length of one call: where the caller had another device's context
// current, it is current again afterwards (the CUDA runtime, PyTorch's included, takes its
// current device from it).
class DeviceContextScope {
 public:
  explicit DeviceContextScope(int device);
  ~DeviceContextScope();
  DeviceContextScope(const DeviceContextScope&) = delete;
  DeviceContextScope& operator=(const DeviceContextScope&) = delete;

 private:
  bool pushed_ = false;
};

}  // namespace flashjit::detail
