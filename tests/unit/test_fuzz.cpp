// Seeded mutation fuzzing of the readers of files flashjit may not have written: a tuning
// database (TuningDb::parse, what --tuning-db and FLASHJIT_TUNING_DB load) and a cache entry's
// meta.json (DiskCache::load). Every mutant must be refused with flashjit::Error, quarantined, or
// accepted: never a crash, an abort, a hang or another exception. Bounded by iterations and time;
// FLASHJIT_FUZZ_ITERATIONS scales it (CI runs the default).
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "disk_cache.hpp"
#include "flashjit/error.hpp"
#include "flashjit/kernel_cache.hpp"
#include "flashjit/tuning.hpp"
#include "support/temp_dir.hpp"
#include "support/tuning_entries.hpp"

using namespace flashjit;
namespace fs = std::filesystem;

namespace {

int iterations(int fallback) {
  const char* text = std::getenv("FLASHJIT_FUZZ_ITERATIONS");
  return text ? std::max(1, std::atoi(text)) : fallback;
}

// One random edit of `text`: a flipped bit, an inserted or deleted run, a duplicated run, a
// digit run replaced by an extreme number, or a truncation.
std::string mutate(std::string text, std::mt19937_64& rng) {
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  static const char* kNumbers[] = {"0", "-1", "4294967360", "18446744073709551615", "9223372036854775808",
                                   "1e309", "-0", "2147483648", "NaN", "1.5"};
  static const char* kTokens[] = {"{", "}", "[", "]", ",", ":", "\"", "null", "true", "\\u0000", "\xff"};
  const int edits = 1 + static_cast<int>(rng() % 3);
  for (int e = 0; e < edits && !text.empty(); ++e) {
    const size_t at = pick(text.size());
    switch (rng() % 6) {
      case 0: text[at] = static_cast<char>(text[at] ^ (1 << (rng() % 8))); break;
      case 1: text.insert(at, kTokens[pick(std::size(kTokens))]); break;
      case 2: text.erase(at, 1 + pick(16)); break;
      case 3: text.insert(at, text.substr(at, 1 + pick(64))); break;
      case 4: {
        size_t begin = text.find_first_of("0123456789", at);
        if (begin == std::string::npos) break;
        size_t end = text.find_first_not_of("0123456789", begin);
        text.replace(begin, (end == std::string::npos ? text.size() : end) - begin, kNumbers[pick(std::size(kNumbers))]);
        break;
      }
      default: text.resize(at); break;
    }
  }
  return text;
}

}  // namespace

TEST_CASE("fuzz: mutated tuning databases are loaded or refused with flashjit::Error", "[fuzz]") {
  TuningDb db;
  for (int i = 0; i < 3; ++i) db.upsert(test::numbered_entry(i));
  const std::string seed = db.dump();
  std::mt19937_64 rng(20261201);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int refused = 0, accepted = 0;
  const int n = iterations(100000);
  for (int i = 0; i < n && std::chrono::steady_clock::now() < deadline; ++i) {
    const std::string mutant = mutate(seed, rng);
    try {
      TuningDb::parse(mutant, "fuzz");
      ++accepted;
    } catch (const Error&) {
      ++refused;
    } catch (const std::exception& e) {
      INFO("mutant " << i << ":\n" << mutant);
      FAIL("an exception other than flashjit::Error: " << e.what());
    }
  }
  INFO(accepted << " accepted, " << refused << " refused");
  CHECK(refused > 0);
}

TEST_CASE("fuzz: mutated meta.json is quarantined or verified, never served unverified", "[fuzz]") {
  test::TempDir dir;
  const KernelSpec spec = default_spec(Family::reference_fwd, Arch::parse("sm_80"), DType::bf16, 64);
  std::string good_cubin;
  {
    CacheConfig config;
    config.directory = dir.path();
    KernelCache cache(config);
    good_cubin = cache.get(spec)->cubin;
  }
  fs::path entry;
  for (const auto& e : fs::directory_iterator(dir.path() + "/sm_80"))
    if (e.path().filename().string()[0] != '.') entry = e.path();
  REQUIRE_FALSE(entry.empty());
  const fs::path pristine = dir.path() + "/pristine";
  fs::copy(entry, pristine, fs::copy_options::recursive);
  std::ifstream in(pristine / "meta.json");
  const std::string seed((std::istreambuf_iterator<char>(in)), {});
  const nlohmann::json meta = nlohmann::json::parse(seed);
  const detail::DiskKey key{spec.arch, spec.name(), meta["key"]};

  detail::DiskCache disk(dir.path(), 1000);
  std::mt19937_64 rng(1201);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int served = 0, quarantined = 0;
  const int n = iterations(5000);
  for (int i = 0; i < n && std::chrono::steady_clock::now() < deadline; ++i) {
    fs::remove_all(entry);
    fs::copy(pristine, entry, fs::copy_options::recursive);
    const std::string mutant = mutate(seed, rng);
    std::ofstream(entry / "meta.json", std::ios::trunc) << mutant;
    try {
      const auto kernel = disk.load(key, spec);
      if (kernel) {
        ++served;
        CHECK(kernel->cubin == good_cubin);  // only ever the verified cubin
      } else {
        ++quarantined;
      }
    } catch (const std::exception& e) {
      INFO("mutant " << i << ":\n" << mutant);
      FAIL("load threw: " << e.what());
    }
  }
  INFO(served << " served, " << quarantined << " quarantined");
  CHECK(quarantined > 0);
}
