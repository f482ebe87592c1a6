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
  int64_t world, layout, causal, window_left, window_right, dtype, batch, shard_rows, heads_q, heads_kv, head_dim, has_lse,
      seqlens_hash;
  uint32_t scale_bits, softcap_bits;
};
constexpr const char* kHeaderFields[] = {"ring size", "layout",   "causal",   "window_left", "window_right",
                                         "dtype",     "batch",    "shard rows", "heads_q",   "heads_kv",
                                         "head_dim",  "lse given", "seqlens (hashed)"};

// FNV-1a over the varlen lengths (0 for a dense batch), so ranks compare them in one field.
int64_t seqlens_hash(const std::vector<int64_t>& seqlens) {
  uint64_t h = seqlens.empty() ? 0 : 1469598103934665603ull;
  for (int64_t length : seqlens)
    for (int byte = 0; byte < 8; ++byte) h = (h ^ ((uint64_t(length) >> (8 * byte)) & 0xff)) * 1099511628211ull;
  return static_cast<int64_t>(h >> 1);
}

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
  const bool varlen = !options.seqlens.empty();
  const int rank_of_shards = varlen ? 3 : 4;
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}})
    if (t->rank != rank_of_shards)
      throw bad(fmt::format("{}: expected {} dims {}, got {}", name, rank_of_shards,
                            varlen ? "(total shard rows, heads, head_dim) with seqlens" : "(batch, shard rows, heads, head_dim)",
                            t->rank));
  const int row_dim = varlen ? 0 : 1;
  if (k.shape[row_dim] != q.shape[row_dim])
    throw bad(fmt::format("k has {} shard rows but q has {}: a ring shards one sequence, self-attention", k.shape[row_dim],
                          q.shape[row_dim]));
  if (q.dtype != ScalarType::float16 && q.dtype != ScalarType::bfloat16)
    throw bad(fmt::format("q: expected dtype float16 or bfloat16, got {}", flashjit::to_string(q.dtype)));
  const int64_t shard_rows = q.shape[row_dim];
  if (!varlen && options.layout == Layout::zigzag && shard_rows % 2 != 0)
    throw bad(fmt::format("a zigzag shard holds two equal chunks: {} rows do not split in two", shard_rows));
  if (varlen && (options.window_left >= 0 || options.window_right >= 0))
    throw bad("seqlens: a window over varlen shards is not supported yet");
  if (options.window_left < -1 || options.window_right < -1)
    throw bad(fmt::format("window_size ({}, {}): each side must be -1 (unbounded) or >= 0", options.window_left,
                          options.window_right));
  flashjit::detail::driver();
  flashjit::detail::make_context_current(q.device);
  if (!options.check_shapes) return;
  const int world = transport.size(), rank = transport.rank();
  const float scale = options.softmax_scale.value_or(1.f / std::sqrt(static_cast<float>(q.shape[q.rank - 1])));
  const auto stream = static_cast<CUstream>(options.stream);
  const int64_t batch = varlen ? static_cast<int64_t>(options.seqlens.size()) : q.shape[0];
  Header header{world,       static_cast<int64_t>(options.layout), options.causal, options.window_left, options.window_right,
                static_cast<int64_t>(q.dtype), batch, shard_rows, q.shape[row_dim + 1], k.shape[row_dim + 1],
                q.shape[row_dim + 2], has_lse, seqlens_hash(options.seqlens), 0, 0};
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
    for (const StepCall& call : calls_of_step(options, rank, (rank - s + world) % world, world, shard_rows))
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

AttentionOptions call_options(const Options& options, const StepCall& call) {
  AttentionOptions attention;
  attention.softmax_scale = options.softmax_scale;  // (unset: the runtime's 1 / sqrt(head_dim))
  attention.causal = call.causal;
  attention.window_left = call.window_left;
  attention.window_right = call.window_right;
  attention.softcap = options.softcap;
  attention.backend = options.backend;
  attention.stream = options.stream;
  return attention;
}

