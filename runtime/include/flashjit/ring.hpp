// Ring attention (context parallelism): one long sequence spread over the ranks of a ring, each
// keeping its shard of queries while the K/V shards travel around it; every step's rows merge into
// a running fp32 result inside the kernel (ForwardContinuation), so no hop rounds O to 16 bits.
//
//   flashjit::ring::NcclTransport ring(comm);  // or LocalRing's endpoints: N virtual ranks, one GPU
//   flashjit::ring::forward(rt, ring, q, k, v, out, &lse, {.causal = true, .stream = stream});
//
// Layouts: contiguous (rank r holds the r-th of N equal chunks) or zigzag (chunks r and 2N-1-r of
// 2N, which balances causal work: every step but the first is half a block with no mask).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flashjit/flashjit.hpp"

namespace flashjit::ring {

enum class Layout { contiguous, zigzag };
const char* to_string(Layout layout);

// The rows of the whole sequence (length seqlen) that `rank` of `world` holds, in its shard's order:
// [first_begin, first_begin + chunk) then, zigzag, [second_begin, second_begin + chunk). Throws
// Error(invalid_argument) unless seqlen divides into N (contiguous) or 2N (zigzag) equal chunks.
struct Shard {
  int64_t chunk = 0;  // rows per chunk
  int64_t first_begin = 0;
  int64_t second_begin = -1;  // -1: contiguous (one chunk)
  int64_t rows() const { return second_begin < 0 ? chunk : 2 * chunk; }
  // The row of the whole sequence at row `local` of the shard.
  int64_t global_row(int64_t local) const {
    return local < chunk ? first_begin + local : second_begin + (local - chunk);
  }
};
Shard shard_of(Layout layout, int rank, int world, int64_t seqlen);

// One attention call of a ring step: queries [q_begin, q_begin + q_rows) of this rank's shard
// against keys [kv_begin, kv_begin + kv_rows) of the visiting shard, with a mask aligned as
// AttentionOptions' (bottom-right: the ranges' last rows line up): causal, a window (-1: that side
// unbounded) or none.
struct StepCall {
  int64_t q_begin, q_rows, kv_begin, kv_rows;
  bool causal = false;
  int window_left = -1, window_right = -1;
  // Whether query q_begin + i sees key kv_begin + j.
  bool shows(int64_t i, int64_t j) const {
    const int64_t diagonal = i + kv_rows - q_rows;
    const int64_t right = causal ? 0 : window_right;
    return (right < 0 || j <= diagonal + right) && (window_left < 0 || j >= diagonal - window_left);
  }
};
struct Options;
// The calls of the step where `rank` holds the K/V shard of `source` (none where the mask hides all
// of it), for shards of `shard_rows` rows, under options' layout, causal and window. No mask: the
// whole shards. Causal, contiguous: the diagonal shard causal, earlier ones whole, later ones
// nothing. Causal, zigzag: the own shard causal; an earlier rank's first chunk seen by all queries,
// a later rank's whole shard by the second chunk's queries, both unmasked. A window: each pair of
// chunks (the query's, the key's) trimmed to the rows the band reaches, adjacent unmasked calls
// joined; the own shard's diagonal calls (which cover every row) come first.
std::vector<StepCall> step_calls(const Options& options, int rank, int source, int world, int64_t shard_rows);

// Moves buffers between the ranks of a ring, ordered on CUDA streams. Every rank makes the same
// calls with the same sizes, in the same order.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Sends `bytes` at `send` to rank + 1 and receives as many from rank - 1 into `recv` (mod size).
  // Work queued on `stream` afterwards sees `recv` filled and may overwrite `send`.
  virtual void shift(const void* send, void* recv, size_t bytes, void* stream) = 0;
  // Gathers `bytes` at `send` from every rank into `recv` (size() * bytes, in rank order).
  virtual void all_gather(const void* send, void* recv, size_t bytes, void* stream) = 0;
};

// N virtual ranks on one GPU, for tests and benchmarks of the whole schedule on one device (NCCL
// refuses two ranks on one device): endpoint(r) is rank r's transport, moving data by device
// copies. Each rank runs on a host thread of its own (started by the first run() and kept): a shift
// or gather returns once every rank has posted its part. A rank that throws aborts the others'
// waits. Many streams at once: set CUDA_DEVICE_MAX_CONNECTIONS to 32 or more before the first CUDA
// call, or the driver's 8 default hardware queues make the ranks' streams wait on each other.
class LocalRing {
 public:
  explicit LocalRing(int world);
  ~LocalRing();
  LocalRing(const LocalRing&) = delete;
  LocalRing& operator=(const LocalRing&) = delete;

