#include <algorithm>

#include <fmt/format.h>

#include "dispatch.hpp"
#include "driver.hpp"
#include "env.hpp"
#include "flashjit/codegen/render.hpp"
#include "flashjit/flashjit.hpp"
#include "module_cache.hpp"
#include "problem.hpp"
#include "tma.hpp"
#include "workspace.hpp"

namespace flashjit {

using namespace detail;

namespace {

struct Grid {
  unsigned x, y, z;
};

Grid forward_grid(const KernelSpec& spec, const ForwardProblem& p) {
  return {static_cast<unsigned>((p.seqlen_q + spec.block_m - 1) / spec.block_m),
          static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.batch)};
}

unsigned blocks(int extent, int tile) { return static_cast<unsigned>((extent + tile - 1) / tile); }

// The persistent forward's CTAs: one per SM the caller leaves to it.
int persistent_ctas(const ForwardProblem& problem, const DeviceProperties& device) {
  if (problem.sm_margin >= device.sm_count)
    throw Error(ErrorCode::invalid_argument, "forward",
                fmt::format("sm_margin {} leaves none of the device's {} SMs", problem.sm_margin, device.sm_count));
  return device.sm_count - problem.sm_margin;
}

// The Hopper forward's arguments: TMA maps and its persistent schedule.
AttentionSm90FwdParams sm90_forward_params(const KernelSpec& spec, const ForwardProblem& problem,
                                           const DeviceProperties& device) {
  const AttentionFwdParams& a = problem.params;
  const auto [rows_q, rows_k, batches] = tma_extents(problem);
  AttentionSm90FwdParams params;
  params.fwd = a;
  params.q_map = make_attention_tma_map(a.q, problem.dtype, a.head_dim, rows_q, a.num_heads_q, batches,
                                        a.q_row_stride, a.q_head_stride, a.q_batch_stride, spec.block_m);
  params.k_map = make_attention_tma_map(a.k, problem.dtype, a.head_dim, rows_k, a.num_heads_kv, batches,
                                        a.k_row_stride, a.k_head_stride, a.k_batch_stride, spec.block_n);
  params.v_map = make_attention_tma_map(a.v, problem.dtype, a.head_dim, rows_k, a.num_heads_kv, batches,
                                        a.v_row_stride, a.v_head_stride, a.v_batch_stride, spec.block_n);
  // O through TMA stores, one consumer warpgroup's 64 rows per box (the kernel uses it where it
  // can stage O in shared memory).
  params.o_via_tma = !problem.is_varlen && !tma_unusable_reason("out", a.o, a.o_row_stride, a.o_head_stride,
                                                                  a.o_batch_stride, rows_q, a.num_heads_q, batches);
  if (params.o_via_tma)
    params.o_map = make_attention_tma_map(a.o, problem.dtype, a.head_dim, rows_q, a.num_heads_q, batches,
                                          a.o_row_stride, a.o_head_stride, a.o_batch_stride, 64);
  params.num_m_blocks = static_cast<int>(blocks(problem.seqlen_q, spec.block_m));
  // Sections of (batch, head) pairs whose K/V (shared by a GQA group) fill half the L2, so the
  // CTAs working on a section reread K/V from L2 rather than HBM.
  const long long kv_bytes_per_pair =
      std::max(1ll, 4ll * problem.seqlen_k * spec.head_dim / (problem.heads_q / problem.heads_kv));
  params.section_pairs = static_cast<int>(std::clamp(device.l2_bytes / 2 / kv_bytes_per_pair, 1ll,
                                                     static_cast<long long>(problem.heads_q) * problem.batch));
  // Tail splits: automatic only without a mask, where the tiles are equal and the last round is
  // whole tiles; causal tiles already end the schedule with the shortest. Not varlen, whose tiles
  // past a short sequence's end are skipped.
  const long long tiles = static_cast<long long>(params.num_m_blocks) * problem.heads_q * problem.batch;
  const int key_blocks = static_cast<int>(blocks(problem.seqlen_k, spec.block_n));
  TailSplit split;
  if (!problem.is_varlen && (problem.num_splits > 1 || problem.mask == MaskKind::none))
    split = choose_tail_split(tiles, persistent_ctas(problem, device), key_blocks, problem.num_splits);
  params.num_split_tiles = static_cast<int>(split.tiles);
  params.splits = split.splits;
  return params;
}

// One CTA per SM the caller leaves to it, or per work item when there are fewer.
Grid sm90_persistent_grid(const AttentionSm90FwdParams& params, const ForwardProblem& problem,
                          const DeviceProperties& device) {
  const int ctas = persistent_ctas(problem, device);
  const long long items = static_cast<long long>(params.num_m_blocks) * problem.heads_q * problem.batch +
                          static_cast<long long>(params.num_split_tiles) * (params.splits - 1);
  return {static_cast<unsigned>(std::min<long long>(items, ctas)), 1, 1};
}

// The persistent forward's scratch memory: the tile counter and split counters (zeroed before the
// launch), then the split items' row statistics and O (fp32, float4-aligned).
struct Sm90FwdWorkspace {
  size_t counters, statistics_offset, output_offset, bytes;
};
Sm90FwdWorkspace sm90_forward_workspace(const KernelSpec& spec, const AttentionSm90FwdParams& params) {
  auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const size_t items = static_cast<size_t>(params.num_split_tiles) * params.splits;
  Sm90FwdWorkspace w;
  w.counters = 1 + static_cast<size_t>(params.num_split_tiles) * (spec.block_m / 16);
  w.statistics_offset = aligned(w.counters * sizeof(int));
  w.output_offset = w.statistics_offset + aligned(items * spec.block_m * 8 * sizeof(float));
  w.bytes = w.output_offset + items * spec.block_m * spec.head_dim * sizeof(float);
  return w;
}

// Entry indices of the fa2_bwd family, in its fixed order (codegen/src/families/fa2_bwd.cpp).
enum BwdEntry { kPreprocess, kDkdvAtomicDq, kDkdv, kDq, kConvertDq };
// And of sm90_bwd (codegen/src/families/sm90_bwd.cpp).
enum Sm90BwdEntry { kSm90Preprocess, kSm90DkdvAtomicDq, kSm90ConvertDq };

// The Hopper backward's arguments: fa2_bwd's and the TMA maps of q, k, v and dout.
AttentionSm90BwdParams sm90_backward_params(const KernelSpec& spec, const BackwardProblem& problem,
                                            const AttentionBwdParams& bwd) {
  const ForwardProblem& f = problem.forward;
  const AttentionFwdParams& a = bwd.fwd;
  const auto [rows_q, rows_k, batches] = tma_extents(f);
  AttentionSm90BwdParams params;
  params.bwd = bwd;
  params.q_map = make_attention_tma_map(a.q, f.dtype, a.head_dim, rows_q, a.num_heads_q, batches, a.q_row_stride,
                                        a.q_head_stride, a.q_batch_stride, spec.block_m);
  params.do_map = make_attention_tma_map(bwd.d_o, f.dtype, a.head_dim, rows_q, a.num_heads_q, batches,
                                         bwd.do_row_stride, bwd.do_head_stride, bwd.do_batch_stride, spec.block_m);
  params.k_map = make_attention_tma_map(a.k, f.dtype, a.head_dim, rows_k, a.num_heads_kv, batches, a.k_row_stride,
                                        a.k_head_stride, a.k_batch_stride, spec.block_n);
  params.v_map = make_attention_tma_map(a.v, f.dtype, a.head_dim, rows_k, a.num_heads_kv, batches, a.v_row_stride,
                                        a.v_head_stride, a.v_batch_stride, spec.block_n);
  return params;
}

template <class Params>
void launch(const LoadedKernel& kernel, const KernelSpec& spec, int entry, Grid grid, void* stream,
            const Params& params) {
  CUlaunchConfig config{};
  config.gridDimX = grid.x;
  config.gridDimY = grid.y;
  config.gridDimZ = grid.z;
  config.blockDimX = static_cast<unsigned>(threads_per_block(spec));
  config.blockDimY = config.blockDimZ = 1;
  config.sharedMemBytes = static_cast<unsigned>(entry_dynamic_smem_bytes(spec, entry));
  config.hStream = static_cast<CUstream>(stream);
  Params copy = params;
  void* arguments[] = {&copy};
  FLASHJIT_CU(cuLaunchKernelEx, &config, reinterpret_cast<CUfunction>(kernel.entries.at(entry)), arguments,
              nullptr);
}

struct NamedTensor {
  const TensorView* view;  // null: an optional tensor not given
  const char* name;
};

}  // namespace

