// Ring attention's forward on one rank. The K/V shards travel in two buffers (each K then V,
// (batch, shard rows, heads_kv, head_dim) contiguous): step s > 0 computes with the shard in buffer
// s % 2 while the exchange on the communication stream fills the other with step s + 1's (step 0
// reads the rank's own k and v while their copy into buffer 0 goes out). Each
// step's calls (step_calls) continue a running fp32 state (ForwardContinuation): the first starts
// it, the last writes out and the LSE.
#include <algorithm>
#include <cstring>
#include <mutex>

#include <fmt/format.h>

#include "../driver.hpp"
#include "../module_cache.hpp"
#include "../workspace.hpp"
#include "flashjit/ring.hpp"

namespace flashjit::ring {

namespace {

Error bad(const std::string& message) { return Error(ErrorCode::invalid_argument, "ring forward", message); }

// What every rank must agree on, compared after one all-gather.
struct Header {
  int64_t world, layout, causal, dtype, batch, shard_rows, heads_q, heads_kv, head_dim, has_lse;
  uint32_t scale_bits, softcap_bits;
};
constexpr const char* kHeaderFields[] = {"ring size", "layout",   "causal",   "dtype",    "batch", "shard rows",
                                         "heads_q",   "heads_kv", "head_dim", "lse given"};

// A communication stream and the events of one call, lent from a per-process pool (creating a
// stream per call cost more than a short step). A set returns once its call has queued its work: the
// next call to take it queues behind what is left on the stream and records the events anew.
struct ExchangeSet {
  int device;
  CUstream comm = nullptr;
  CUevent inputs_ready = nullptr, comm_done = nullptr, received[2] = {}, computed[2] = {};
};
class ExchangeSetLease {
 public:
  explicit ExchangeSetLease(int device) {
    {
      std::lock_guard<std::mutex> lock(mutex());
      auto& free = free_sets();
      auto it = std::find_if(free.begin(), free.end(), [&](const auto& s) { return s->device == device; });
      if (it != free.end()) {
        set_ = std::move(*it);
        free.erase(it);
        return;
      }
    }
    set_ = std::make_unique<ExchangeSet>();
    set_->device = device;
    FLASHJIT_CU(cuStreamCreate, &set_->comm, CU_STREAM_NON_BLOCKING);
    for (CUevent* e : {&set_->inputs_ready, &set_->comm_done, &set_->received[0], &set_->received[1], &set_->computed[0],
                       &set_->computed[1]})
      FLASHJIT_CU(cuEventCreate, e, CU_EVENT_DISABLE_TIMING);
  }
  ~ExchangeSetLease() {
    std::lock_guard<std::mutex> lock(mutex());
    free_sets().push_back(std::move(set_));
  }
  ExchangeSet& operator*() const { return *set_; }
  ExchangeSet* operator->() const { return set_.get(); }

