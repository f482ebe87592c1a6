// Compiled kernels: KernelSpec -> cubin, through an in-memory map, the disk cache and NVRTC.
// Needs no GPU (flashjit-warm fills a cache on a build machine); loading and launching live in the
// runtime proper.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flashjit/codegen/kernel_spec.hpp"

namespace flashjit {

// What ptxas reported for one entry point.
struct EntryStats {
  std::string name;
  int registers = 0;
  int barriers = 0;
  int static_smem_bytes = 0;
  int stack_frame_bytes = 0;
  int spill_store_bytes = 0;
  int spill_load_bytes = 0;
};

struct CompiledKernel {
  KernelSpec spec;
  std::string cache_key;  // hex hash of everything that shapes the cubin
  std::string cubin;      // the image, bytes
  std::vector<EntryStats> entries;
  std::vector<std::string> entry_names;
  double compile_ms = 0;  // NVRTC time when it was compiled (read back from disk on a disk hit)
  std::string log;        // NVRTC log, ptxas report included
  bool from_disk = false;
  std::string disk_entry;  // the cache entry directory; empty when the disk cache is off

  bool has_spills() const;
  const EntryStats* stats(const std::string& entry_name) const;
};

struct CacheConfig {
  std::string directory;  // empty: memory only
  int lock_timeout_ms = 120000;

  // FLASHJIT_CACHE_DIR (or the XDG default) unless FLASHJIT_DISABLE_DISK_CACHE=1.
  static CacheConfig from_environment();
};

struct CacheStats {
  uint64_t memory_hits = 0;
  uint64_t disk_hits = 0;
  uint64_t compiles = 0;
  uint64_t quarantined = 0;  // disk entries found damaged and moved aside
};

class KernelCache {
 public:
  // Creates the directory (0700) if needed; throws Error(cache_error) when it is owned by another
  // user, writable by group or others, or not writable.
  explicit KernelCache(CacheConfig config);
  ~KernelCache();
  KernelCache(const KernelCache&) = delete;
  KernelCache& operator=(const KernelCache&) = delete;

  // Thread safe; concurrent calls for one spec compile it once. Throws Error(invalid_argument)
  // for an illegal spec and Error(compile_failed) quoting the NVRTC log.
  std::shared_ptr<const CompiledKernel> get(const KernelSpec& spec);

  // Starts producing `spec` (from disk, or compiled) on the cache's background thread unless it is
  // in memory or on its way, and returns at once; get() then waits for it instead of compiling it
  // again. For kernels a call is about to need, compiled beside the one it waits for (the
  // backward's, when a forward under autograd compiles). A spec that fails is dropped, and get()
  // compiles it again to throw its error where it is needed; an illegal spec throws here.
  void prefetch(const KernelSpec& spec);

  // Looks on disk only: the verified entry, or nullptr (damaged entries are quarantined).
  std::shared_ptr<const CompiledKernel> find_on_disk(const KernelSpec& spec);

  CacheStats stats() const;
  const CacheConfig& config() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The NVRTC version as "major.minor", and whether NVRTC can compile for an arch.
std::string nvrtc_version();
bool nvrtc_supports(const Arch& arch);

}  // namespace flashjit
