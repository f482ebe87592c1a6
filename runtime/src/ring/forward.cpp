// Ring attention's forward on one rank. The K/V shards travel in two buffers (each K then V,
// (batch, shard rows, heads_kv, head_dim) contiguous): step s > 0 computes with the shard in buffer
// s % 2 while the exchange on the communication stream fills the other with step s + 1's (step 0
// reads the rank's own k and v while their copy into buffer 0 goes out). Each
// step's calls (step_calls) continue a running fp32 state (ForwardContinuation): a row's first call
// starts it, its last writes out and the LSE (plan_forward).
#include <algorithm>
#include <cstring>
#include <mutex>

#include <fmt/format.h>

#include "../workspace.hpp"
#include "steps.hpp"

namespace flashjit::ring {

namespace {

Error bad(const std::string& message) { return Error(ErrorCode::invalid_argument, "ring forward", message); }

}  // namespace

void forward(Runtime& runtime, Transport& transport, const TensorView& q, const TensorView& k, const TensorView& v,
             const TensorView& out, const TensorView* lse, const Options& options) {
  const int world = transport.size(), rank = transport.rank();
  detail::check_shards(transport, q, k, v, out, lse != nullptr, options, "ring forward");
  // A varlen ring's shards are one packed sequence of rows here (batch 1), its calls per chunk.
  const bool varlen = !options.seqlens.empty();
  const int row_dim = varlen ? 0 : 1;
  const int64_t batch = varlen ? 1 : q.shape[0], shard_rows = q.shape[row_dim], heads_q = q.shape[row_dim + 1],
                heads_kv = k.shape[row_dim + 1], head_dim = q.shape[row_dim + 2];
  const auto stream = static_cast<CUstream>(options.stream);
  if (batch == 0 || shard_rows == 0 || heads_q == 0) return;
  const detail::VarlenShards shards = varlen ? detail::varlen_shards(options, world, shard_rows, "ring forward")
                                             : detail::VarlenShards{};

  // The travel buffers, the running O (laid out as the LSE, head_dim values per entry), when the
  // caller wants no LSE a running LSE of our own, and a varlen ring's per-chunk cu_seqlens.
  const size_t element = element_size(q.dtype);
  const size_t kv_bytes = 2 * static_cast<size_t>(batch * shard_rows * heads_kv * head_dim) * element;
  TensorView running_lse = lse != nullptr ? *lse
                           : varlen ? TensorView::contiguous(nullptr, ScalarType::float32, {heads_q, shard_rows}, q.device)
                                    : TensorView::contiguous(nullptr, ScalarType::float32, {batch, heads_q, shard_rows}, q.device);
  if (running_lse.rank != (varlen ? 2 : 3))
    throw bad(varlen ? fmt::format("lse: expected 2 dims (heads_q, total shard rows) with seqlens, got {}", running_lse.rank)
                     : fmt::format("lse: expected 3 dims (batch, heads_q, shard rows), got {}", running_lse.rank));
  int64_t lse_extent = 1;
  for (int d = 0; d < running_lse.rank; ++d) lse_extent += running_lse.strides[d] * (running_lse.shape[d] - 1);
  auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const std::vector<int> call_arrays = varlen ? shards.call_arrays() : std::vector<int>{};
  const size_t state_offset = world > 1 ? 2 * aligned(kv_bytes) : 0;  // (one rank sends nothing)
  const size_t own_lse_offset = state_offset + aligned(lse_extent * head_dim * sizeof(float));
  const size_t arrays_offset = own_lse_offset + (lse == nullptr ? aligned(lse_extent * sizeof(float)) : 0);
  flashjit::detail::StreamWorkspace scratch(q.device, stream, arrays_offset + call_arrays.size() * sizeof(int));
  char* base = reinterpret_cast<char*>(scratch.get());
  char* buffers[2] = {base, base + aligned(kv_bytes)};
  if (lse == nullptr) running_lse.data = base + own_lse_offset;
  TensorView state = running_lse;
  state.data = base + state_offset;
  state.shape[state.rank] = head_dim;
  state.strides[state.rank] = 1;
  for (int d = 0; d < state.rank; ++d) state.strides[d] *= head_dim;
  ++state.rank;
  const int* device_arrays = reinterpret_cast<const int*>(base + arrays_offset);
  if (varlen)
    FLASHJIT_CU(cuMemcpyHtoDAsync, reinterpret_cast<CUdeviceptr>(device_arrays), call_arrays.data(),
                call_arrays.size() * sizeof(int), stream);

  const detail::ExchangeSetLease exchange(q.device);
  // Step 0 reads this rank's own k and v where they are; their copy into the first travel buffer
  // (to send) runs on the communication stream beside it. (The event marks the inputs ready.)
  FLASHJIT_CU(cuEventRecord, exchange->inputs_ready, stream);
  FLASHJIT_CU(cuStreamWaitEvent, exchange->comm, exchange->inputs_ready, 0);
  if (world > 1) {
    detail::pack(detail::as_batched(k), buffers[0], exchange->comm);
    detail::pack(detail::as_batched(v), buffers[0] + kv_bytes / 2, exchange->comm);
  }

  // (A varlen ring plans in chunks: each call is one chunk of every sequence, wholly final or not.)
  const std::vector<detail::PlannedCall> plan =
      detail::plan_forward(options, rank, world, varlen ? shards.chunks_per_shard : shard_rows);
  size_t next_call = 0;
  for (int s = 0; s < world; ++s) {
    const int current = s % 2, next = (s + 1) % 2;
    if (s + 1 < world) {  // step s + 1's shard, while this one computes
      if (s >= 1) FLASHJIT_CU(cuStreamWaitEvent, exchange->comm, exchange->computed[next], 0);  // step s - 1 read it
      transport.shift(buffers[current], buffers[next], kv_bytes, exchange->comm);
      FLASHJIT_CU(cuEventRecord, exchange->received[next], exchange->comm);
    }
    if (s > 0) FLASHJIT_CU(cuStreamWaitEvent, stream, exchange->received[current], 0);
    TensorView shard_k = k, shard_v = v;
    if (s > 0) {
      shard_k = varlen ? TensorView::contiguous(buffers[current], q.dtype, {shard_rows, heads_kv, head_dim}, q.device)
                       : TensorView::contiguous(buffers[current], q.dtype, {batch, shard_rows, heads_kv, head_dim}, q.device);
      shard_v = shard_k;
      shard_v.data = buffers[current] + kv_bytes / 2;
    }
    for (; next_call < plan.size() && plan[next_call].step == s; ++next_call) {
      const detail::PlannedCall& planned = plan[next_call];
      const StepCall& call = planned.call;
      ForwardContinuation continuation;
      continuation.has_state = planned.has_state;
      AttentionOptions attention = detail::call_options(options, call);
      attention.sm_margin = options.sm_margin;
      attention.continuation = &continuation;
      if (varlen) {
        continuation.o_state = state;
        continuation.final_rows = planned.final_rows > 0 ? shards.max_chunk : 0;  // (the whole chunk)
        const VarlenBatch chunks = detail::chunk_batch(shards, device_arrays, static_cast<int>(call.q_begin),
                                                       static_cast<int>(call.kv_begin), q.device);
        runtime.forward_varlen(q, shard_k, shard_v, out, &running_lse, chunks, attention);
        continue;
      }
      continuation.o_state = state;
      continuation.o_state.data = static_cast<float*>(state.data) + call.q_begin * state.strides[2];
      continuation.o_state.shape[2] = call.q_rows;
      continuation.final_begin = planned.final_begin;
      continuation.final_rows = planned.final_rows;
      const TensorView call_lse = detail::lse_rows(running_lse, call.q_begin, call.q_rows);
      runtime.forward(detail::rows_of(q, call.q_begin, call.q_rows), detail::rows_of(shard_k, call.kv_begin, call.kv_rows),
                      detail::rows_of(shard_v, call.kv_begin, call.kv_rows), detail::rows_of(out, call.q_begin, call.q_rows), &call_lse,
                      attention);
    }
    FLASHJIT_CU(cuEventRecord, exchange->computed[current], stream);
  }
  // The scratch memory is freed on `stream`: after the last exchange too.
  FLASHJIT_CU(cuEventRecord, exchange->comm_done, exchange->comm);
  FLASHJIT_CU(cuStreamWaitEvent, stream, exchange->comm_done, 0);
}

}  // namespace flashjit::ring
