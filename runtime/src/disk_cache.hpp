// The on-disk kernel cache. Layout, under a root directory the user owns (mode 0700):
//   <root>/<arch>/<spec-name>-<key16>/{kernel.cubin, meta.json, kernel.cu}   published entries
//   <root>/<arch>/.staging/     entries being written (renamed into place when complete)
//   <root>/<arch>/.locks/       one lock file per key: a cold miss compiles once across processes
//   <root>/<arch>/.quarantine/  entries that failed verification, kept for inspection
// An entry appears by rename(2) of a fully written and fsynced directory, so readers see either
// nothing or a whole entry; meta.json carries the full key and the cubin's checksum, and a reader
// that finds a mismatch quarantines the entry and compiles again.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "flashjit/kernel_cache.hpp"

namespace flashjit::detail {

struct DiskKey {
  Arch arch;
  std::string spec_name;
  std::string key;  // full hex hash
  std::string entry_name() const { return spec_name + "-" + key.substr(0, 16); }
};

class DiskCache {
 public:
  static constexpr int kFormatVersion = 2;  // 2: the cubin checksum covers the key

  // Creates root (0700) if missing; throws Error(cache_error) if it is not a directory, not owned
  // by this user, writable by group or others, or not writable.
  DiskCache(std::string root, int lock_timeout_ms);

  // The verified entry, or nullopt. A damaged entry is quarantined (and counted) first.
  std::optional<CompiledKernel> load(const DiskKey& key, const KernelSpec& spec);

  // load(), else under the key's lock: load() again, compile(), publish. `source_text` is stored
  // beside the cubin for people reading the cache.
  CompiledKernel load_or_compile(const DiskKey& key, const KernelSpec& spec,
                                 const std::string& source_text,
                                 const std::function<CompiledKernel()>& compile);

  std::string entry_path(const DiskKey& key) const;
  const std::string& root() const { return root_; }
  uint64_t quarantined() const { return quarantined_; }

 private:
  std::string arch_dir(const Arch& arch);  // creates it and its service dirs on first use
  // Whether the entry is on disk afterwards (written, or another process's is there); warns when not.
  bool publish(const DiskKey& key, const CompiledKernel& kernel, const std::string& source_text);
  void quarantine(const DiskKey& key, const std::string& reason);

  std::string root_;
  int lock_timeout_ms_;
  std::atomic<uint64_t> quarantined_{0};
  // The arch directories prepared so far. (Members, not statics: a background compile that a
  // destructor joins at exit may still use them.)
  std::mutex prepared_mutex_;
  std::set<std::string> prepared_;
};

// Throws Error(cache_error) unless `dir` exists (created 0700 if missing), is a directory owned
// by the effective user, is not writable by group or others, and is writable.
void ensure_private_directory(const std::string& dir);

}  // namespace flashjit::detail
