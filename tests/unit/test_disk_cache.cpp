// The kernel cache's background compiles (prefetch), and the disk cache: publish and reuse,
// damaged entries, permissions, and many processes at once (including ones killed mid-compile).
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "disk_cache.hpp"
#include "flashjit/codegen/modifier.hpp"
#include "flashjit/error.hpp"
#include "flashjit/kernel_cache.hpp"
#include "support/subprocess.hpp"
#include "support/temp_dir.hpp"
#include "support/worker_specs.hpp"

using namespace flashjit;
using flashjit::test::Subprocess;
using flashjit::test::TempDir;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

CacheConfig on_disk(const std::string& dir) {
  CacheConfig c;
  c.directory = dir;
  return c;
}

KernelSpec small_spec() {
  return default_spec(Family::reference_fwd, Arch::parse("sm_80"), DType::bf16, 64);
}

// Published entries of one arch (service dirs start with '.').
std::vector<fs::path> entries_of(const std::string& root, const char* arch = "sm_80") {
  std::vector<fs::path> entries;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root + "/" + arch, ec))
    if (e.path().filename().string()[0] != '.') entries.push_back(e.path());
  return entries;
}

size_t count_in(const std::string& dir) {
  std::error_code ec;
  size_t n = 0;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); ++it) ++n;
  return n;
}

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

json run_worker(const std::string& dir, int first, int count) {
  Subprocess worker({FLASHJIT_CACHE_WORKER, dir, std::to_string(first), std::to_string(count)});
  const int status = worker.wait();
  INFO(worker.output());
  REQUIRE(status == 0);
  return json::parse(worker.output());
}

}  // namespace

TEST_CASE("a cold miss compiles and publishes an entry that the next cache reuses", "[cache]") {
  TempDir dir;
  const KernelSpec spec = small_spec();
  std::string cubin;
  {
    KernelCache cache(on_disk(dir.path()));
    auto kernel = cache.get(spec);
    CHECK_FALSE(kernel->from_disk);
    CHECK(cache.stats().compiles == 1);
    cubin = kernel->cubin;
    const auto entries = entries_of(dir.path());
    REQUIRE(entries.size() == 1);
    CHECK(entries[0].filename().string().rfind(spec.name() + "-", 0) == 0);
    CHECK(entries[0].string() == kernel->disk_entry);
    for (const char* file : {"kernel.cubin", "meta.json", "kernel.cu"})
      CHECK(fs::exists(entries[0] / file));
    CHECK(slurp(entries[0] / "kernel.cubin") == cubin);
    const json meta = json::parse(slurp(entries[0] / "meta.json"));
    CHECK(meta.at("key") == kernel->cache_key);
    CHECK(KernelSpec::from_json(meta.at("spec")) == spec);
    CHECK(meta.at("cubin_bytes") == cubin.size());
    CHECK(meta.at("entries").at(0).at("registers").get<int>() > 0);
    // Same spec again in this process: the memory map answers.
    CHECK(cache.get(spec) == kernel);
    CHECK(cache.stats().memory_hits == 1);
  }
  KernelCache second(on_disk(dir.path()));
  auto again = second.get(spec);
  CHECK(again->from_disk);
  CHECK(again->cubin == cubin);
  CHECK(second.stats().disk_hits == 1);
  CHECK(second.stats().compiles == 0);
}

TEST_CASE("a second process finds the kernel in the disk cache", "[cache]") {
  TempDir dir;
  const json first = run_worker(dir.path(), 0, 1);
  CHECK(first.at("compiles") == 1);
  const json second = run_worker(dir.path(), 0, 1);
  CHECK(second.at("compiles") == 0);
  CHECK(second.at("disk_hits") == 1);
}

TEST_CASE("concurrent calls for one spec compile it once", "[cache]") {
  KernelCache cache(CacheConfig{});
  std::vector<std::thread> threads;
  std::vector<std::shared_ptr<const CompiledKernel>> got(16);
  for (int i = 0; i < 16; ++i) threads.emplace_back([&, i] { got[i] = cache.get(small_spec()); });
  for (auto& t : threads) t.join();
  CHECK(cache.stats().compiles == 1);
  CHECK(cache.stats().memory_hits == 15);
  for (const auto& k : got) CHECK(k == got[0]);
}

