#include "flashjit/kernel_cache.hpp"

#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
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
  using Kernel = std::shared_ptr<const CompiledKernel>;
  using Future = std::shared_future<Kernel>;

  CacheConfig config;
  std::optional<DiskCache> disk;
  std::mutex mutex;
  std::unordered_map<KernelSpec, Future, KernelSpecHash> entries;
  std::atomic<uint64_t> memory_hits{0}, disk_hits{0}, compiles{0};

  // Background compiles (prefetch): one thread, started by the first, takes them in order; the
  // destructor lets it finish the one under way and drops the rest. Guarded by `mutex`. A process
  // forked from this one has no such thread (worker_pid is not its pid): there prefetch queues
  // nothing and the destructor leaves the parent's worker alone.
  struct Job {
    KernelSpec spec;
    Source source;
    std::promise<Kernel> promise;
  };
  std::deque<Job> jobs;
  std::condition_variable job_queued;
  bool stopping = false;
  std::thread worker;
  std::atomic<pid_t> worker_pid{0};  // (read before the lock: a forked child's copy may be held)
  bool forked() const {
    const pid_t pid = worker_pid.load();
    return pid != 0 && pid != ::getpid();
  }

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

  Kernel produce(const KernelSpec& spec, const Source& source) {
    const std::string key = cache_key(source, spec.arch);
    if (!disk) return std::make_shared<const CompiledKernel>(compile(spec, source, key));
    DiskKey disk_key{spec.arch, source.spec_name, key};
    CompiledKernel kernel = disk->load_or_compile(
        disk_key, spec, source.text, [&] { return compile(spec, source, key); });
    if (kernel.from_disk) ++disk_hits;
    return std::make_shared<const CompiledKernel>(std::move(kernel));
  }

  // Produces the spec that `promise` stands for in `entries`; never throws.
  void fulfil(const KernelSpec& spec, const Source& source, std::promise<Kernel>& promise) {
    try {
      promise.set_value(produce(spec, source));
    } catch (...) {
      fail(spec, promise);
    }
  }

  // From a catch block: the waiters get the error, and the entry goes, so that a later call tries
  // again (after a transient I/O error, say).
  void fail(const KernelSpec& spec, std::promise<Kernel>& promise) {
    promise.set_exception(std::current_exception());
    std::lock_guard<std::mutex> lock(mutex);
    entries.erase(spec);
  }

  void run_jobs() {
    for (;;) {
      std::unique_lock<std::mutex> lock(mutex);
      job_queued.wait(lock, [&] { return stopping || !jobs.empty(); });
      if (stopping) return;
      Job job = std::move(jobs.front());
      jobs.pop_front();
      lock.unlock();
      if (detail::environment().verbose)
        fmt::print(stderr, "flashjit: compiling {} in the background\n", job.spec.name());
      fulfil(job.spec, job.source, job.promise);
    }
  }
};

KernelCache::KernelCache(CacheConfig config) : impl_(std::make_unique<Impl>()) {
  detail::construct_compiler_statics();  // before this cache exists: they outlive its worker
  impl_->config = std::move(config);
  if (!impl_->config.directory.empty())
    impl_->disk.emplace(impl_->config.directory, impl_->config.lock_timeout_ms);
}

KernelCache::~KernelCache() {
  if (impl_->forked()) {
    // A forked child's copy: the worker, its lock and its condition variable are the parent's, and
    // destroying them here could wait forever (for a waiter that is not in this process). The child
    // leaves the cache undestroyed.
    (void)impl_.release();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stopping = true;
  }
  impl_->job_queued.notify_all();
  if (impl_->worker.joinable()) impl_->worker.join();
}

std::shared_ptr<const CompiledKernel> KernelCache::get(const KernelSpec& spec) {
  Impl::Future future;
  std::promise<Impl::Kernel> promise;
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
      const Source source = render(spec);
      impl_->fulfil(spec, source, promise);
    } catch (...) {  // (from render: fulfil does not throw)
      impl_->fail(spec, promise);
    }
  }
  return future.get();
}

void KernelCache::prefetch(const KernelSpec& spec) {
  if (impl_->forked()) return;  // no worker here
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (impl_->entries.count(spec) != 0) return;
  }
  Source source = render(spec);  // (here: an illegal spec throws to the caller)
  std::lock_guard<std::mutex> lock(impl_->mutex);
  if (impl_->stopping || impl_->entries.count(spec) != 0) return;
  Impl::Job job{spec, std::move(source), {}};
  impl_->entries.emplace(spec, job.promise.get_future().share());
  impl_->jobs.push_back(std::move(job));
  if (!impl_->worker.joinable()) {
    impl_->worker = std::thread([this] { impl_->run_jobs(); });
    impl_->worker_pid = ::getpid();
  }
  impl_->job_queued.notify_one();
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