struct Runtime::Impl {
  KernelCache kernels;
  ModuleCache modules{kernels};
  TuningSources tuning;

  explicit Impl(CacheConfig config) : kernels(std::move(config)) {
    tuning.set_bundled_db(bundled_tuning_db());
    if (const auto& path = environment().tuning_db) tuning.set_user_db(TuningDb::load(*path), *path);
  }

  // `check_on_device` runs once the pointers are known to be device memory, before dispatch.
  template <class DeviceCheck>
  void run_forward(const ForwardProblem& problem, DeviceCheck&& check_on_device,
                   std::initializer_list<NamedTensor> tensors) {
    driver();  // a clear "no CUDA driver" error before anything else needs the GPU
    const DeviceProperties& device = device_properties(problem.device);
    for (const auto& [view, name] : tensors)
      if (view != nullptr) check_device_pointer(*view, name);
    make_context_current(problem.device);
    check_on_device();
    if (problem.is_empty()) return;

    const KernelSpec spec = select_forward_kernel(problem, device, &tuning);
    const LoadedKernel& kernel = modules.get(spec, device);
    if (spec.family == Family::sm90_fwd) {
      // The persistent schedule's counters and the split items' partial outputs, stream-ordered.
      const auto stream = static_cast<CUstream>(problem.stream);
      AttentionSm90FwdParams params = sm90_forward_params(spec, problem, device);
      const Sm90FwdWorkspace layout = sm90_forward_workspace(spec, params);
      StreamWorkspace workspace(problem.device, stream, layout.bytes);
      FLASHJIT_CU(cuMemsetD32Async, workspace.get(), 0u, layout.counters, stream);
      params.tile_counter = reinterpret_cast<int*>(workspace.get());
      params.split_counters = params.tile_counter + 1;
      params.split_row_stats = reinterpret_cast<float*>(workspace.get() + layout.statistics_offset);
      params.split_output = reinterpret_cast<float*>(workspace.get() + layout.output_offset);
      launch(kernel, spec, 0, sm90_persistent_grid(params, problem, device), problem.stream, params);
      return;
    }
    launch(kernel, spec, 0, forward_grid(spec, problem), problem.stream, problem.params);
  }