 private:
  // (Never destroyed: the driver may be gone at exit.)
  static std::mutex& mutex() {
    static auto* m = new std::mutex;
    return *m;
  }
  static std::vector<std::unique_ptr<ExchangeSet>>& free_sets() {
    static auto* sets = new std::vector<std::unique_ptr<ExchangeSet>>;
    return *sets;
  }
  std::unique_ptr<ExchangeSet> set_;
};

void check_shard(const TensorView& t, const char* name) {
  if (t.rank != 4) throw bad(fmt::format("{}: expected 4 dims (batch, shard rows, heads, head_dim), got {}", name, t.rank));
}

// This rank's calls over all steps, in order, each with the rows it ends: the calls' query ranges
// are suffixes of the shard ([0 or a chunk, rows)) and the first covers every row, so a call's
// rows end where no later call starts at or before them: a prefix of the call.
struct PlannedCall {
  int step;
  StepCall call;
  int64_t final_rows;
};
std::vector<PlannedCall> plan_calls(const Options& options, int rank, int world, int64_t shard_rows) {
  std::vector<PlannedCall> plan;
  for (int s = 0; s < world; ++s)
    for (const StepCall& call : step_calls(options.layout, options.causal, rank, (rank - s + world) % world, world, shard_rows)) {
      if (call.q_begin + call.q_rows != shard_rows || (plan.empty() && call.q_begin != 0))
        throw Error(ErrorCode::internal, "ring forward", "a step's query range is not a suffix of the shard");
      plan.push_back({s, call, 0});
    }
  int64_t later_begin = shard_rows;  // the first row a later call covers
  for (auto it = plan.rbegin(); it != plan.rend(); ++it) {
    it->final_rows = std::max<int64_t>(0, later_begin - it->call.q_begin);
    later_begin = std::min(later_begin, it->call.q_begin);
  }
  return plan;
}

// Rows [0, rows) of `t` starting at row `begin` (dim 1).
TensorView rows_of(const TensorView& t, int64_t begin, int64_t rows) {
  TensorView v = t;
  v.data = static_cast<char*>(t.data) + begin * t.strides[1] * element_size(t.dtype);
  v.shape[1] = rows;
  return v;
}

// LSE-shaped (batch, heads, rows) view starting at row `begin`.
TensorView lse_rows(const TensorView& lse, int64_t begin, int64_t rows) {
  TensorView v = lse;
  v.data = static_cast<float*>(lse.data) + begin * lse.strides[2];
  v.shape[2] = rows;
  return v;
}

// Copies k (or v) into its part of a travel buffer, (batch, rows, heads_kv, head_dim) contiguous:
// one 2-D copy per batch entry where a row's heads are contiguous, else one per (batch, head).
void pack(const TensorView& t, char* destination, CUstream stream) {
  const int64_t batch = t.shape[0], rows = t.shape[1], heads = t.shape[2], dim = t.shape[3];
  const size_t element = element_size(t.dtype), row_bytes = heads * dim * element;
  const bool heads_contiguous = heads == 1 || t.strides[2] == dim;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < (heads_contiguous ? 1 : heads); ++h) {
      CUDA_MEMCPY2D copy{};
      copy.srcMemoryType = copy.dstMemoryType = CU_MEMORYTYPE_DEVICE;
      copy.srcDevice = reinterpret_cast<CUdeviceptr>(static_cast<const char*>(t.data) +
                                                     (b * t.strides[0] + h * t.strides[2]) * element);
      copy.srcPitch = t.strides[1] * element;
      copy.dstDevice = reinterpret_cast<CUdeviceptr>(destination + b * rows * row_bytes + h * dim * element);
      copy.dstPitch = row_bytes;
      copy.WidthInBytes = heads_contiguous ? row_bytes : dim * element;
      copy.Height = rows;
      if (rows == 1) copy.srcPitch = std::max<size_t>(copy.srcPitch, copy.WidthInBytes);  // (any pitch for one row)
      FLASHJIT_CU(cuMemcpy2DAsync, &copy, stream);
    }
}

// All ranks' headers against this one's; throws naming the first field and rank that differ.
void compare_headers(const std::vector<Header>& all, int rank) {
  const Header& mine = all[rank];
  for (size_t r = 0; r < all.size(); ++r) {
    const int64_t* a = &all[r].world;
    const int64_t* b = &mine.world;
    for (size_t f = 0; f < std::size(kHeaderFields); ++f)
      if (a[f] != b[f])
        throw bad(fmt::format("rank {} has {} {} but rank {} has {}: every rank must call with the same shapes and "
                              "options", r, kHeaderFields[f], a[f], rank, b[f]));
    if (all[r].scale_bits != mine.scale_bits || all[r].softcap_bits != mine.softcap_bits)
      throw bad(fmt::format("rank {} has another softmax_scale or softcap than rank {}", r, rank));
  }
}

}  // namespace

