#include "module_cache.hpp"

#include <fmt/format.h>

#include "flashjit/codegen/render.hpp"
#include "env.hpp"
#include "flashjit/error.hpp"

namespace flashjit::detail {

LoadedKernel::~LoadedKernel() {
  // At process exit the driver may already be torn down; unloading is then best effort.
  if (library != nullptr && driver_available()) driver().cuLibraryUnload(library);
}

void check_shared_memory(const CompiledKernel& kernel, const KernelLayout& layout, const DeviceProperties& device) {
  // Per entry: a module's entries differ (sm90_fwd's V transpose has static shared memory, its
  // forward dynamic; the sum of the two is no launch's).
  for (const KernelEntry& entry : layout.entries) {
    const EntryStats* stats = kernel.stats(entry.symbol);
    const int static_bytes = stats != nullptr ? stats->static_smem_bytes : 0;
    const int total = static_bytes + entry.dynamic_smem_bytes;
    if (total > device.max_smem_per_block_optin)
      throw Error(ErrorCode::out_of_resources, "launch",
                  fmt::format("kernel {} (entry {}) needs {} bytes of shared memory per block ({} static + {} "
                              "dynamic), but device {} ({}) allows {}",
                              kernel.spec.name(), entry.name, total, static_bytes, entry.dynamic_smem_bytes,
                              device.ordinal, device.name, device.max_smem_per_block_optin));
  }
}

int cluster_launch_smem_bytes(const KernelEntry& entry, const DeviceProperties& device) {
  return std::max(entry.dynamic_smem_bytes, device.smem_per_sm / 2 + 1024);  // 1 KB: what the SM reserves per CTA
}

namespace {

// For each cluster size s up to what codegen allows the entry (sizes over 8 are non-portable: the
// entry is allowed them first), the clusters of s CTAs the device holds at once, launched one CTA
// per SM (cluster_launch_smem_bytes); 0 where the entry or the device has no clusters.
void count_clusters(CUkernel entry, CUfunction function, const KernelLayout& layout, size_t index,
                    const KernelSpec& spec, const DeviceProperties& device, CUdevice cu_device,
                    std::array<std::atomic<int>, kMaxClusterCtas + 1>& clusters_at_once) {
  const int most = std::min(kMaxClusterCtas, layout.entries[index].max_cluster_ctas);
  if (most < 2 || device.cc_major < 9 || spec.arch.sm < 90) return;
  if (most > 8)
    FLASHJIT_CU(cuKernelSetAttribute, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1, entry, cu_device);
  for (int size = 2; size <= most; ++size) {
    CUlaunchAttribute cluster{};
    cluster.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    cluster.value.clusterDim.x = static_cast<unsigned>(size);
    cluster.value.clusterDim.y = cluster.value.clusterDim.z = 1;
    CUlaunchConfig config{};
    config.gridDimX = static_cast<unsigned>(size);
    config.gridDimY = config.gridDimZ = 1;
    config.blockDimX = static_cast<unsigned>(layout.threads);
    config.blockDimY = config.blockDimZ = 1;
    config.sharedMemBytes = static_cast<unsigned>(cluster_launch_smem_bytes(layout.entries[index], device));
    config.attrs = &cluster;
    config.numAttrs = 1;
    int clusters = 0;
    // A size the device cannot hold at all is an error here rather than a count of 0.
    if (driver().cuOccupancyMaxActiveClusters(&clusters, function, &config) != CUDA_SUCCESS) clusters = 0;
    clusters_at_once[size].store(clusters, std::memory_order_relaxed);
    if (environment().verbose)
      fmt::print(stderr, "flashjit: {} {} on device {}: {} clusters of {} CTAs at once\n", spec.name(),
                 layout.entries[index].name, device.ordinal, clusters, size);
  }
}

}  // namespace

bool ModuleCache::contains(const KernelSpec& spec) {
  std::lock_guard<std::mutex> lock(mutex_);
  return loaded_.count(spec) != 0;
}

const LoadedKernel& ModuleCache::get(const KernelSpec& spec, const DeviceProperties& device) {
  std::shared_ptr<LoadedKernel> kernel;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = loaded_.find(spec);
    if (it != loaded_.end()) kernel = it->second;
  }
  if (!kernel) {
    // Compile (or read from disk) outside the lock: KernelCache already makes that once per spec.
    auto compiled = kernels_.get(spec);
    auto fresh = std::make_shared<LoadedKernel>();
    fresh->compiled = compiled;
    fresh->layout = kernel_layout(spec);
    fresh->resident_ctas_per_sm = std::vector<std::array<std::atomic<int>, 64>>(fresh->layout.entries.size());
    fresh->clusters_per_device =
        std::vector<std::array<std::array<std::atomic<int>, kMaxClusterCtas + 1>, 64>>(fresh->layout.entries.size());
    FLASHJIT_CU(cuLibraryLoadData, &fresh->library, compiled->cubin.data(), nullptr, nullptr, 0,
                nullptr, nullptr, 0);
    for (const auto& name : compiled->entry_names) {
      CUkernel entry = nullptr;
      FLASHJIT_CU(cuLibraryGetKernel, &entry, fresh->library, name.c_str());
      fresh->entries.push_back(entry);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    auto [it, inserted] = loaded_.emplace(spec, fresh);
    kernel = it->second;  // another thread may have won; its copy is identical
  }
  const uint64_t bit = uint64_t{1} << (device.ordinal & 63);
  if ((kernel->configured_devices.load(std::memory_order_acquire) & bit) == 0) {
    check_shared_memory(*kernel->compiled, kernel->layout, device);
    CUdevice cu_device;
    FLASHJIT_CU(cuDeviceGet, &cu_device, device.ordinal);
    for (size_t i = 0; i < kernel->entries.size(); ++i) {
      // What the entry is launched with; entries launched in clusters may ask for more
      // (cluster_launch_smem_bytes).
      const KernelEntry& entry = kernel->layout.entries[i];
      const int smem_limit =
          entry.max_cluster_ctas > 1 ? cluster_launch_smem_bytes(entry, device) : entry.dynamic_smem_bytes;
      FLASHJIT_CU(cuKernelSetAttribute, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_limit,
                  kernel->entries[i], cu_device);
      // Left to itself the driver sizes shared memory for one resident CTA and gives the rest to
      // L1: kvcache_fwd's decode tile, built for two, ran one per SM on the H200 (ncu). Kernels
      // built for several CTAs per SM ask for all the shared memory.
      if (kernel->layout.min_blocks_per_sm > 1 && kernel->layout.entries[i].dynamic_smem_bytes > 0)
        FLASHJIT_CU(cuKernelSetAttribute, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                    CU_SHAREDMEM_CARVEOUT_MAX_SHARED, kernel->entries[i], cu_device);
      CUfunction function = nullptr;
      FLASHJIT_CU(cuKernelGetFunction, &function, kernel->entries[i]);
      int resident = 0;
      FLASHJIT_CU(cuOccupancyMaxActiveBlocksPerMultiprocessor, &resident, function, kernel->layout.threads,
                  static_cast<size_t>(kernel->layout.entries[i].dynamic_smem_bytes));
      kernel->resident_ctas_per_sm[i][device.ordinal & 63].store(resident, std::memory_order_relaxed);
      count_clusters(kernel->entries[i], function, kernel->layout, i, spec, device, cu_device,
                     kernel->clusters_per_device[i][device.ordinal & 63]);
    }
    kernel->configured_devices.fetch_or(bit, std::memory_order_release);
  }
  return *kernel;
}

namespace {

// Whether the current context is `device`'s, none, or another device's (and `device`'s CUdevice).
enum class CurrentContext { of_device, none, other_device };
CurrentContext current_context(int device, CUdevice& cu_device) {
  const DriverApi& api = driver();
  CUcontext current = nullptr;
  FLASHJIT_CU(cuCtxGetCurrent, &current);
  FLASHJIT_CU(cuDeviceGet, &cu_device, device);
  if (current == nullptr) return CurrentContext::none;
  CUdevice current_device;
  if (api.cuCtxGetDevice(&current_device) == CUDA_SUCCESS && current_device == cu_device)
    return CurrentContext::of_device;
  return CurrentContext::other_device;
}

// Retained once per device and held for the life of the process (as the runtime API does).
CUcontext primary_context(CUdevice cu_device) {
  static std::mutex mutex;
  static std::unordered_map<CUdevice, CUcontext> primary_contexts;
  std::lock_guard<std::mutex> lock(mutex);
  CUcontext& slot = primary_contexts[cu_device];
  if (slot == nullptr) FLASHJIT_CU(cuDevicePrimaryCtxRetain, &slot, cu_device);
  return slot;
}

}  // namespace

void make_context_current(int device) {
  CUdevice cu_device;
  if (current_context(device, cu_device) != CurrentContext::of_device)
    FLASHJIT_CU(cuCtxSetCurrent, primary_context(cu_device));
}

DeviceContextScope::DeviceContextScope(int device) {
  CUdevice cu_device;
  switch (current_context(device, cu_device)) {
    case CurrentContext::of_device: return;
    case CurrentContext::none: FLASHJIT_CU(cuCtxSetCurrent, primary_context(cu_device)); return;
    case CurrentContext::other_device:
      FLASHJIT_CU(cuCtxPushCurrent, primary_context(cu_device));
      pushed_ = true;
  }
}

DeviceContextScope::~DeviceContextScope() {
  CUcontext popped = nullptr;
  if (pushed_ && driver_available()) driver().cuCtxPopCurrent(&popped);
}

}  // namespace flashjit::detail