  // preprocess (delta, zeroed dQ accumulator) -> dkdv with atomic dQ -> convert dQ; or, in
  // deterministic mode, preprocess -> dkdv -> query-outer dq. All on the caller's stream.
  template <class DeviceCheck>
  void run_backward(const BackwardProblem& problem, DeviceCheck&& check_on_device,
                    std::initializer_list<NamedTensor> tensors) {
    const ForwardProblem& f = problem.forward;
    driver();
    const DeviceProperties& device = device_properties(f.device);
    for (const auto& [view, name] : tensors)
      if (view != nullptr) check_device_pointer(*view, name);
    make_context_current(f.device);
    check_on_device();
    // No queries still means dK = dV = 0 to write; no keys, dQ = 0.
    const bool has_queries = f.batch > 0 && f.seqlen_q > 0 && f.heads_q > 0;
    const bool has_keys = f.batch > 0 && f.seqlen_k > 0 && f.heads_kv > 0;
    if (!has_queries && !has_keys) return;

    const KernelSpec spec = select_backward_kernel(problem, device, &tuning);
    const LoadedKernel& kernel = modules.get(spec, device);
    const auto stream = static_cast<CUstream>(f.stream);
    const size_t bytes = problem.deterministic ? problem.delta_bytes()
                                               : problem.dq_accum_offset() + problem.dq_accum_bytes();
    StreamWorkspace workspace(f.device, stream, bytes);
    AttentionBwdParams params = problem.params;
    params.delta = reinterpret_cast<float*>(workspace.get());
    params.dq_accum =
        problem.deterministic ? nullptr : reinterpret_cast<float*>(workspace.get() + problem.dq_accum_offset());

    const auto batch = static_cast<unsigned>(f.batch);
    const Grid query_rows{blocks(f.seqlen_q, kBwdRowPassRows), static_cast<unsigned>(f.heads_q), batch};
    const Grid key_tiles{blocks(f.seqlen_k, spec.block_n), static_cast<unsigned>(f.heads_kv), batch};
    if (spec.family == Family::sm90_bwd) {  // atomic dQ only
      const AttentionSm90BwdParams hopper = sm90_backward_params(spec, problem, params);
      if (has_queries) launch(kernel, spec, kSm90Preprocess, query_rows, stream, hopper);
      if (has_keys) launch(kernel, spec, kSm90DkdvAtomicDq, key_tiles, stream, hopper);
      if (has_queries) launch(kernel, spec, kSm90ConvertDq, query_rows, stream, hopper);
      return;
    }
    if (has_queries) launch(kernel, spec, kPreprocess, query_rows, stream, params);
    if (problem.deterministic) {
      // Keys no query sees still get dK = dV = 0 from the dkdv entry.
      if (has_keys) launch(kernel, spec, kDkdv, key_tiles, stream, params);
      if (has_queries) {
        const Grid query_tiles{blocks(f.seqlen_q, 16 * spec.num_warps), static_cast<unsigned>(f.heads_q), batch};
        launch(kernel, spec, kDq, query_tiles, stream, params);
      }
    } else {
      if (has_keys) launch(kernel, spec, kDkdvAtomicDq, key_tiles, stream, params);
      if (has_queries) launch(kernel, spec, kConvertDq, query_rows, stream, params);
    }
  }
};

