// Test helper: one process of the multi-process cache tests.
//   flashjit_cache_worker <cache_dir> <first> <count>
// gets specs [first, first + count) of worker_specs() through a KernelCache on <cache_dir> and
// prints its counters as one JSON line. Exit 0 on success, 1 with the error on stderr.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "flashjit/error.hpp"
#include "flashjit/kernel_cache.hpp"
#include "support/worker_specs.hpp"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s <cache_dir> <first> <count>\n", argv[0]);
    return 2;
  }
  try {
    flashjit::CacheConfig config;
    config.directory = argv[1];
    flashjit::KernelCache cache(config);
    const auto specs = flashjit::test::worker_specs();
    const int first = std::atoi(argv[2]), count = std::atoi(argv[3]);
    for (int i = first; i < first + count; ++i) cache.get(specs.at(i % specs.size()));
    const auto s = cache.stats();
    std::printf("{\"memory_hits\": %llu, \"disk_hits\": %llu, \"compiles\": %llu, \"quarantined\": %llu}\n",
                (unsigned long long)s.memory_hits, (unsigned long long)s.disk_hits,
                (unsigned long long)s.compiles, (unsigned long long)s.quarantined);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