TEST_CASE("a prefetched kernel compiles once, in the background, and get() waits for it", "[cache]") {
  KernelCache cache(CacheConfig{});
  cache.prefetch(small_spec());
  cache.prefetch(small_spec());  // on its way: nothing more
  const auto kernel = cache.get(small_spec());
  CHECK(kernel->cubin.compare(0, 4, "\x7f" "ELF") == 0);
  CHECK(cache.stats().compiles == 1);
  CHECK(cache.stats().memory_hits == 1);  // get() found the prefetch's entry
  cache.prefetch(small_spec());           // in memory: nothing
  CHECK(cache.get(small_spec()) == kernel);
  CHECK(cache.stats().compiles == 1);
}

TEST_CASE("a prefetch that fails leaves the error to get(), which compiles again", "[cache]") {
  auto broken = std::make_shared<AttentionModifier>();
  broken->mask = "return q_idx >= kv_idx + undefined_name;";
  const KernelSpec spec = default_spec(Family::sm90_fwd, Arch::parse("sm_90a"), DType::bf16, 64, MaskKind::none,
                                       false, broken);
  KernelCache cache(CacheConfig{});
  cache.prefetch(spec);
  for (int attempt = 0; attempt < 2; ++attempt) {  // (the second after the failed entry is gone)
    try {
      cache.get(spec);
      FAIL("the broken modifier compiled");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::compile_failed);
      CHECK_THAT(e.what(), Catch::Contains("undefined_name"));
    }
  }
  // An illegal spec is refused by prefetch itself, as get() refuses it.
  KernelSpec illegal = small_spec();
  illegal.head_dim = 7;
  CHECK_THROWS_AS(cache.prefetch(illegal), Error);
  CHECK_THROWS_AS(cache.get(illegal), Error);
}

TEST_CASE("a cache destroyed with prefetches queued finishes the one under way and drops the rest", "[cache]") {
  TempDir dir;
  {
    KernelCache cache(on_disk(dir.path()));
    for (int head_dim : {32, 64, 96, 128})
      cache.prefetch(default_spec(Family::reference_fwd, Arch::parse("sm_80"), DType::fp16, head_dim));
  }
  // Whatever was compiled was published whole: a second cache verifies it.
  const size_t published = entries_of(dir.path()).size();
  CHECK(published <= 1);
  KernelCache after(on_disk(dir.path()));
  for (int head_dim : {32, 64, 96, 128})
    after.get(default_spec(Family::reference_fwd, Arch::parse("sm_80"), DType::fp16, head_dim));
  CHECK(after.stats().disk_hits == published);
  CHECK(after.stats().quarantined == 0);
}

