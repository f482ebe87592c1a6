// sm90_fwd's run-time rules that the CPU tests pin down.
#pragma once

namespace flashjit::detail {

// The persistent Hopper forward's tail splits: its last `tiles` work tiles each run as `splits`
// items over a share of their key blocks, so the last round of whole tiles, which would leave the
// CTAs without one idle for a tile's time, is spread over all of them. `requested_splits`: 0
// chooses (none where the tiles fill whole rounds or splitting does not shorten the last one), 1
// never splits, n > 1 splits the remainder into n (at most one item per key block).
struct TailSplit {
  long long tiles = 0;
  int splits = 1;
};
TailSplit choose_tail_split(long long tiles, int ctas, int key_blocks, int requested_splits);

}  // namespace flashjit::detail
