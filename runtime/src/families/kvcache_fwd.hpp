// What the runtime and the tools reach of kvcache_fwd's module besides its family table entry.
#pragma once

#include <array>

#include "../driver.hpp"
#include "../module_cache.hpp"

namespace flashjit::detail {

// Where a decode call's CTAs run: the device's SMs, the attention entry's CTAs one SM holds, and
// for each split count s the CTAs that clusters of s splits (one CTA per SM) keep running at once,
// 0 where the kernel cannot merge s splits inside a cluster (the combine kernel merges them).
struct KvSplitSlots {
  int sm_count = 0;
  int resident_ctas_per_sm = 1;
  std::array<int, kMaxClusterCtas + 1> cluster_ctas{};
};

// Key-range splits of a decode call (flash-decoding) and where they merge: inside their
// thread-block clusters, or by the combine kernel.
struct KvSplits {
  int count = 1;
  bool in_cluster = false;
};

// `requested` splits when the caller forces them (1 to key_tiles), else the count that streams
// `ctas` CTAs' key_tiles tiles of tile_bytes (K and V) through the slots and the memory in the
// least time, the merge included; either way the faster merge. whole_tile_copies: each TMA copy
// brings a whole key tile (a contiguous cache, or pages of a tile or more), which a CTA streams
// faster than pages of a few rows or cp.async gathers.
constexpr int kMaxKvSplits = 128;
KvSplits choose_kv_splits(long long ctas, const KvSplitSlots& slots, int key_tiles, long long tile_bytes,
                     bool whole_tile_copies, int requested);

// Waits for `stream`, reads and clears every kvcache module's fault record, and throws
// Error(invalid_argument) describing the first fault found.
void check_kvcache_status(CUstream stream);

}  // namespace flashjit::detail