Runtime::Runtime(CacheConfig cache) : impl_(std::make_unique<Impl>(std::move(cache))) {}
Runtime::~Runtime() = default;

Runtime& Runtime::global() {
  static Runtime runtime;
  return runtime;
}

void Runtime::forward(const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const TensorView* lse, const AttentionOptions& options) {
  const ForwardProblem problem = make_forward_problem(q, k, v, out, lse, nullptr, options);
  impl_->run_forward(problem, [] {}, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {lse, "lse"}});
}

void Runtime::forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView* lse, const VarlenBatch& batch,
                             const AttentionOptions& options) {
  const ForwardProblem problem = make_forward_problem(q, k, v, out, lse, &batch, options);
  impl_->run_forward(problem, [&] {
    if (batch.check_cu_seqlens) check_cu_seqlens(problem, batch, q.shape[0], k.shape[0]);
  }, {{&q, "q"},
                               {&k, "k"},
                               {&v, "v"},
                               {&out, "out"},
                               {lse, "lse"},
                               {&batch.cu_seqlens_q, "cu_seqlens_q"},
                               {&batch.cu_seqlens_k, "cu_seqlens_k"}});
}

void Runtime::backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& dout, const TensorView* lse, const TensorView& dq,
                       const TensorView& dk, const TensorView& dv, const AttentionOptions& options) {
  const BackwardProblem problem = make_backward_problem(q, k, v, out, dout, lse, dq, dk, dv, nullptr, options);
  impl_->run_backward(problem, [] {}, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&dout, "dout"},
                                       {lse, "lse"}, {&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}});
}

void Runtime::backward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& out, const TensorView& dout, const TensorView* lse,
                              const TensorView& dq, const TensorView& dk, const TensorView& dv,
                              const VarlenBatch& batch, const AttentionOptions& options) {
  const BackwardProblem problem = make_backward_problem(q, k, v, out, dout, lse, dq, dk, dv, &batch, options);
  impl_->run_backward(problem, [&] {
    if (batch.check_cu_seqlens) check_cu_seqlens(problem.forward, batch, q.shape[0], k.shape[0]);
  }, {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&dout, "dout"}, {lse, "lse"}, {&dq, "dq"},
      {&dk, "dk"}, {&dv, "dv"}, {&batch.cu_seqlens_q, "cu_seqlens_q"}, {&batch.cu_seqlens_k, "cu_seqlens_k"}});
}

KernelCache& Runtime::kernel_cache() { return impl_->kernels; }

TuningSources& Runtime::tuning() { return impl_->tuning; }

void Runtime::load_tuning_db(const std::string& path) { impl_->tuning.set_user_db(TuningDb::load(path), path); }

}  // namespace flashjit