  int size() const;
  Transport& endpoint(int rank);
  // Runs body(rank, endpoint(rank)) on the `size()` rank threads and waits for all of them;
  // rethrows the first error (other ranks' "a rank failed" errors aside).
  void run(const std::function<void(int rank, Transport& transport)>& body);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// NCCL, loaded at run time (FLASHJIT_NCCL_LIBRARY, else libnccl.so.2 from the library path, as
// PyTorch's wheel brings it), so flashjit builds and runs where NCCL is absent; constructing a
// transport there throws Error(no_driver) naming what is missing. Point-to-point sends and
// receives on the communicator the application made (ncclComm_t, as a pointer), or one made here
// from a unique id (every rank passes the same id, from nccl_unique_id() on rank 0).
class NcclTransport : public Transport {
 public:
  explicit NcclTransport(void* nccl_comm);
  NcclTransport(const std::vector<char>& unique_id, int rank, int world);
  ~NcclTransport() override;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return world_; }
  void shift(const void* send, void* recv, size_t bytes, void* stream) override;
  void all_gather(const void* send, void* recv, size_t bytes, void* stream) override;

 private:
  void* comm_ = nullptr;
  bool owns_comm_ = false;
  int rank_ = 0, world_ = 1;
};
// A new NCCL unique id (128 bytes) for NcclTransport's second constructor.
std::vector<char> nccl_unique_id();
// The NCCL library's version (e.g. 22703), or the reason it cannot be loaded.
std::optional<int> nccl_version(std::string* why_not = nullptr);

struct Options {
  Layout layout = Layout::zigzag;
  bool causal = false;
  // A sliding window over the whole sequence's positions, as AttentionOptions' (-1: unbounded).
  int window_left = -1, window_right = -1;
  std::optional<float> softmax_scale;  // default 1 / sqrt(head_dim)
  float softcap = 0.f;
  Backend backend = Backend::automatic;
  // SMs the attention kernels leave free, e.g. for NCCL's kernels beside them (AttentionOptions).
  int sm_margin = 0;
  // A packed batch of sequences (varlen): the whole sequences' lengths, in order, each dividing into
  // the layout's chunks (N, or 2N zigzag). q, k, v and out are then (total shard rows, heads,
  // head_dim): every sequence's shard (shard_of over its own length) packed in order, and lse
  // (heads_q, total shard rows). Empty: a dense batch. Not with a window yet.
  std::vector<int64_t> seqlens;
  // Exchange a small header first (one all-gather and a wait on the stream) and refuse shards whose
  // shapes, dtypes or options differ between ranks, which would otherwise hang or read garbage.
  bool check_shapes = true;
  void* stream = nullptr;  // CUstream; nullptr = the legacy default stream
};

// This rank's part of ring attention over the whole sequence: q, out (batch, shard rows, heads_q,
// head_dim) and k, v (batch, shard rows, heads_kv, head_dim) are its shards (shard_of), any strides
// with the last dim contiguous; lse optional float32 (batch, heads_q, shard rows). Every rank of
// `transport` calls it with the same shapes and options. The K/V shards (only the KV heads) travel
// in a double-buffered ring: step s + 1's exchange runs on a stream of its own while step s
// computes. sm_90 only (the continuing forward); fp16/bf16, head dims up to 256, GQA, causal, a sliding
// window, both or neither.
void forward(Runtime& runtime, Transport& transport, const TensorView& q, const TensorView& k, const TensorView& v,
             const TensorView& out, const TensorView* lse, const Options& options = {});

// This rank's part of forward()'s backward: out and lse (required) the forward's shards, dout like
// out, dq, dk, dv like q, k, v. The K/V shards travel as in the forward, each followed one step
// behind by the fp32 sums of its dK and dV, to which every rank adds its share; a shard's owner
// computes its own shard last and writes the finished dK and dV, so every gradient is rounded to
// 16 bits once. dQ sums in fp32 on its rank across the steps. sm_90 (sm90_bwd, atomic dQ).
void backward(Runtime& runtime, Transport& transport, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& out, const TensorView& dout, const TensorView& lse, const TensorView& dq,
              const TensorView& dk, const TensorView& dv, const Options& options = {});

}  // namespace flashjit::ring
