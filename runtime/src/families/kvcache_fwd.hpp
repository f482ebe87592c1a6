// What the runtime and the tools reach of kvcache_fwd's module besides its family table entry.
#pragma once

#include "../driver.hpp"

namespace flashjit::detail {

// Key-range splits of a decode call (flash-decoding): `requested` when the caller forces it (1
// to key_tiles), else the count that streams `ctas` CTAs' key_tiles tiles of tile_bytes (K and V)
// through the device's resident CTA slots and its memory in the least time, the combine included.
// whole_tile_copies: each TMA copy brings a whole key tile (a contiguous cache, or pages of a tile
// or more), which a CTA streams faster than pages of a few rows or cp.async gathers.
constexpr int kMaxKvSplits = 128;
int choose_kv_splits(long long ctas, int resident_ctas_per_sm, int sm_count, int key_tiles, long long tile_bytes,
                     bool whole_tile_copies, int requested);

// Waits for `stream`, reads and clears every kvcache module's fault record, and throws
// Error(invalid_argument) describing the first fault found.
void check_kvcache_status(CUstream stream);

}  // namespace flashjit::detail