// A process forked after a prefetch (fork without exec, from a process whose NVRTC may hold threads
// and locks of its own, can compile nothing reliably; CUDA refuses it the GPU) still exits normally:
// its copy of the cache neither queues for the parent's worker nor waits for it when destroyed.
TEST_CASE("a forked process's copy of the cache goes without waiting for the parent's worker", "[cache]") {
  auto cache = std::make_unique<KernelCache>(CacheConfig{});
  const KernelSpec prefetched = default_spec(Family::reference_fwd, Arch::parse("sm_80"), DType::fp16, 256);
  cache->prefetch(prefetched);
  cache->get(prefetched);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the worker back to waiting for jobs
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    cache->prefetch(default_spec(Family::reference_fwd, Arch::parse("sm_80"), DType::bf16, 32));
    cache.reset();
    ::_exit(0);
  }
  int status = 0;
  pid_t done = 0;
  for (int waited_ms = 0; waited_ms < 30000 && done == 0; waited_ms += 10) {
    done = ::waitpid(child, &status, WNOHANG);
    if (done == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (done == 0) ::kill(child, SIGKILL), ::waitpid(child, &status, 0);
  CHECK(done == child);
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  cache->prefetch(default_spec(Family::reference_fwd, Arch::parse("sm_80"), DType::fp16, 128));  // still working here
  CHECK(cache->get(default_spec(Family::reference_fwd, Arch::parse("sm_80"), DType::fp16, 128))->cubin.size() > 1000);
  CHECK(cache->stats().compiles == 2);
}

TEST_CASE("cache keys depend on the spec and nothing else", "[cache]") {
  TempDir a, b;
  KernelCache first(on_disk(a.path())), second(on_disk(b.path()));
  auto one = first.get(small_spec());
  CHECK(second.get(small_spec())->cache_key == one->cache_key);  // no paths in the key
  KernelSpec other = small_spec();
  other.dtype = DType::fp16;
  CHECK(first.get(other)->cache_key != one->cache_key);
  CHECK(one->cache_key.size() == 32);
}

TEST_CASE("damaged entries are detected, quarantined and rebuilt", "[cache]") {
  using Damage = void (*)(const fs::path& entry);
  const std::pair<const char*, Damage> damages[] = {
      {"truncated cubin",
       [](const fs::path& e) { fs::resize_file(e / "kernel.cubin", fs::file_size(e / "kernel.cubin") / 2); }},
      {"flipped byte in cubin",
       [](const fs::path& e) {
         std::fstream f(e / "kernel.cubin", std::ios::in | std::ios::out | std::ios::binary);
         f.seekg(700);
         char c;
         f.read(&c, 1);
         c ^= 0x20;
         f.seekp(700);
         f.write(&c, 1);
       }},
      {"empty cubin", [](const fs::path& e) { fs::resize_file(e / "kernel.cubin", 0); }},
      {"missing cubin", [](const fs::path& e) { fs::remove(e / "kernel.cubin"); }},
      {"garbage meta.json", [](const fs::path& e) { std::ofstream(e / "meta.json") << "{\"format\": 1, \"ke"; }},
      {"missing meta.json", [](const fs::path& e) { fs::remove(e / "meta.json"); }},
      {"meta.json a symlink to /dev/zero (an unbounded read)",
       [](const fs::path& e) {
         fs::remove(e / "meta.json");
         fs::create_symlink("/dev/zero", e / "meta.json");
       }},
      {"kernel.cubin a symlink to /dev/zero",
       [](const fs::path& e) {
         fs::remove(e / "kernel.cubin");
         fs::create_symlink("/dev/zero", e / "kernel.cubin");
       }},
      {"meta.json a FIFO (a read that would block)",
       [](const fs::path& e) {
         fs::remove(e / "meta.json");
         REQUIRE(::mkfifo((e / "meta.json").c_str(), 0600) == 0);
       }},
      {"meta.json a directory", [](const fs::path& e) {
         fs::remove(e / "meta.json");
         fs::create_directory(e / "meta.json");
       }},
      {"kernel.cubin writable by others",
       [](const fs::path& e) { fs::permissions(e / "kernel.cubin", fs::perms::others_write, fs::perm_options::add); }},
      {"the entry directory writable by group",
       [](const fs::path& e) { fs::permissions(e, fs::perms::group_write, fs::perm_options::add); }},
      {"meta.json of another key",
       [](const fs::path& e) {
         json meta = json::parse(slurp(e / "meta.json"));
         meta["key"] = std::string(32, '0');
         std::ofstream(e / "meta.json") << meta.dump();
       }},
  };
  for (const auto& [what, damage] : damages) {
    INFO(what);
    TempDir dir;
    std::string good_cubin;
    {
      KernelCache cache(on_disk(dir.path()));
      good_cubin = cache.get(small_spec())->cubin;
    }
    auto entries = entries_of(dir.path());
    REQUIRE(entries.size() == 1);
    damage(entries[0]);

    KernelCache reader(on_disk(dir.path()));
    auto kernel = reader.get(small_spec());
    CHECK(kernel->cubin == good_cubin);
    CHECK(reader.stats().quarantined == 1);
    CHECK(reader.stats().compiles == 1);
    CHECK(count_in(dir.path() + "/sm_80/.quarantine") == 1);

    KernelCache after(on_disk(dir.path()));  // the rebuilt entry verifies
    CHECK(after.get(small_spec())->from_disk);
    CHECK(after.stats().quarantined == 0);
  }
}

TEST_CASE("planted entries are never served: another spec's cubin, a symlinked entry", "[cache]") {
  const KernelSpec spec = small_spec();
  const KernelSpec other = default_spec(Family::reference_fwd, Arch::parse("sm_80"), DType::bf16, 128);
  auto entry_of = [](const std::string& root, const KernelSpec& s) {
    for (const auto& e : entries_of(root))
      if (e.filename().string().rfind(s.name() + "-", 0) == 0) return e;
    return fs::path();
  };
  TempDir dir;
  std::string good_cubin;
  {
    KernelCache cache(on_disk(dir.path()));
    good_cubin = cache.get(spec)->cubin;
    cache.get(other);
  }
  const fs::path mine = entry_of(dir.path(), spec), theirs = entry_of(dir.path(), other);
  REQUIRE_FALSE(mine.empty());
  REQUIRE_FALSE(theirs.empty());
  const std::string my_key = json::parse(slurp(mine / "meta.json"))["key"];

  SECTION("another spec's cubin and meta.json, its key edited to match the name") {
    fs::copy_file(theirs / "kernel.cubin", mine / "kernel.cubin", fs::copy_options::overwrite_existing);
    json meta = json::parse(slurp(theirs / "meta.json"));
    meta["key"] = my_key;
    std::ofstream(mine / "meta.json") << meta.dump();
  }
  SECTION("another spec's cubin with this entry's meta.json (its checksum edited to match)") {
    json meta = json::parse(slurp(mine / "meta.json"));
    const json their_meta = json::parse(slurp(theirs / "meta.json"));
    fs::copy_file(theirs / "kernel.cubin", mine / "kernel.cubin", fs::copy_options::overwrite_existing);
    meta["cubin_hash"] = their_meta["cubin_hash"];
    meta["cubin_bytes"] = their_meta["cubin_bytes"];
    std::ofstream(mine / "meta.json") << meta.dump();
  }
  SECTION("the entry replaced by a symlink to a copy outside the cache") {
    TempDir outside;
    fs::copy(mine, outside.path() + "/entry", fs::copy_options::recursive);
    fs::remove_all(mine);
    fs::create_directory_symlink(outside.path() + "/entry", mine);
  }
  KernelCache reader(on_disk(dir.path()));
  auto kernel = reader.get(spec);
  CHECK_FALSE(kernel->from_disk);
  CHECK(kernel->cubin == good_cubin);
  CHECK(reader.stats().quarantined == 1);
}

TEST_CASE("the cache's arch, staging, lock and quarantine directories must be private directories", "[cache]") {
  const std::pair<const char*, const char*> cases[] = {
      {"sm_80", "arch directory"}, {"sm_80/.staging", "staging directory"}, {"sm_80/.locks", "lock directory"},
      {"sm_80/.quarantine", "quarantine directory"}};
  for (const auto& [path, named] : cases) {
    for (const char* damage : {"a file", "writable by others", "a symlink"}) {
      INFO(path << " as " << damage);
      TempDir dir;
      fs::create_directories(dir.path() + "/sm_80");
      fs::permissions(dir.path() + "/sm_80", fs::perms::owner_all, fs::perm_options::replace);
      const std::string target = dir.path() + "/" + path;
      fs::remove_all(target);
      if (std::string(damage) == "a file") {
        std::ofstream(target) << "x";
      } else if (std::string(damage) == "a symlink") {
        TempDir elsewhere;
        fs::create_directory_symlink(elsewhere.path(), target);
      } else {
        fs::create_directory(target);
        fs::permissions(target, fs::perms::all, fs::perm_options::replace);
      }
      KernelCache cache(on_disk(dir.path()));
      CHECK_THROWS_WITH(cache.get(small_spec()), Catch::Contains(named) && Catch::Contains(target));
    }
  }
}

TEST_CASE("staging leftovers are never read, and old ones are swept", "[cache]") {
  TempDir dir;
  { KernelCache warmup(on_disk(dir.path())); }  // creates the layout
  const std::string staging = dir.path() + "/sm_80/.staging";
  // A writer killed after its cubin but before meta.json.
  const std::string partial = staging + "/" + small_spec().name() + "-0000.123.0";
  fs::create_directories(partial);
  std::ofstream(partial + "/kernel.cubin") << "half a cubin";
  KernelCache cache(on_disk(dir.path()));
  CHECK_FALSE(cache.get(small_spec())->from_disk);
  CHECK(cache.stats().compiles == 1);

  fs::last_write_time(partial, fs::file_time_type::clock::now() - std::chrono::hours(2));
  const json worker = run_worker(dir.path(), 0, 1);  // a new process sweeps stale staging dirs
  CHECK_FALSE(fs::exists(partial));
}

TEST_CASE("the cache directory must be private, owned and writable", "[cache]") {
  TempDir dir;
  SECTION("created 0700 when missing") {
    const std::string root = dir / "nested/cache";
    KernelCache cache(on_disk(root));
    struct stat st {};
    REQUIRE(::stat(root.c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0700);
  }
  SECTION("group- or world-writable is refused") {
    const std::string root = dir / "open";
    fs::create_directory(root);
    ::chmod(root.c_str(), 0777);
    try {
      KernelCache cache(on_disk(root));
      FAIL("a world-writable cache directory was accepted");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::cache_error);
      CHECK_THAT(e.what(), Catch::Contains("writable by group or others") && Catch::Contains("0777"));
    }
  }
  SECTION("owned by another user is refused") {
    std::string foreign;
    if (::geteuid() == 0) {
      foreign = dir / "foreign";
      fs::create_directory(foreign);
      ::chmod(foreign.c_str(), 0700);
      REQUIRE(::chown(foreign.c_str(), 65534, 65534) == 0);
    } else {
      foreign = "/usr";  // root's, mode 0755
    }
    CHECK_THROWS_WITH(KernelCache(on_disk(foreign)), Catch::Contains("is owned by uid") &&
                                                         Catch::Contains("not by this user"));
  }
  SECTION("a file is not a directory") {
    std::ofstream(dir / "file") << "x";
    CHECK_THROWS_WITH(KernelCache(on_disk(dir / "file")), Catch::Contains("not a directory"));
  }
  SECTION("an unwritable place is refused with the reason") {
    // /proc refuses mkdir even to root.
    CHECK_THROWS_WITH(KernelCache(on_disk("/proc/flashjit-cache")),
                      Catch::Contains("cannot create cache directory /proc/flashjit-cache"));
    if (::geteuid() != 0) {
      const std::string locked = dir / "locked";
      fs::create_directory(locked);
      ::chmod(locked.c_str(), 0500);
      CHECK_THROWS_WITH(KernelCache(on_disk(locked)), Catch::Contains("is not writable"));
    }
  }
}

TEST_CASE("8 processes compiling the same 16 specs end with 16 valid entries", "[cache]") {
  TempDir dir;
  const auto specs = flashjit::test::worker_specs();
  std::vector<std::unique_ptr<Subprocess>> workers;
  for (int w = 0; w < 8; ++w)  // each starts at a different spec so they collide mid-list
    workers.push_back(std::make_unique<Subprocess>(std::vector<std::string>{
        FLASHJIT_CACHE_WORKER, dir.path(), std::to_string(w * 2), std::to_string(specs.size())}));
  uint64_t compiles = 0;
  for (auto& w : workers) {
    const int status = w->wait();
    INFO(w->output());
    REQUIRE(status == 0);
    compiles += json::parse(w->output()).at("compiles").get<uint64_t>();
  }
  CHECK(compiles == specs.size());  // the per-key lock: each spec compiled by one process
  CHECK(entries_of(dir.path()).size() == specs.size());
  CHECK(count_in(dir.path() + "/sm_80/.staging") == 0);
  KernelCache reader(on_disk(dir.path()));
  for (const auto& spec : specs) CHECK(reader.find_on_disk(spec) != nullptr);
  CHECK(reader.stats().quarantined == 0);
}

TEST_CASE("a process killed mid-compile leaves no entry a reader would load", "[cache]") {
  const auto specs = flashjit::test::worker_specs();
  std::mt19937 rng(12345);
  int interrupted = 0;
  for (int round = 0; round < 6; ++round) {
    TempDir dir;
    {
      Subprocess worker({FLASHJIT_CACHE_WORKER, dir.path(), "0", std::to_string(specs.size())});
      std::this_thread::sleep_for(std::chrono::milliseconds(200 + rng() % 1500));
      ::kill(worker.pid(), SIGKILL);
      worker.wait();
    }
    const size_t published = entries_of(dir.path()).size();
    if (published < specs.size()) ++interrupted;
    // Everything published verifies; nothing half-written is visible.
    KernelCache reader(on_disk(dir.path()));
    size_t found = 0;
    for (const auto& spec : specs) found += reader.find_on_disk(spec) != nullptr;
    CHECK(found == published);
    CHECK(reader.stats().quarantined == 0);
    // And the cache is usable: the rest compiles, the published ones load.
    for (const auto& spec : specs) reader.get(spec);
    CHECK(reader.stats().compiles == specs.size() - published);
    CHECK(reader.stats().quarantined == 0);
  }
  CHECK(interrupted >= 3);  // the kills really landed while the worker was compiling
}
