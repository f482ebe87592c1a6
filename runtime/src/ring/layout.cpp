// Ring layouts: which rows of the sequence each rank holds, and which attention calls a step makes.
#include <fmt/format.h>

#include "flashjit/ring.hpp"

namespace flashjit::ring {

const char* to_string(Layout layout) { return layout == Layout::zigzag ? "zigzag" : "contiguous"; }

Shard shard_of(Layout layout, int rank, int world, int64_t seqlen) {
  auto bad = [](const std::string& message) { return Error(ErrorCode::invalid_argument, "ring", message); };
  if (world < 1) throw bad(fmt::format("the ring has {} ranks; it needs at least one", world));
  if (rank < 0 || rank >= world) throw bad(fmt::format("rank {} is outside the ring's 0 .. {}", rank, world - 1));
  if (seqlen < 0) throw bad(fmt::format("seqlen {} is negative", seqlen));
  const int chunks = layout == Layout::zigzag ? 2 * world : world;
  if (seqlen % chunks != 0)
    throw bad(fmt::format("seqlen {} does not divide into the {} layout's {} equal chunks ({} ranks{})", seqlen,
                          to_string(layout), chunks, world, layout == Layout::zigzag ? ", two chunks each" : ""));
  Shard shard;
  shard.chunk = seqlen / chunks;
  shard.first_begin = rank * shard.chunk;
  if (layout == Layout::zigzag) shard.second_begin = (chunks - 1 - rank) * shard.chunk;
  return shard;
}

std::vector<StepCall> step_calls(Layout layout, bool causal, int rank, int source, int world, int64_t shard_rows) {
  if (!causal || world == 1) return {{0, shard_rows, 0, shard_rows, causal}};
  if (source == rank) return {{0, shard_rows, 0, shard_rows, true}};
  if (layout == Layout::contiguous) {
    if (source < rank) return {{0, shard_rows, 0, shard_rows, false}};
    return {};
  }
  // Zigzag: this rank holds chunks r and 2N-1-r, the source chunks j and 2N-1-j. With j < r, chunk
  // j precedes both of ours and 2N-1-j follows both; with j > r, both of the source's precede our
  // second chunk and follow our first.
  const int64_t chunk = shard_rows / 2;
  if (source < rank) return {{0, shard_rows, 0, chunk, false}};
  return {{chunk, chunk, 0, shard_rows, false}};
}

}  // namespace flashjit::ring
