// sm90_fwd at run time: one persistent launch of a CTA per SM (less the caller's sm_margin), with
// TMA maps of q, k, v (and o where it can be stored by TMA), the schedule's L2 sections and tail
// splits, and a stream-ordered workspace (the tile counter, the split items' counters, row
// statistics and partial O). Dispatch prefers it on sm_90a wherever TMA can read q, k and v.
#include "sm90_fwd.hpp"

#include <algorithm>
#include <optional>

#include <fmt/format.h>

#include "../family.hpp"
#include "../tma.hpp"

namespace flashjit::detail {

TailSplit choose_tail_split(long long tiles, int ctas, int key_blocks, int requested_splits) {
  const long long remainder = tiles % ctas;
  if (requested_splits == 1 || remainder == 0) return {};
  if (requested_splits > 1) {
    const int splits = std::min(requested_splits, key_blocks);
    return splits > 1 ? TailSplit{remainder, splits} : TailSplit{};
  }
  // The last round of whole tiles takes one tile's time however few CTAs it has work for. Split in
  // k, it takes ceil(remainder k / ctas) rounds of items, each 1 / k of a tile plus an item's own
  // cost: its pipeline's start and drain, the partial O's write and merge, about 8 key blocks' steps
  // (fitted on the H200 at head dim 128: thirds of 26-block tiles lost 3%, halves of 103-block tiles
  // gained 3%). Split only where that saves a fifth of a tile or more, in 4+ key blocks per item.
  constexpr double kItemCostInKeyBlocks = 8.0, kMinimumSaving = 0.2;
  TailSplit best;
  double best_time = 1.0 - kMinimumSaving;
  for (int k = 2; k <= std::min(4, key_blocks / 4); ++k) {
    const long long rounds = (remainder * k + ctas - 1) / ctas;
    const double time = static_cast<double>(rounds) * (1.0 / k + kItemCostInKeyBlocks / key_blocks);
    if (time < best_time) {
      best_time = time;
      best = {remainder, k};
    }
  }
  return best;
}

namespace {

std::optional<std::string> unusable_reason(const PassProblem& problem, const Arch& arch) {
  if (auto reason = hopper_arch_reason(Family::sm90_fwd, arch)) return reason;
  return tma_unusable_reason(problem.forward);  // q, k and v are read through TMA maps
}

// 64-row consumer warpgroups (two or three), key tiles in 16-key steps; validate() drops what the
// registers or shared memory cannot hold. FP8 tiles come in both V modes: transposed in shared
// memory by the producer's spare warps, and transposed beforehand (v_pretransposed).
std::vector<KernelSpec> tuning_candidates(const KernelSpec& base) {
  std::vector<KernelSpec> candidates;
  const bool fp8 = base.dtype == DType::e4m3;
  for (int block_m : {128, 192})
    for (int block_n = 64; block_n <= 256; block_n += 16)
      for (int stages : {2, 3})
        for (bool v_pretransposed : {false, true}) {
          if (v_pretransposed && !fp8) continue;
          KernelSpec s = base;
          s.block_m = block_m;
          s.block_n = block_n;
          s.num_warps = 4 * (1 + block_m / 64);
          s.num_stages = stages;
          s.v_pretransposed = v_pretransposed;
          if (!s.validate()) candidates.push_back(s);
        }
  return candidates;
}

// The persistent forward's CTAs: one per SM the caller leaves to it.
int persistent_ctas(const ForwardProblem& problem, const DeviceProperties& device) {
  if (problem.sm_margin >= device.sm_count)
    throw Error(ErrorCode::invalid_argument, "forward",
                fmt::format("sm_margin {} leaves none of the device's {} SMs", problem.sm_margin, device.sm_count));
  return device.sm_count - problem.sm_margin;
}

// The kernel's arguments: TMA maps and its persistent schedule.
AttentionSm90FwdParams hopper_params(const KernelSpec& spec, const ForwardProblem& problem,
                                     const DeviceProperties& device) {
  const AttentionFwdParams& a = problem.params;
  const auto [rows_q, rows_k, batches] = tma_extents(problem);
  AttentionSm90FwdParams params{};  // (null counter and split buffers until run() sets them)
  params.fwd = a;
  params.q_map = make_attention_tma_map(a.q, problem.dtype, a.head_dim, rows_q, a.num_heads_q, batches,
                                        a.q_row_stride, a.q_head_stride, a.q_batch_stride, spec.block_m);
  params.k_map = make_attention_tma_map(a.k, problem.dtype, a.head_dim, rows_k, a.num_heads_kv, batches,
                                        a.k_row_stride, a.k_head_stride, a.k_batch_stride, spec.block_n);
  params.v_map = make_attention_tma_map(a.v, problem.dtype, a.head_dim, rows_k, a.num_heads_kv, batches,
                                        a.v_row_stride, a.v_head_stride, a.v_batch_stride, spec.block_n);
  // O through TMA stores, one consumer warpgroup's 64 rows per box (the kernel uses it where it
  // can stage O in shared memory).
  // (Not FP8, whose Q slots are laid out for 8-bit values.)
  params.o_via_tma = !problem.is_varlen && !problem.continues && problem.dtype != DType::e4m3 &&
                     !tma_unusable_reason("out", a.o, a.o_row_stride, a.o_head_stride, a.o_batch_stride, rows_q,
                                          a.num_heads_q, batches);
  if (params.o_via_tma)
    params.o_map = make_attention_tma_map(a.o, problem.dtype, a.head_dim, rows_q, a.num_heads_q, batches,
                                          a.o_row_stride, a.o_head_stride, a.o_batch_stride, 64);
  params.num_m_blocks = static_cast<int>(blocks(problem.seqlen_q, spec.block_m));
  // Sections of (batch, head) pairs whose K/V (shared by a GQA group) fill half the L2, so the
  // CTAs working on a section reread K/V from L2 rather than HBM.
  const long long kv_bytes_per_pair =
      std::max(1ll, 2ll * element_bytes(problem.dtype) * problem.seqlen_k * spec.head_dim /
                            (problem.heads_q / problem.heads_kv));
  params.section_pairs = static_cast<int>(std::clamp(device.l2_bytes / 2 / kv_bytes_per_pair, 1ll,
                                                     static_cast<long long>(problem.heads_q) * problem.batch));
  // Tail splits, where the spec has them: automatic only without a mask, where the tiles are equal
  // and the last round is whole tiles; causal tiles already end the schedule with the shortest. Not
  // varlen, whose tiles past a short sequence's end are skipped.
  const long long tiles = static_cast<long long>(params.num_m_blocks) * problem.heads_q * problem.batch;
  const int key_blocks = static_cast<int>(blocks(problem.seqlen_k, spec.block_n));
  TailSplit split;
  // (Nor with a block mask, whose rows differ in length.)
  if (spec.tail_splits && !problem.is_varlen &&
      (problem.num_splits > 1 || (problem.mask == MaskKind::none && !problem.block_sparse)))
    split = choose_tail_split(tiles, persistent_ctas(problem, device), key_blocks, problem.num_splits);
  params.num_split_tiles = static_cast<int>(split.tiles);
  params.splits = split.splits;
  params.q_descale = problem.q_descale;
  params.k_descale = problem.k_descale;
  params.v_descale = problem.v_descale;
  if (problem.block_sparse)
    fit_block_mask_to_tiles(params.fwd.block_mask, spec, /*rows_are_queries=*/true, spec.block_m, spec.block_n, "forward");
  return params;
}

// The scratch memory: the tile counter and split counters (zeroed before the launch), then the
// split items' row statistics and O (fp32, float4-aligned), as codegen laid them out per item.
struct Workspace {
  size_t counters, statistics_offset, output_offset, bytes;
};
Workspace workspace_layout(const KernelLayout& layout, const AttentionSm90FwdParams& params) {
  auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const size_t items = static_cast<size_t>(params.num_split_tiles) * params.splits;
  Workspace w;
  w.counters = 1 + static_cast<size_t>(params.num_split_tiles) * layout.constant("kSplitCountersPerTile");
  w.statistics_offset = aligned(w.counters * sizeof(int));
  w.output_offset = w.statistics_offset + aligned(items * layout.constant("kSplitStatsFloatsPerItem") * sizeof(float));
  w.bytes = w.output_offset + items * layout.constant("kSplitOutputFloatsPerItem") * sizeof(float);
  return w;
}

// v_pretransposed (FP8): V^T's extent (AttentionSm90FwdParams::vt): the kernel's head dim rows of
// `columns` keys per (batch, KV head), columns rounded up to 16; varlen packs the sequences in one
// batch entry with 16 columns of room each (the template's transposed_v_first_column).
struct TransposedV {
  long long columns;
  int batches;
  size_t bytes;
};
TransposedV transposed_v_extent(const ForwardProblem& problem, const KernelSpec& spec) {
  TransposedV t;
  t.columns = problem.is_varlen ? (problem.total_k + 16ll * problem.batch + 15) / 16 * 16
                                : (problem.seqlen_k + 15ll) / 16 * 16;
  t.batches = problem.is_varlen ? 1 : problem.batch;
  t.bytes = static_cast<size_t>(t.columns) * spec.head_dim * problem.heads_kv * t.batches;
  return t;
}

void run(const FamilyCall& call) {
  const ForwardProblem& problem = call.forward();
  AttentionSm90FwdParams params = hopper_params(call.spec, problem, call.device);
  // V transposed beforehand (FP8 specs with v_pretransposed): its pass runs first, into scratch
  // memory that lives (stream-ordered) until the forward has read it.
  std::optional<StreamWorkspace> transposed_v;
  if (call.spec.v_pretransposed && problem.batch > 0 && problem.seqlen_k > 0 && problem.heads_kv > 0) {
    const TransposedV t = transposed_v_extent(problem, call.spec);
    transposed_v.emplace(problem.device, call.stream, t.bytes);
    params.vt = reinterpret_cast<unsigned char*>(transposed_v->get());
    params.vt_row_stride = t.columns;
    params.vt_head_stride = t.columns * call.spec.head_dim;
    params.vt_batch_stride = params.vt_head_stride * problem.heads_kv;
    params.vt_map = make_attention_tma_map(params.vt, DType::e4m3, static_cast<int>(t.columns), call.spec.head_dim,
                                           problem.heads_kv, t.batches, params.vt_row_stride, params.vt_head_stride,
                                           params.vt_batch_stride, call.spec.head_dim);
    call.launch("transpose_v",
                Grid{static_cast<unsigned>(blocks(problem.seqlen_k, 64)), static_cast<unsigned>(problem.heads_kv),
                     static_cast<unsigned>(std::min(problem.batch, 65535))},
                params);
  }
  // One CTA per SM the caller leaves to it, or per work item when there are fewer.
  const long long items = static_cast<long long>(params.num_m_blocks) * problem.heads_q * problem.batch +
                          static_cast<long long>(params.num_split_tiles) * (params.splits - 1);
  const Grid grid{static_cast<unsigned>(std::min<long long>(items, persistent_ctas(problem, call.device)))};
  if (items <= grid.x && params.num_split_tiles == 0) {
    // Every CTA has its one item and no split merges: no counter, so no scratch memory to take
    // and zero (two stream operations, ~2 us of host time per call on the H200 machine).
    call.launch("forward", grid, params);
    return;
  }
  const Workspace layout = workspace_layout(call.layout(), params);
  StreamWorkspace workspace(problem.device, call.stream, layout.bytes);
  FLASHJIT_CU(cuMemsetD32Async, workspace.get(), 0u, layout.counters, call.stream);
  params.tile_counter = reinterpret_cast<int*>(workspace.get());
  params.split_counters = params.tile_counter + 1;
  params.split_row_stats = reinterpret_cast<float*>(workspace.get() + layout.statistics_offset);
  params.split_output = reinterpret_cast<float*>(workspace.get() + layout.output_offset);
  call.launch("forward", grid, params);
}

}  // namespace

extern const RuntimeFamily kSm90FwdFamily;
const RuntimeFamily kSm90FwdFamily{Family::sm90_fwd, Pass::forward, Backend::sm90, /*automatic=*/true, Family::sm90_fwd,
                                   unusable_reason, tuning_candidates, run};

}  // namespace flashjit::detail
