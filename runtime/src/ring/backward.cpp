// Ring attention's backward on one rank. Step s works on the shard of rank - 1 - s (mod N), so the
// rank's own shard comes last: its K/V stay in place, and the fp32 sums of its dK and dV come back
// from the previous rank with every other rank's share in them, ready to be finished and written in
// the output dtype by this rank's last call (BackwardContinuation::final). The K/V shards travel in
// two buffers as in the forward (step s + 1's posted before step s computes); the dK/dV sums in two
// more, each sent on once the step that added to it is done, which puts each step behind the
// previous rank's step before it. dQ sums in fp32 here (zeroed first, finished by the last call).
#include <fmt/format.h>

#include "../workspace.hpp"
#include "steps.hpp"

namespace flashjit::ring {


void backward(Runtime& runtime, Transport& transport, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& out, const TensorView& dout, const TensorView& lse, const TensorView& dq,
              const TensorView& dk, const TensorView& dv, const Options& options) {
  const int world = transport.size(), rank = transport.rank();
  detail::check_shards(transport, q, k, v, out, /*has_lse=*/true, options, "ring backward");
  // A varlen ring's shards are one packed sequence of rows here (batch 1), its calls per chunk.
  const bool varlen = !options.seqlens.empty();
  const int row_dim = varlen ? 0 : 1;
  const int64_t batch = varlen ? 1 : q.shape[0], shard_rows = q.shape[row_dim], heads_q = q.shape[row_dim + 1],
                heads_kv = k.shape[row_dim + 1], head_dim = q.shape[row_dim + 2];
  if (batch == 0 || shard_rows == 0 || (heads_q == 0 && heads_kv == 0)) return;
  const auto stream = static_cast<CUstream>(options.stream);
  const detail::VarlenShards shards = varlen ? detail::varlen_shards(options, world, shard_rows, "ring backward")
                                             : detail::VarlenShards{};
  const std::vector<int> call_arrays = varlen ? shards.call_arrays() : std::vector<int>{};

  // Scratch: two K/V travel buffers (K then V, 16-bit), two dK/dV sum buffers (dK then dV, fp32),
  // and the dQ sums, each (batch, shard rows, heads, head_dim) contiguous.
  const size_t element = element_size(q.dtype);
  const size_t kv_elements = static_cast<size_t>(batch * shard_rows * heads_kv * head_dim);
  const size_t kv_bytes = 2 * kv_elements * element, gradient_bytes = 2 * kv_elements * sizeof(float);
  const size_t dq_bytes = static_cast<size_t>(batch * shard_rows * heads_q * head_dim) * sizeof(float);
  auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const size_t gradients_offset = world > 1 ? 2 * aligned(kv_bytes) : 0, dq_offset = gradients_offset + 2 * aligned(gradient_bytes);
  const size_t arrays_offset = dq_offset + aligned(dq_bytes);
  flashjit::detail::StreamWorkspace scratch(q.device, stream, arrays_offset + call_arrays.size() * sizeof(int));
  char* base = reinterpret_cast<char*>(scratch.get());
  char* kv_buffers[2] = {base, base + aligned(kv_bytes)};
  float* gradient_buffers[2] = {reinterpret_cast<float*>(base + gradients_offset),
                                reinterpret_cast<float*>(base + gradients_offset + aligned(gradient_bytes))};
  // (fp32 sums shaped like the shards: varlen's without the batch dim)
  auto sums = [&](void* data, int64_t heads) {
    return varlen ? TensorView::contiguous(data, ScalarType::float32, {shard_rows, heads, head_dim}, q.device)
                  : TensorView::contiguous(data, ScalarType::float32, {batch, shard_rows, heads, head_dim}, q.device);
  };
  const TensorView dq_sums = sums(base + dq_offset, heads_q);
  const int* device_arrays = reinterpret_cast<const int*>(base + arrays_offset);
  if (varlen)
    FLASHJIT_CU(cuMemcpyHtoDAsync, reinterpret_cast<CUdeviceptr>(device_arrays), call_arrays.data(),
                call_arrays.size() * sizeof(int), stream);
  FLASHJIT_CU(cuMemsetD32Async, reinterpret_cast<CUdeviceptr>(dq_sums.data), 0u, dq_bytes / 4, stream);
  FLASHJIT_CU(cuMemsetD32Async, reinterpret_cast<CUdeviceptr>(gradient_buffers[0]), 0u, gradient_bytes / 4, stream);

  const detail::ExchangeSetLease exchange(q.device);
  FLASHJIT_CU(cuEventRecord, exchange->inputs_ready, stream);
  FLASHJIT_CU(cuStreamWaitEvent, exchange->comm, exchange->inputs_ready, 0);
  // The shard of step s (s < N - 1) arrives in K/V buffer (s + 1) % 2: this rank's own goes out first.
  if (world > 1) {
    detail::pack(detail::as_batched(k), kv_buffers[0], exchange->comm);
    detail::pack(detail::as_batched(v), kv_buffers[0] + kv_bytes / 2, exchange->comm);
    transport.shift(kv_buffers[0], kv_buffers[1], kv_bytes, exchange->comm);
    FLASHJIT_CU(cuEventRecord, exchange->received[1], exchange->comm);
  }
  for (int s = 0; s < world; ++s) {
    const bool own = s == world - 1;
    const int kv_slot = (s + 1) % 2, gradient_slot = s % 2;
    if (s + 2 < world) {  // step s + 1's shard, while this one computes (into the buffer step s - 1 read)
      if (s >= 1) FLASHJIT_CU(cuStreamWaitEvent, exchange->comm, exchange->computed[(s - 1) % 2], 0);
      transport.shift(kv_buffers[kv_slot], kv_buffers[(s + 2) % 2], kv_bytes, exchange->comm);
      FLASHJIT_CU(cuEventRecord, exchange->received[(s + 2) % 2], exchange->comm);
    }
    if (s >= 1) {  // the sums of this step's shard, from the previous rank's step s - 1
      FLASHJIT_CU(cuStreamWaitEvent, exchange->comm, exchange->computed[(s - 1) % 2], 0);
      transport.shift(gradient_buffers[(s - 1) % 2], gradient_buffers[gradient_slot], gradient_bytes, exchange->comm);
      FLASHJIT_CU(cuEventRecord, exchange->gradients_received[gradient_slot], exchange->comm);
      FLASHJIT_CU(cuStreamWaitEvent, stream, exchange->gradients_received[gradient_slot], 0);
    }
    if (!own) FLASHJIT_CU(cuStreamWaitEvent, stream, exchange->received[kv_slot], 0);
    TensorView shard_k = k, shard_v = v;
    if (!own) {
      shard_k = varlen ? TensorView::contiguous(kv_buffers[kv_slot], q.dtype, {shard_rows, heads_kv, head_dim}, q.device)
                       : TensorView::contiguous(kv_buffers[kv_slot], q.dtype, {batch, shard_rows, heads_kv, head_dim}, q.device);
      shard_v = shard_k;
      shard_v.data = kv_buffers[kv_slot] + kv_bytes / 2;
    }
    const TensorView dk_sums = sums(gradient_buffers[gradient_slot], heads_kv);
    TensorView dv_sums = dk_sums;
    dv_sums.data = gradient_buffers[gradient_slot] + kv_elements;
    const int source = (rank - 1 - s + 2 * world) % world;
    const std::vector<StepCall> calls =
        detail::backward_step_calls(options, rank, source, world, varlen ? shards.chunks_per_shard : shard_rows, own);
    for (size_t c = 0; c < calls.size(); ++c) {
      const StepCall& call = calls[c];
      BackwardContinuation continuation;
      continuation.final = own && detail::ends_its_rows(calls, c);
      AttentionOptions attention = detail::call_options(options, call);
      attention.backward_continuation = &continuation;
      if (varlen) {  // whole tensors, the call's chunk of each sequence picked by its varlen batch
        continuation.dq_state = dq_sums;
        continuation.dk_state = dk_sums;
        continuation.dv_state = dv_sums;
        const VarlenBatch chunks = detail::chunk_batch(shards, device_arrays, static_cast<int>(call.q_begin),
                                                       static_cast<int>(call.kv_begin), q.device);
        runtime.backward_varlen(q, shard_k, shard_v, out, dout, &lse, dq, dk, dv, chunks, attention);
        continue;
      }
      continuation.dq_state = detail::rows_of(dq_sums, call.q_begin, call.q_rows);
      continuation.dk_state = detail::rows_of(dk_sums, call.kv_begin, call.kv_rows);
      continuation.dv_state = detail::rows_of(dv_sums, call.kv_begin, call.kv_rows);
      const TensorView call_lse = detail::lse_rows(lse, call.q_begin, call.q_rows);
      auto q_rows = [&](const TensorView& t) { return detail::rows_of(t, call.q_begin, call.q_rows); };
      auto kv_rows = [&](const TensorView& t) { return detail::rows_of(t, call.kv_begin, call.kv_rows); };
      runtime.backward(q_rows(q), kv_rows(shard_k), kv_rows(shard_v), q_rows(out), q_rows(dout), &call_lse, q_rows(dq),
                       kv_rows(dk), kv_rows(dv), attention);
    }
    FLASHJIT_CU(cuEventRecord, exchange->computed[s % 2], stream);
  }
  // The scratch memory is freed on `stream`: after the last exchange too.
  FLASHJIT_CU(cuEventRecord, exchange->comm_done, exchange->comm);
  FLASHJIT_CU(cuStreamWaitEvent, stream, exchange->comm_done, 0);
}

}  // namespace flashjit::ring