std::vector<StepCall> backward_step_calls(const Options& options, int rank, int source, int world, int64_t shard_rows, bool own) {
  std::vector<StepCall> calls = calls_of_step(options, rank, source, world, shard_rows);
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

VarlenShards varlen_shards(const Options& options, int world, int64_t packed_rows, const char* pass) {
  VarlenShards s;
  s.chunks_per_shard = options.layout == Layout::zigzag ? 2 : 1;
  const int64_t chunks = int64_t(s.chunks_per_shard) * world;
  s.start.push_back(0);
  for (size_t b = 0; b < options.seqlens.size(); ++b) {
    const int64_t length = options.seqlens[b];
    if (length < 0 || length % chunks != 0)
      throw Error(ErrorCode::invalid_argument, pass,
                  fmt::format("seqlens[{}] = {} does not divide into the {} layout's {} equal chunks ({} ranks)", b, length,
                              to_string(options.layout), chunks, world));
    s.chunk.push_back(static_cast<int>(length / chunks));
    s.max_chunk = std::max(s.max_chunk, s.chunk.back());
    s.start.push_back(static_cast<int>(s.start.back() + int64_t(s.chunks_per_shard) * s.chunk.back()));
  }
  if (s.start.back() != packed_rows)
    throw Error(ErrorCode::invalid_argument, pass,
                fmt::format("q has {} packed rows, but the shards of seqlens hold {}", packed_rows, s.start.back()));
  return s;
}

std::vector<int> VarlenShards::call_arrays() const {
  std::vector<int> arrays;
  for (int u = 0; u < chunks_per_shard; ++u) {
    for (int b = 0; b < batch(); ++b) arrays.push_back(start[b] + u * chunk[b]);
    arrays.push_back(start.back());
    arrays.insert(arrays.end(), chunk.begin(), chunk.end());
  }
  return arrays;
}

VarlenBatch chunk_batch(const VarlenShards& shards, const int* device_arrays, int q_chunk, int kv_chunk, int device) {
  const int64_t b = shards.batch();
  auto cu = [&](int u) {
    return TensorView::contiguous(const_cast<int*>(device_arrays) + u * shards.call_array_ints(), ScalarType::int32, {b + 1}, device);
  };
  auto used = [&](int u) {
    return TensorView::contiguous(const_cast<int*>(device_arrays) + u * shards.call_array_ints() + b + 1, ScalarType::int32, {b}, device);
  };
  VarlenBatch batch;
  batch.cu_seqlens_q = cu(q_chunk);
  batch.cu_seqlens_k = cu(kv_chunk);
  batch.seqused_q = used(q_chunk);
  batch.seqused_k = used(kv_chunk);
  batch.max_seqlen_q = batch.max_seqlen_k = shards.max_chunk;
  batch.check_cu_seqlens = false;  // (built here)
  return batch;
}

std::vector<StepCall> calls_of_step(const Options& options, int rank, int source, int world, int64_t shard_rows) {
  if (options.seqlens.empty()) return step_calls(options, rank, source, world, shard_rows);
  return chunk_pair_calls(options, rank, source, world, options.layout == Layout::zigzag ? 2 : 1, /*in_chunks=*/true);
}

TensorView as_batched(const TensorView& t) {
  if (t.rank == 4) return t;
  TensorView v = t;
  v.rank = 4;
  for (int d = 3; d >= 1; --d) {
    v.shape[d] = t.shape[d - 1];
    v.strides[d] = t.strides[d - 1];
  }
  v.shape[0] = 1;
  v.strides[0] = t.shape[0] * t.strides[0];
  return v;
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
  // Wholly contiguous: one plain copy (the copy engine ran a 2D copy of 4 KB rows at half the rate).
  if (heads_contiguous && (rows == 1 || t.strides[1] == heads * dim) &&
      (batch == 1 || t.strides[0] == rows * heads * dim)) {
    FLASHJIT_CU(cuMemcpyDtoDAsync, reinterpret_cast<CUdeviceptr>(destination), reinterpret_cast<CUdeviceptr>(t.data),
                static_cast<size_t>(batch * rows) * row_bytes, stream);
    return;
  }
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
