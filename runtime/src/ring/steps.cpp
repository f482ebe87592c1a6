#include "steps.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include <fmt/format.h>

#include "../module_cache.hpp"
#include "../workspace.hpp"

namespace flashjit::ring::detail {

namespace {

// What every rank must agree on, compared after one all-gather.
struct Header {
  int64_t world, layout, causal, window_left, window_right, dtype, batch, shard_rows, heads_q, heads_kv, head_dim, has_lse;
  uint32_t scale_bits, softcap_bits;
};
constexpr const char* kHeaderFields[] = {"ring size", "layout",   "causal",   "window_left", "window_right", "dtype",
                                         "batch",     "shard rows", "heads_q", "heads_kv",   "head_dim",     "lse given"};

// (Never destroyed: the driver may be gone at exit.)
std::mutex& pool_mutex() {
  static auto* m = new std::mutex;
  return *m;
}
std::vector<std::unique_ptr<ExchangeSet>>& free_sets() {
  static auto* sets = new std::vector<std::unique_ptr<ExchangeSet>>;
  return *sets;
}

}  // namespace

ExchangeSetLease::ExchangeSetLease(int device) {
  {
    std::lock_guard<std::mutex> lock(pool_mutex());
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
                     &set_->computed[1], &set_->gradients_received[0], &set_->gradients_received[1]})
    FLASHJIT_CU(cuEventCreate, e, CU_EVENT_DISABLE_TIMING);
}

ExchangeSetLease::~ExchangeSetLease() {
  std::lock_guard<std::mutex> lock(pool_mutex());
  free_sets().push_back(std::move(set_));
}

void check_shards(Transport& transport, const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& out, bool has_lse, const Options& options, const char* pass) {
  auto bad = [&](const std::string& message) { return Error(ErrorCode::invalid_argument, pass, message); };
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}})
    if (t->rank != 4)
      throw bad(fmt::format("{}: expected 4 dims (batch, shard rows, heads, head_dim), got {}", name, t->rank));
  if (k.shape[1] != q.shape[1])
    throw bad(fmt::format("k has {} shard rows but q has {}: a ring shards one sequence, self-attention", k.shape[1],
                          q.shape[1]));
  if (q.dtype != ScalarType::float16 && q.dtype != ScalarType::bfloat16)
    throw bad(fmt::format("q: expected dtype float16 or bfloat16, got {}", flashjit::to_string(q.dtype)));
  const int64_t shard_rows = q.shape[1];
  if (options.layout == Layout::zigzag && shard_rows % 2 != 0)
    throw bad(fmt::format("a zigzag shard holds two equal chunks: {} rows do not split in two", shard_rows));
  if (options.window_left < -1 || options.window_right < -1)
    throw bad(fmt::format("window_size ({}, {}): each side must be -1 (unbounded) or >= 0", options.window_left,
                          options.window_right));
  flashjit::detail::driver();
  flashjit::detail::make_context_current(q.device);
  if (!options.check_shapes) return;
  const int world = transport.size(), rank = transport.rank();
  const float scale = options.softmax_scale.value_or(1.f / std::sqrt(static_cast<float>(q.shape[3])));
  const auto stream = static_cast<CUstream>(options.stream);
  Header header{world, static_cast<int64_t>(options.layout), options.causal, options.window_left, options.window_right,
                static_cast<int64_t>(q.dtype),
                q.shape[0], shard_rows, q.shape[2], k.shape[2], q.shape[3], has_lse, 0, 0};
  std::memcpy(&header.scale_bits, &scale, 4);
  std::memcpy(&header.softcap_bits, &options.softcap, 4);
  flashjit::detail::StreamWorkspace headers(q.device, stream, sizeof(Header) * (world + 1));
  const CUdeviceptr mine = headers.get() + sizeof(Header) * world;
  FLASHJIT_CU(cuMemcpyHtoDAsync, mine, &header, sizeof(Header), stream);
  transport.all_gather(reinterpret_cast<void*>(mine), reinterpret_cast<void*>(headers.get()), sizeof(Header), stream);
  std::vector<Header> all(world);
  FLASHJIT_CU(cuMemcpyDtoHAsync, all.data(), headers.get(), sizeof(Header) * world, stream);
  FLASHJIT_CU(cuStreamSynchronize, stream);
  for (int r = 0; r < world; ++r) {
    const int64_t* theirs = &all[r].world;
    const int64_t* ours = &header.world;
    for (size_t f = 0; f < std::size(kHeaderFields); ++f)
      if (theirs[f] != ours[f])
        throw bad(fmt::format("rank {} has {} {} but rank {} has {}: every rank must call with the same shapes and "
                              "options", r, kHeaderFields[f], theirs[f], rank, ours[f]));
    if (all[r].scale_bits != header.scale_bits || all[r].softcap_bits != header.softcap_bits)
      throw bad(fmt::format("rank {} has another softmax_scale or softcap than rank {}", r, rank));
  }
}

