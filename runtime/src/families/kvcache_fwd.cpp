// kvcache_fwd at run time: forward_kvcache's entry sequence. append_kv writes the new tokens into
// the cache; attention runs (splits, KV heads x query tiles, batch) CTAs. With several splits, on
// sm_90 a row's splits are one thread-block cluster that merges them itself (up to the largest
// cluster the device holds of the kernel); otherwise combine merges the splits' fp32 partials, from
// a stream-ordered workspace. On sm_90 each entry is launched over the previous kernel's tail and waits for it before its first read.
// Nothing is read back from the device, so a call can be captured in a CUDA graph and replayed with
// other cache_seqlens and block tables.
#include "kvcache_fwd.hpp"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <set>
#include <tuple>

#include <fmt/format.h>

#include "../family.hpp"
#include "../tma.hpp"

namespace flashjit::detail {

KvSplits choose_kv_splits(long long ctas, const KvSplitSlots& slots, int key_tiles, long long tile_bytes,
                          bool whole_tile_copies, int requested) {
  // A split count is timed as its waves of CTAs (the slots it runs in at a time), each wave as long
  // as one CTA's share of tiles takes at the rate the wave's CTAs get, plus a fixed cost per wave (a
  // CTA's prologue and epilogue) and, with more than one split, the merge. Fitted on the H200
  // (bench/results/decode_splits_h200_*.json): a CTA alone streams about 60 GB/s when each TMA copy
  // is a whole tile (its ring's depth over the memory's latency), so 32 CTAs reach 1.96 TB/s and 128
  // reach 4.0, and about 48 GB/s through copies of a page (16 rows: four copies per tile) or
  // cp.async gathers; the memory gives 4.5 TB/s, 3% less once more CTAs stream than there are SMs
  // (batch 16 x 16k: 128 CTAs 4.49 TB/s, 256 4.37); a wave costs about 1.5 us besides its bytes,
  // the combine about 2.5 and 0.5 more per 16 splits (a round of partial loads; pages of 16 at batch
  // 1 x 4k: 16 splits 1.48 TB/s, 32 1.35), a merge inside the cluster about 0.3, its CTAs in the
  // cluster slots, one per SM (batch 1 x 1k: 8 splits in clusters 605 GB/s, 16 with the combine 545).
  const double kCtaBytesPerSecond = whole_tile_copies ? 60e9 : 48e9;
  constexpr double kMemoryBytesPerSecond = 4.5e12, kCrowdedShare = 0.97;
  constexpr double kWaveSeconds = 1.5e-6, kCombineSeconds = 2.5e-6, kCombineSecondsPerSplit = 0.03e-6;
  constexpr double kClusterMergeSeconds = 0.3e-6;
  const int sm_count = slots.sm_count;
  const long long resident_slots = std::max(1ll, static_cast<long long>(slots.resident_ctas_per_sm) * sm_count);
  // What each of `running` CTAs streams: the lesser of a CTA's rate and its part of the memory's,
  // joined by a 4-norm (near the crossover both limit it in part).
  auto cta_rate = [&](long long running) {
    const double alone = 1.0 / (running * kCtaBytesPerSecond);
    const double memory = 1.0 / (kMemoryBytesPerSecond * (running > sm_count ? kCrowdedShare : 1.0));
    return 1.0 / std::sqrt(std::sqrt(alone * alone * alone * alone + memory * memory * memory * memory)) / running;
  };
  // The kernel gives each of `splits` ceil(key_tiles / splits) tiles: only the splits that get any run.
  auto time_of = [&](int splits, bool in_cluster) {
    const int share = (key_tiles + splits - 1) / splits;
    const long long at_once = in_cluster ? slots.cluster_ctas[splits] : resident_slots;
    const long long ctas_used = ctas * splits, full_waves = ctas_used / at_once, rest = ctas_used % at_once;
    const double cta_bytes = static_cast<double>(share) * tile_bytes;
    double time = full_waves * (cta_bytes / cta_rate(std::min(ctas_used, at_once)) + kWaveSeconds);
    if (rest > 0) time += cta_bytes / cta_rate(rest) + kWaveSeconds;
    if (splits > 1) time += in_cluster ? kClusterMergeSeconds : kCombineSeconds + kCombineSecondsPerSplit * splits;
    return time;
  };
  // The faster merge of `splits`: inside clusters where the kernel can, else the combine.
  auto best_merge = [&](int splits) {
    const double combined = time_of(splits, false);
    if (splits > 1 && splits <= kMaxClusterCtas && slots.cluster_ctas[splits] > 0) {
      const double in_cluster = time_of(splits, true);
      if (in_cluster <= combined) return std::pair{KvSplits{splits, true}, in_cluster};
    }
    return std::pair{KvSplits{splits, false}, combined};
  };
  if (requested > 0) return best_merge(std::clamp(requested, 1, std::max(1, key_tiles))).first;
  KvSplits best;
  double best_time = 1e300;
  for (int splits = 1; splits <= std::min(std::max(1, key_tiles), kMaxKvSplits); ++splits) {
    const int share = (key_tiles + splits - 1) / splits;
    if ((key_tiles + share - 1) / share != splits) continue;  // the same tiles as a smaller count
    const auto [choice, time] = best_merge(splits);
    if (time < best_time * 0.999) {
      best = choice;
      best_time = time;
    }
  }
  return best;
}

namespace {

// Module globals flashjit_kvcache_status already handed to a call, per device: check_kvcache reads
// and clears them.
struct StatusWords {
  std::mutex mutex;
  std::set<std::pair<CUlibrary, int>> registered;  // (module, device) pairs already looked up
  std::set<std::pair<int, CUdeviceptr>> words;
};
StatusWords& status_words() {
  static StatusWords words;
  return words;
}

void register_status_word(const LoadedKernel& kernel, int device) {
  StatusWords& all = status_words();
  std::lock_guard<std::mutex> lock(all.mutex);
  if (all.registered.count({kernel.library, device}) != 0) return;
  CUdeviceptr word = 0;
  size_t bytes = 0;
  FLASHJIT_CU(cuLibraryGetGlobal, &word, &bytes, kernel.library, "flashjit_kvcache_status");
  all.words.insert({device, word});
  all.registered.insert({kernel.library, device});
}

std::optional<std::string> unusable_reason(const PassProblem&, const Arch&) { return std::nullopt; }

// The decode and taller query tiles over the key tiles, warps and ring depths validate() accepts.
std::vector<KernelSpec> tuning_candidates(const KernelSpec& base) {
  return tile_grid_candidates(base, {16, 32, 64}, {32, 64, 128}, {4, 8}, {2, 3, 4, 6});
}

// The packed rows of one KV head (queries x group) in as few m16 tiles as hold them, up to 64 per
// CTA, with the deepest ring and longest key tile that fit beside them (the default spec's when
// none does).
void fit_to_problem(KernelSpec& spec, const PassProblem& problem) {
  const ForwardProblem& f = problem.forward;
  const long long rows = static_cast<long long>(f.seqlen_q) * (f.heads_q / std::max(1, f.heads_kv));
  KernelSpec fitted = spec;
  fitted.block_m = rows <= 16 ? 16 : rows <= 32 ? 32 : 64;
  if (fitted.block_m <= spec.block_m) return;  // the default's rows already hold them
  for (auto [block_n, stages] : {std::pair{64, 3}, {64, 2}, {32, 4}, {32, 3}, {32, 2}}) {
    fitted.block_n = block_n;
    fitted.num_stages = stages;
    if (!fitted.validate()) {
      spec = fitted;
      return;
    }
  }
}

// The rows of K and V one TMA copy takes, or 0 where the cache is read with cp.async: a kernel with
// the attention_tma entry (kTmaCapable) whose head dim is the problem's, and pages that hold whole
// key tiles or tile them in copies of at least 16 rows (smaller pages, and 24, 48, ..., gather by row: 8-row
// copies ran at 2.6 TB/s on the H200, cp.async at 3.7).
int kv_tma_rows(const FamilyCall& call, const KvCacheProblem& problem) {
  const KernelSpec& spec = call.spec;
  const AttentionKvCacheParams& a = problem.params;
  const AttentionFwdParams& f = problem.forward.params;
  if (call.layout().constant("kTmaCapable") == 0 || f.head_dim != spec.head_dim || a.capacity < 1) return 0;
  int rows = 0;
  if (!problem.is_paged || a.page_size % spec.block_n == 0) rows = spec.block_n;
  else if (spec.block_n % a.page_size == 0 && a.page_size >= 16) rows = a.page_size;
  if (rows == 0) return 0;
  for (auto [name, data, row_stride, head_stride] : {std::tuple{"k_cache", f.k, f.k_row_stride, f.k_head_stride},
                                                     std::tuple{"v_cache", f.v, f.v_row_stride, f.v_head_stride}})
    if (tma_unusable_reason(name, data, row_stride, head_stride, name[0] == 'k' ? a.k_page_stride : a.v_page_stride,
                            a.page_size, f.num_heads_kv, a.num_pages))
      return 0;
  return rows;
}

void run(const FamilyCall& call) {
  const KvCacheProblem& problem = call.kvcache();
  const ForwardProblem& f = problem.forward;
  AttentionKvCacheParams params = problem.params;
  register_status_word(call.kernel, f.device);
  const unsigned batch = static_cast<unsigned>(f.batch);
  const int threads = call.layout().threads;

  const int group = f.heads_q / f.heads_kv;
  const unsigned m_blocks = blocks(static_cast<long long>(f.seqlen_q) * group, call.spec.block_m);
  if (static_cast<long long>(m_blocks) * f.heads_kv > 65535)  // before anything is launched
    throw Error(ErrorCode::invalid_argument, "forward_kvcache",
                fmt::format("heads_kv {} x {} query tiles of {} rows exceed the grid limit of 65535", f.heads_kv,
                            m_blocks, call.spec.block_m));

  if (problem.seqlen_new > 0) {
    const long long chunks = static_cast<long long>(problem.seqlen_new) * f.heads_kv * (f.head_dim / 8);
    call.launch("append_kv", Grid{blocks(chunks, threads), batch}, params, StreamOrder::overlapping_tail);
  }
  if (f.is_empty()) return;

  const long long ctas = static_cast<long long>(m_blocks) * f.heads_kv * f.batch;
  params.kv_tma_rows = kv_tma_rows(call, problem);
  const char* attention = params.kv_tma_rows > 0 ? "attention_tma" : "attention";
  const int resident = std::max(1, call.kernel.resident_ctas(attention, f.device));
  const int key_tiles = static_cast<int>(blocks(std::max(1, f.seqlen_k), call.spec.block_n));
  const long long tile_bytes = 2ll * call.spec.block_n * f.head_dim * 2;  // K and V, 16-bit elements
  const bool whole_tile_copies = params.kv_tma_rows == call.spec.block_n;
  KvSplitSlots slots{call.device.sm_count, resident, call.kernel.clusters_at_once(attention, f.device)};
  for (int s = 0; s <= kMaxClusterCtas; ++s) slots.cluster_ctas[s] *= s;  // clusters -> CTAs
  const KvSplits splits = choose_kv_splits(ctas, slots, key_tiles, tile_bytes, whole_tile_copies, f.num_splits);
  params.num_splits = splits.count;
  params.merge_in_cluster = splits.in_cluster;

  if (params.kv_tma_rows > 0) {
    const AttentionFwdParams& a = f.params;
    params.k_map = make_kv_cache_tma_map(a.k, f.dtype, a.head_dim, params.page_size, a.num_heads_kv, params.num_pages,
                                         a.k_row_stride, a.k_head_stride, params.k_page_stride, params.kv_tma_rows);
    params.v_map = make_kv_cache_tma_map(a.v, f.dtype, a.head_dim, params.page_size, a.num_heads_kv, params.num_pages,
                                         a.v_row_stride, a.v_head_stride, params.v_page_stride, params.kv_tma_rows);
  }

  std::optional<StreamWorkspace> workspace;
  const bool combine = params.num_splits > 1 && !params.merge_in_cluster;
  if (combine) {
    const size_t rows = static_cast<size_t>(params.num_splits) * f.batch * f.heads_q * f.seqlen_q;
    const size_t o_bytes = (rows * call.spec.head_dim * sizeof(float) + 255) / 256 * 256;
    workspace.emplace(f.device, call.stream, o_bytes + rows * sizeof(float));
    params.partial_o = reinterpret_cast<float*>(workspace->get());
    params.partial_lse = reinterpret_cast<float*>(workspace->get() + o_bytes);
  }
  const unsigned split_ctas = static_cast<unsigned>(params.num_splits);
  call.launch(attention, Grid{split_ctas, m_blocks * f.heads_kv, batch, params.merge_in_cluster ? split_ctas : 1u}, params,
              StreamOrder::overlapping_tail);
  if (combine) {
    const long long rows = static_cast<long long>(f.heads_q) * f.seqlen_q;
    call.launch("combine", Grid{blocks(rows, threads / 32), batch}, params, StreamOrder::overlapping_tail);
  }
}

}  // namespace

void check_kvcache_status(CUstream stream) {
  FLASHJIT_CU(cuStreamSynchronize, stream);
  StatusWords& all = status_words();
  std::lock_guard<std::mutex> lock(all.mutex);
  std::optional<std::string> first;
  for (const auto& [device, word] : all.words) {
    make_context_current(device);
    int status[4] = {0, 0, 0, 0};
    FLASHJIT_CU(cuMemcpyDtoH, status, word, sizeof(status));
    if (status[0] == 0) continue;
    FLASHJIT_CU(cuMemsetD8, word, 0, sizeof(status));
    if (first) continue;
    if (status[0] == kKvCacheSeqlenOutOfRange)
      first = fmt::format("cache_seqlens[{}] is {}, expected 0 to {} (the tokens a sequence's cache or block_table "
                          "holds, less this call's new ones); that sequence's output rows are NaN",
                          status[1], status[2], status[3]);
    else if (status[0] == kKvCachePageOutOfRange)
      first = fmt::format("block_table[{}][{}] is {}, not a page id of k_cache (expected 0 <= id < num_pages); "
                          "that sequence's output rows are NaN",
                          status[1], status[2], status[3]);
    else
      first = fmt::format("kvcache status code {} (batch {}, index {}, value {})", status[0], status[1], status[2],
                          status[3]);
  }
  if (first) throw Error(ErrorCode::invalid_argument, "check_kvcache", *first);
}

extern const RuntimeFamily kKvCacheFwdFamily;
const RuntimeFamily kKvCacheFwdFamily{Family::kvcache_fwd, Pass::kvcache, Backend::automatic, /*automatic=*/true,
                                      Family::kvcache_fwd, unusable_reason, tuning_candidates, run, fit_to_problem};

}  // namespace flashjit::detail