void forward(Runtime& runtime, Transport& transport, const TensorView& q, const TensorView& k, const TensorView& v,
             const TensorView& out, const TensorView* lse, const Options& options) {
  const int world = transport.size(), rank = transport.rank();
  check_shard(q, "q");
  check_shard(k, "k");
  check_shard(v, "v");
  check_shard(out, "out");
  if (k.shape[1] != q.shape[1])
    throw bad(fmt::format("k has {} shard rows but q has {}: a ring shards one sequence, self-attention", k.shape[1],
                          q.shape[1]));
  if (q.dtype != ScalarType::float16 && q.dtype != ScalarType::bfloat16)
    throw bad(fmt::format("q: expected dtype float16 or bfloat16, got {}", flashjit::to_string(q.dtype)));
  const int64_t shard_rows = q.shape[1];
  if (options.layout == Layout::zigzag && shard_rows % 2 != 0)
    throw bad(fmt::format("a zigzag shard holds two equal chunks: {} rows do not split in two", shard_rows));
  const float scale = options.softmax_scale.value_or(1.f / std::sqrt(static_cast<float>(q.shape[3])));

  detail::driver();
  detail::make_context_current(q.device);
  const auto stream = static_cast<CUstream>(options.stream);

  if (options.check_shapes) {
    Header header{world, static_cast<int64_t>(options.layout), options.causal, static_cast<int64_t>(q.dtype),
                  q.shape[0], shard_rows, q.shape[2], k.shape[2], q.shape[3], lse != nullptr, 0, 0};
    std::memcpy(&header.scale_bits, &scale, 4);
    std::memcpy(&header.softcap_bits, &options.softcap, 4);
    detail::StreamWorkspace headers(q.device, stream, sizeof(Header) * (world + 1));
    const CUdeviceptr mine = headers.get() + sizeof(Header) * world;
    FLASHJIT_CU(cuMemcpyHtoDAsync, mine, &header, sizeof(Header), stream);
    transport.all_gather(reinterpret_cast<void*>(mine), reinterpret_cast<void*>(headers.get()), sizeof(Header), stream);
    std::vector<Header> all(world);
    FLASHJIT_CU(cuMemcpyDtoHAsync, all.data(), headers.get(), sizeof(Header) * world, stream);
    FLASHJIT_CU(cuStreamSynchronize, stream);
    compare_headers(all, rank);
  }
  const int64_t batch = q.shape[0], heads_q = q.shape[2], heads_kv = k.shape[2], head_dim = q.shape[3];
  if (batch == 0 || shard_rows == 0 || heads_q == 0) return;

  // The travel buffers, the running O (laid out as the LSE, head_dim values per entry) and, when the
  // caller wants no LSE, a running LSE of our own.
  const size_t element = element_size(q.dtype);
  const size_t kv_bytes = 2 * static_cast<size_t>(batch * shard_rows * heads_kv * head_dim) * element;
  TensorView running_lse =
      lse != nullptr ? *lse : TensorView::contiguous(nullptr, ScalarType::float32, {batch, heads_q, shard_rows}, q.device);
  if (running_lse.rank != 3) throw bad(fmt::format("lse: expected 3 dims (batch, heads_q, shard rows), got {}", running_lse.rank));
  const int64_t lse_extent =
      running_lse.strides[0] * (batch - 1) + running_lse.strides[1] * (heads_q - 1) + running_lse.strides[2] * (shard_rows - 1) + 1;
  auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const size_t state_offset = world > 1 ? 2 * aligned(kv_bytes) : 0;  // (one rank sends nothing)
  const size_t own_lse_offset = state_offset + aligned(lse_extent * head_dim * sizeof(float));
  detail::StreamWorkspace scratch(q.device, stream, own_lse_offset + (lse == nullptr ? aligned(lse_extent * sizeof(float)) : 0));
  char* buffers[2] = {reinterpret_cast<char*>(scratch.get()), reinterpret_cast<char*>(scratch.get()) + aligned(kv_bytes)};
  if (lse == nullptr) running_lse.data = reinterpret_cast<char*>(scratch.get()) + own_lse_offset;
  TensorView state = TensorView::contiguous(reinterpret_cast<char*>(scratch.get()) + state_offset, ScalarType::float32,
                                            {batch, heads_q, shard_rows, head_dim}, q.device);
  for (int d = 0; d < 3; ++d) state.strides[d] = running_lse.strides[d] * head_dim;

  const ExchangeSetLease exchange(q.device);
  // Step 0 reads this rank's own k and v where they are; their copy into the first travel buffer
  // (to send) runs on the communication stream beside it. (The event marks the inputs ready.)
  FLASHJIT_CU(cuEventRecord, exchange->inputs_ready, stream);
  FLASHJIT_CU(cuStreamWaitEvent, exchange->comm, exchange->inputs_ready, 0);
  if (world > 1) {
    pack(k, buffers[0], exchange->comm);
    pack(v, buffers[0] + kv_bytes / 2, exchange->comm);
  }

  const std::vector<PlannedCall> plan = plan_calls(options, rank, world, shard_rows);
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
      shard_k = TensorView::contiguous(buffers[current], q.dtype, {batch, shard_rows, heads_kv, head_dim}, q.device);
      shard_v = shard_k;
      shard_v.data = buffers[current] + kv_bytes / 2;
    }
    for (; next_call < plan.size() && plan[next_call].step == s; ++next_call) {
      const StepCall& call = plan[next_call].call;
      ForwardContinuation continuation;
      continuation.o_state = state;
      continuation.o_state.data = static_cast<float*>(state.data) + call.q_begin * state.strides[2];
      continuation.o_state.shape[2] = call.q_rows;
      continuation.has_state = next_call > 0;
      continuation.final_rows = plan[next_call].final_rows;
      const TensorView call_lse = lse_rows(running_lse, call.q_begin, call.q_rows);
      AttentionOptions attention;
      attention.softmax_scale = scale;
      attention.causal = call.causal;
      attention.softcap = options.softcap;
      attention.backend = options.backend;
      attention.sm_margin = options.sm_margin;
      attention.stream = options.stream;
      attention.continuation = &continuation;
      runtime.forward(rows_of(q, call.q_begin, call.q_rows), rows_of(shard_k, call.kv_begin, call.kv_rows),
                      rows_of(shard_v, call.kv_begin, call.kv_rows), rows_of(out, call.q_begin, call.q_rows), &call_lse,
                      attention);
    }
    FLASHJIT_CU(cuEventRecord, exchange->computed[current], stream);
  }
  // The scratch memory is freed on `stream`: after the last exchange too.
  FLASHJIT_CU(cuEventRecord, exchange->comm_done, exchange->comm);
  FLASHJIT_CU(cuStreamWaitEvent, stream, exchange->comm_done, 0);
}

}  // namespace flashjit::ring