RowRanges joined(RowRanges ranges) {
  std::sort(ranges.begin(), ranges.end());
  RowRanges out;
  for (const auto& r : ranges)
    if (!out.empty() && r.first <= out.back().second) out.back().second = std::max(out.back().second, r.second);
    else if (r.first < r.second) out.push_back(r);
  return out;
}

int64_t covered_rows(int64_t begin, int64_t end, const RowRanges& ranges) {
  int64_t covered = 0;
  for (const auto& [b, e] : joined(ranges)) covered += std::max<int64_t>(0, std::min(end, e) - std::max(begin, b));
  return covered;
}

std::vector<PlannedCall> plan_forward(const Options& options, int rank, int world, int64_t shard_rows) {
  std::vector<PlannedCall> plan;
  for (int s = 0; s < world; ++s)
    for (const StepCall& call : step_calls(options, rank, (rank - s + world) % world, world, shard_rows))
      plan.push_back({s, call});
  auto fail = [] { return Error(ErrorCode::internal, "ring forward", "a step's query rows are not one range of new or merged rows"); };
  for (size_t c = 0; c < plan.size(); ++c) {
    const int64_t begin = plan[c].call.q_begin, end = begin + plan[c].call.q_rows;
    RowRanges earlier, later;
    for (size_t o = 0; o < plan.size(); ++o)
      if (o != c) (o < c ? earlier : later).push_back({plan[o].call.q_begin, plan[o].call.q_begin + plan[o].call.q_rows});
    const int64_t covered_before = covered_rows(begin, end, earlier);
    if (covered_before != 0 && covered_before != end - begin) throw fail();
    plan[c].has_state = covered_before != 0;
    // The rows no later call covers: [begin, end) less the later ranges, one range at most.
    int64_t final_begin = begin, final_end = end;
    for (const auto& [b, e] : joined(later)) {
      if (e <= begin || b >= end) continue;
      if (b <= final_begin) final_begin = std::max(final_begin, e);
      else if (e >= final_end) final_end = std::min(final_end, b);
      else throw fail();  // a later range inside would split the final rows
    }
    plan[c].final_begin = std::min(final_begin, final_end) - begin;
    plan[c].final_rows = std::max<int64_t>(0, final_end - final_begin);
  }
  return plan;
}

std::vector<StepCall> backward_step_calls(const Options& options, int rank, int source, int world, int64_t shard_rows, bool own) {
  std::vector<StepCall> calls = step_calls(options, rank, source, world, shard_rows);
  if (own) std::reverse(calls.begin(), calls.end());
  return calls;
}

bool ends_its_rows(const std::vector<StepCall>& calls, size_t c) {
  RowRanges later_q, later_kv;
  for (size_t o = c + 1; o < calls.size(); ++o) {
    later_q.push_back({calls[o].q_begin, calls[o].q_begin + calls[o].q_rows});
    later_kv.push_back({calls[o].kv_begin, calls[o].kv_begin + calls[o].kv_rows});
  }
  const StepCall& call = calls[c];
  const int64_t q = covered_rows(call.q_begin, call.q_begin + call.q_rows, later_q);
  const int64_t kv = covered_rows(call.kv_begin, call.kv_begin + call.kv_rows, later_kv);
  if (q == 0 && kv == 0) return true;
  if (q != call.q_rows || kv != call.kv_rows)
    throw Error(ErrorCode::internal, "ring backward", "a call of the own step leaves rows that no later call finishes");
  return false;
}

TensorView rows_of(const TensorView& t, int64_t begin, int64_t rows) {
  TensorView v = t;
  v.data = static_cast<char*>(t.data) + begin * t.strides[1] * element_size(t.dtype);
  v.shape[1] = rows;
  return v;
}

TensorView lse_rows(const TensorView& lse, int64_t begin, int64_t rows) {
  TensorView v = lse;
  v.data = static_cast<float*>(lse.data) + begin * lse.strides[2];
  v.shape[2] = rows;
  return v;
}

// One 2-D copy per batch entry where a row's heads are contiguous, else one per (batch, head).
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

}  // namespace flashjit::ring::detail
