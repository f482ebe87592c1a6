#include "flashjit/kernel_cache.hpp"

#include <future>
#include <mutex>
#include <optional>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "compiler.hpp"
#include "disk_cache.hpp"
#include "env.hpp"
#include "flashjit/codegen/render.hpp"
#include "flashjit/error.hpp"
#include "hashing.hpp"

namespace flashjit {

using detail::DiskCache;
using detail::DiskKey;

bool CompiledKernel::has_spills() const {
  for (const auto& e : entries)
    if (e.spill_store_bytes > 0 || e.spill_load_bytes > 0) return true;
  return false;
}

const EntryStats* CompiledKernel::stats(const std::string& entry_name) const {
  for (const auto& e : entries)
    if (e.name == entry_name) return &e;
  return nullptr;
}

CacheConfig CacheConfig::from_environment() {
  const auto& env = detail::environment();
  CacheConfig config;
  if (!env.disable_disk_cache) config.directory = detail::default_cache_dir();
  config.lock_timeout_ms = env.lock_timeout_ms;
  return config;
}

namespace {

// Everything that shapes the cubin, and nothing else (no paths, no times).
std::string cache_key(const Source& source, const Arch& arch) {
  detail::Hasher hasher;
  hasher.add(fmt::format("flashjit-cache-format-{}", DiskCache::kFormatVersion))
      .add(nvrtc_version())
      .add(arch.name())
      .add(fmt::format("{}", fmt::join(detail::compile_options(arch), " ")))
      .add(template_bundle().hash)
      .add(source.text);
  return hasher.hex();
}

}  // namespace

struct KernelCache::Impl {
  using Future = std::shared_future<std::shared_ptr<const CompiledKernel>>;

  CacheConfig config;
  std::optional<DiskCache> disk;
  std::mutex mutex;
  std::unordered_map<KernelSpec, Future, KernelSpecHash> entries;
  std::atomic<uint64_t> memory_hits{0}, disk_hits{0}, compiles{0};

  CompiledKernel compile(const KernelSpec& spec, const Source& source, const std::string& key) {
    detail::CompileOutput out = detail::compile_source(source, spec.arch);
    ++compiles;
    CompiledKernel kernel;
    kernel.spec = spec;
    kernel.cache_key = key;
    kernel.cubin = std::move(out.cubin);
    kernel.entries = std::move(out.entries);
    kernel.entry_names = source.entry_names;
    kernel.compile_ms = out.compile_ms;
    kernel.log = std::move(out.log);
    return kernel;
  }

  std::shared_ptr<const CompiledKernel> produce(const KernelSpec& spec) {
    const Source source = render(spec);
    const std::string key = cache_key(source, spec.arch);
    if (!disk) return std::make_shared<const CompiledKernel>(compile(spec, source, key));
    DiskKey disk_key{spec.arch, source.spec_name, key};
    CompiledKernel kernel = disk->load_or_compile(
        disk_key, spec, source.text, [&] { return compile(spec, source, key); });
    if (kernel.from_disk) ++disk_hits;
    return std::make_shared<const CompiledKernel>(std::move(kernel));
  }
};

KernelCache::KernelCache(CacheConfig config) : impl_(std::make_unique<Impl>()) {
  impl_->config = std::move(config);
  if (!impl_->config.directory.empty())
    impl_->disk.emplace(impl_->config.directory, impl_->config.lock_timeout_ms);
}

KernelCache::~KernelCache() = default;

std::shared_ptr<const CompiledKernel> KernelCache::get(const KernelSpec& spec) {
  Impl::Future future;
  std::promise<std::shared_ptr<const CompiledKernel>> promise;
  bool producer = false;  // the first caller for a spec produces it; the others wait on its future
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    auto it = impl_->entries.find(spec);
    if (it != impl_->entries.end()) {
      ++impl_->memory_hits;
      future = it->second;
    } else {
      producer = true;
      future = promise.get_future().share();
      impl_->entries.emplace(spec, future);
    }
  }
  if (producer) {
    try {
      promise.set_value(impl_->produce(spec));
    } catch (...) {
      promise.set_exception(std::current_exception());
      std::lock_guard<std::mutex> lock(impl_->mutex);
      impl_->entries.erase(spec);  // a later call may succeed (e.g. after a transient I/O error)
    }
  }
  return future.get();
}

std::shared_ptr<const CompiledKernel> KernelCache::find_on_disk(const KernelSpec& spec) {
  if (!impl_->disk) return nullptr;
  const Source source = render(spec);
  DiskKey key{spec.arch, source.spec_name, cache_key(source, spec.arch)};
  auto kernel = impl_->disk->load(key, spec);
  return kernel ? std::make_shared<const CompiledKernel>(std::move(*kernel)) : nullptr;
}

CacheStats KernelCache::stats() const {
  CacheStats s;
  s.memory_hits = impl_->memory_hits;
  s.disk_hits = impl_->disk_hits;
  s.compiles = impl_->compiles;
  s.quarantined = impl_->disk ? impl_->disk->quarantined() : 0;
  return s;
}

const CacheConfig& KernelCache::config() const { return impl_->config; }

}  // namespace flashjit
