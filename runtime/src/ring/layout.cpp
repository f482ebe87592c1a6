// Ring layouts: which rows of the sequence each rank holds, and which attention calls a step makes.
#include <algorithm>
#include <cstdint>

#include <fmt/format.h>

#include "flashjit/ring.hpp"
#include "steps.hpp"

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

namespace {

constexpr int64_t kUnbounded = INT64_MAX / 4;

}  // namespace

// For each pair of chunks, the queries that see some key of the key chunk and the keys some of them
// see (so every row of a call sees a key); the call's own window follows from the two ranges' last
// rows (its bottom-right alignment), and a side that bounds nothing in the call is dropped. Then
// unmasked neighbours with the same other range are joined. In chunks (a varlen ring's plan, rows
// standing for chunks of any length, no window): whole pairs, the diagonal ones causal when the
// ring is, nothing joined.
std::vector<StepCall> detail::chunk_pair_calls(const Options& o, int rank, int source, int world, int64_t shard_rows,
                                               bool in_chunks) {
  const int64_t seqlen = shard_rows * world;
  const Shard ours = shard_of(o.layout, rank, world, seqlen), theirs = shard_of(o.layout, source, world, seqlen);
  const int64_t left = o.window_left < 0 ? kUnbounded : o.window_left;
  const int64_t right = o.causal ? 0 : o.window_right < 0 ? kUnbounded : o.window_right;
  auto chunk_begins = [](const Shard& s) {
    return s.second_begin < 0 ? std::vector<int64_t>{s.first_begin} : std::vector<int64_t>{s.first_begin, s.second_begin};
  };
  std::vector<StepCall> diagonal, others;
  const std::vector<int64_t> q_chunks = chunk_begins(ours), k_chunks = chunk_begins(theirs);
  for (size_t a = 0; a < q_chunks.size(); ++a)
    for (size_t b = 0; b < k_chunks.size(); ++b) {
      int64_t q_begin = q_chunks[a], q_end = q_begin + ours.chunk, k_begin = k_chunks[b], k_end = k_begin + theirs.chunk;
      q_end = std::min(q_end, k_end + left);  // query i sees keys [i - left, i + right]
      q_begin = std::max(q_begin, k_begin - right);
      if (q_begin >= q_end) continue;
      k_begin = std::max(k_begin, q_begin - left);
      k_end = std::min(k_end, q_end + right);
      if (k_begin >= k_end) continue;
      StepCall call{q_begin - q_chunks[a] + int64_t(a) * ours.chunk, q_end - q_begin,
                    k_begin - k_chunks[b] + int64_t(b) * theirs.chunk, k_end - k_begin};
      const int64_t shift = q_end - k_end;  // the call's diagonal lies `shift` rows right of the sequence's
      // A side is unbounded in the call once no (row, key) pair of it lies past that side.
      const int64_t call_left = left - shift, call_right = right + shift;
      call.window_left = left == kUnbounded || call_left >= call.kv_rows - 1 ? -1 : static_cast<int>(call_left);
      call.window_right = right == kUnbounded || call_right >= call.q_rows - 1 ? -1 : static_cast<int>(call_right);
      if (call.window_left < 0 && call.window_right == 0) {
        call.causal = true;
        call.window_right = -1;
      }
      if (in_chunks) call = {call.q_begin, call.q_rows, call.kv_begin, call.kv_rows, o.causal && q_chunks[a] == k_chunks[b]};
      (q_chunks[a] == k_chunks[b] ? diagonal : others).push_back(call);
    }
  auto unmasked = [](const StepCall& c) { return !c.causal && c.window_left < 0 && c.window_right < 0; };
  std::vector<StepCall> calls = diagonal;
  for (const StepCall& c : others) {
    StepCall* last = in_chunks || calls.empty() || calls.size() == diagonal.size() ? nullptr : &calls.back();
    if (last != nullptr && unmasked(*last) && unmasked(c)) {
      if (last->kv_begin == c.kv_begin && last->kv_rows == c.kv_rows && last->q_begin + last->q_rows == c.q_begin) {
        last->q_rows += c.q_rows;
        continue;
      }
      if (last->q_begin == c.q_begin && last->q_rows == c.q_rows && last->kv_begin + last->kv_rows == c.kv_begin) {
        last->kv_rows += c.kv_rows;
        continue;
      }
    }
    calls.push_back(c);
  }
  return calls;
}

std::vector<StepCall> step_calls(const Options& o, int rank, int source, int world, int64_t shard_rows) {
  if (o.window_left >= 0 || (o.window_right >= 0 && !o.causal))
    return detail::chunk_pair_calls(o, rank, source, world, shard_rows, /*in_chunks=*/false);
  const bool causal = o.causal;
  StepCall whole{0, shard_rows, 0, shard_rows};
  whole.causal = causal;
  if (!causal || world == 1) return {whole};
  if (source == rank) return {whole};
  if (o.layout == Layout::contiguous) {
    if (source < rank) return {{0, shard_rows, 0, shard_rows}};
    return {};
  }
  // Zigzag: this rank holds chunks r and 2N-1-r, the source chunks j and 2N-1-j. With j < r, chunk
  // j precedes both of ours and 2N-1-j follows both; with j > r, both of the source's precede our
  // second chunk and follow our first.
  const int64_t chunk = shard_rows / 2;
  if (source < rank) return {{0, shard_rows, 0, chunk}};
  return {{chunk, chunk, 0, shard_rows}};
}

}  // namespace flashjit::ring
