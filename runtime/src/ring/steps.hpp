// Pieces both of ring attention's passes use on one rank (forward.cpp, backward.cpp): the
// communication stream and events of a call, the check that every rank calls alike, the plans of a
// rank's calls (which rows each starts, merges and finishes), a varlen ring's chunk arrays, row views
// of shards, and the copy of k and v into a travel buffer.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../driver.hpp"
#include "flashjit/ring.hpp"

namespace flashjit::ring::detail {

// A communication stream and the events of one call, lent from a per-process pool (creating a
// stream per call cost more than a short step). A set returns once its call has queued its work: the
// next call to take it queues behind what is left on the stream and records the events anew.
struct ExchangeSet {
  int device = 0;
  CUstream comm = nullptr;
  CUevent inputs_ready = nullptr, comm_done = nullptr;
  CUevent received[2] = {}, computed[2] = {}, gradients_received[2] = {};
};
class ExchangeSetLease {
 public:
  explicit ExchangeSetLease(int device);
  ~ExchangeSetLease();
  ExchangeSetLease(const ExchangeSetLease&) = delete;
  ExchangeSetLease& operator=(const ExchangeSetLease&) = delete;
  ExchangeSet* operator->() const { return set_.get(); }

 private:
  std::unique_ptr<ExchangeSet> set_;
};

// The shards' shapes and dtype (4-D, or 3-D packed with seqlens; k's rows q's, 16-bit, zigzag's two
// chunks); then the driver and q's device's context, and with options.check_shapes one all-gather
// of a header and a wait: every rank throws, naming the field and ranks, unless all called with the
// same shapes and options (the varlen lengths hashed). `pass`: "ring forward" or "ring backward".
void check_shards(Transport& transport, const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& out, bool has_lse, const Options& options, const char* pass);

// Row ranges [first, second), overlapping or touching ones joined, in order.
using RowRanges = std::vector<std::pair<int64_t, int64_t>>;
RowRanges joined(RowRanges ranges);
// How many rows of [begin, end) the ranges cover.
int64_t covered_rows(int64_t begin, int64_t end, const RowRanges& ranges);

// One call per pair of chunks (the query's, the visiting key's) that the mask lets meet, trimmed to
// the rows the band reaches, the shard's diagonal pairs first, unmasked neighbours joined
// (step_calls' windows). `in_chunks`: every call one chunk of queries against one of keys, causal
// on the diagonal when the ring is: a varlen shard's calls, planned in chunks (shard_rows = the
// chunks per shard, one row standing for each).
std::vector<StepCall> chunk_pair_calls(const Options& options, int rank, int source, int world, int64_t shard_rows,
                                       bool in_chunks);

// This rank's calls over all steps, in order, each with whether its rows have a running state yet
// and the rows it ends (those no later call covers). Every row's first call is a diagonal one of
// step 0, which covers a whole chunk (step_calls puts them first), so a call's rows either all have
// a state or none do; the rows a call ends form one range (later calls cover prefixes or suffixes
// of a chunk, or all of it). Both are checked. A varlen ring plans in chunks (shard_rows = its
// chunks per shard), each call one chunk, so it ends all its rows or none.
struct PlannedCall {
  int step;
  StepCall call;
  bool has_state = false;
  int64_t final_begin = 0, final_rows = 0;
};
std::vector<PlannedCall> plan_forward(const Options& options, int rank, int world, int64_t shard_rows);

// The backward's calls of a step, the own shard's with its diagonal calls (each a whole chunk's
// queries and keys) last, so that they finish every row; and whether call c of the own shard's
// step is the last to touch its queries and keys (then it writes them out). A call either is, or
// has every row touched again later (checked: Error(internal) otherwise).
// The attention options of one planned call under the ring's: its mask and the ring's scale,
// softcap, backend and stream. The forward adds its continuation and sm_margin, the backward its own
// continuation.
AttentionOptions call_options(const Options& options, const StepCall& call);

std::vector<StepCall> backward_step_calls(const Options& options, int rank, int source, int world, int64_t shard_rows,
                                          bool own);
bool ends_its_rows(const std::vector<StepCall>& calls, size_t c);

// A varlen ring's shards (Options::seqlens): each sequence's chunk and where its shard starts among
// the packed shard rows; checked against the packed rows (`pass` names the call in errors).
struct VarlenShards {
  int chunks_per_shard = 1;  // 1 contiguous, 2 zigzag
  std::vector<int> chunk;    // rows per chunk, per sequence
  std::vector<int> start;    // each sequence's first packed shard row, then the total (batch + 1)
  int max_chunk = 0;
  int batch() const { return static_cast<int>(chunk.size()); }
  // For each chunk u of a shard: cu_seqlens of "chunk u of every sequence" (batch + 1) then its
  // seqused (batch), the arrays a call over one chunk of each sequence takes.
  std::vector<int> call_arrays() const;
  size_t call_array_ints() const { return 2 * chunk.size() + 1; }
};
VarlenShards varlen_shards(const Options& options, int world, int64_t packed_rows, const char* pass);
// The varlen batch of a call over chunk `q_chunk` of every sequence's queries against chunk
// `kv_chunk` of its keys, from call_arrays() uploaded at `device_arrays`.
VarlenBatch chunk_batch(const VarlenShards& shards, const int* device_arrays, int q_chunk, int kv_chunk, int device);
// The calls of a step (step_calls), or for a varlen ring chunk_pair_calls over chunks, unjoined.
std::vector<StepCall> calls_of_step(const Options& options, int rank, int source, int world, int64_t shard_rows);
// A (rows, heads, head_dim) view as (1, rows, heads, head_dim); a 4-D one as it is.
TensorView as_batched(const TensorView& t);

// Rows [begin, begin + rows) of a (batch, rows, heads, head_dim) view.
TensorView rows_of(const TensorView& t, int64_t begin, int64_t rows);
// Rows [begin, begin + rows) of a (batch, heads, rows) view (an LSE).
TensorView lse_rows(const TensorView& lse, int64_t begin, int64_t rows);
// Copies k (or v) into its part of a travel buffer, (batch, rows, heads_kv, head_dim) contiguous.
void pack(const TensorView& t, char* destination, CUstream stream);

}  // namespace flashjit::ring::detail
