#include "family.hpp"

#include <fmt/format.h>

namespace flashjit::detail {

extern const RuntimeFamily kSm90FwdFamily;
extern const RuntimeFamily kFa2FwdFamily;
extern const RuntimeFamily kReferenceFwdFamily;
extern const RuntimeFamily kSm90BwdFamily;
extern const RuntimeFamily kFa2BwdFamily;
extern const RuntimeFamily kKvCacheFwdFamily;
extern const RuntimeFamily kBlockMaskFamily;

// The family table: a new family is a line here (where its pass prefers it) and its module.
const std::vector<const RuntimeFamily*>& runtime_families() {
  static const std::vector<const RuntimeFamily*> table{&kSm90FwdFamily, &kFa2FwdFamily, &kReferenceFwdFamily,
                                                       &kSm90BwdFamily, &kFa2BwdFamily, &kKvCacheFwdFamily,
                                                       &kBlockMaskFamily};
  return table;
}

const RuntimeFamily& runtime_family(Family family) {
  for (const RuntimeFamily* f : runtime_families())
    if (f->family == family) return *f;
  throw Error(ErrorCode::internal, "runtime", fmt::format("family {} has no runtime module", to_string(family)));
}

void FamilyCall::launch_entry(std::string_view entry, Grid grid, void* params, StreamOrder order) const {
  const size_t index = kernel.layout.entry_index(entry);
  CUlaunchConfig config{};
  config.gridDimX = grid.x;
  config.gridDimY = grid.y;
  config.gridDimZ = grid.z;
  config.blockDimX = static_cast<unsigned>(kernel.layout.threads);
  config.blockDimY = config.blockDimZ = 1;
  config.sharedMemBytes = static_cast<unsigned>(kernel.layout.entries[index].dynamic_smem_bytes);
  config.hStream = stream;
  CUlaunchAttribute attributes[2]{};
  config.attrs = attributes;
  // Only kernels built for sm_90 execute griddepcontrol.wait; an sm_80 build on a Hopper device
  // must not start early.
  if (order == StreamOrder::overlapping_tail && device.cc_major >= 9 && spec.arch.sm >= 90) {
    CUlaunchAttribute& overlap = attributes[config.numAttrs++];
    overlap.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    overlap.value.programmaticStreamSerializationAllowed = 1;
  }
  if (grid.cluster_x > 1) {
    config.sharedMemBytes = static_cast<unsigned>(cluster_launch_smem_bytes(kernel.layout.entries[index], device));
    CUlaunchAttribute& cluster = attributes[config.numAttrs++];
    cluster.id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    cluster.value.clusterDim.x = grid.cluster_x;
    cluster.value.clusterDim.y = cluster.value.clusterDim.z = 1;
  }
  void* arguments[] = {params};
  FLASHJIT_CU(cuLaunchKernelEx, &config, reinterpret_cast<CUfunction>(kernel.entries[index]), arguments, nullptr);
}

std::optional<std::string> hopper_arch_reason(Family family, const Arch& arch) {
  if (arch.arch_specific && arch.sm == 90) return std::nullopt;
  return fmt::format("{} needs an sm_90 device, this one is {}", to_string(family), arch.name());
}

Grid query_block_grid(const ForwardProblem& problem, int block_m) {
  return {blocks(problem.seqlen_q, block_m), static_cast<unsigned>(problem.heads_q),
          static_cast<unsigned>(problem.batch)};
}

void fit_block_mask_to_tiles(BlockSparseParams& mask, const KernelSpec& spec, bool rows_are_queries, int row_tile,
                             int column_tile, const char* pass) {
  const int q_block = rows_are_queries ? mask.row_block_size : mask.column_block_size;
  const int kv_block = rows_are_queries ? mask.column_block_size : mask.row_block_size;
  const int q_tile = rows_are_queries ? row_tile : column_tile, kv_tile = rows_are_queries ? column_tile : row_tile;
  if (q_block % q_tile != 0 || kv_block % kv_tile != 0)
    throw Error(ErrorCode::invalid_argument, pass,
                fmt::format("block_mask: blocks of ({}, {}) do not hold whole tiles of kernel {} ({} queries x {} keys): "
                            "the query block size must be a multiple of {} and the key block size of {}",
                            q_block, kv_block, spec.name(), q_tile, kv_tile, q_tile, kv_tile));
  mask.tiles_per_block = mask.column_block_size / column_tile;
}

std::vector<KernelSpec> tile_grid_candidates(const KernelSpec& base, std::initializer_list<int> block_ms,
                                             std::initializer_list<int> block_ns, std::initializer_list<int> warps,
                                             std::initializer_list<int> stages) {
  std::vector<KernelSpec> candidates;
  for (int block_m : block_ms)
    for (int block_n : block_ns)
      for (int num_warps : warps)
        for (int num_stages : stages) {
          KernelSpec s = base;
          s.block_m = block_m;
          s.block_n = block_n;
          s.num_warps = num_warps;
          s.num_stages = num_stages;
          if (!s.validate()) candidates.push_back(s);
        }
  return candidates;
}

std::vector<KernelSpec> mma_sync_tile_candidates(const KernelSpec& base) {
  return tile_grid_candidates(base, {32, 64, 128, 256}, {32, 64, 128}, {4, 8}, {1, 2, 3});
}

namespace {

// The order counters of one query head (AttentionBwdParams::dq_order): a block's index is its
// workspace row / block_m plus its sequence's number, which every sequence's first row advances.
int dq_order_counters_per_head(const BackwardProblem& problem, int block_m) {
  return problem.params.workspace_rows / block_m + problem.forward.batch + 1;
}

// Where the order counters start: after the accumulator, 256-byte aligned.
size_t dq_order_offset(const BackwardProblem& problem) {
  return (problem.dq_accum_offset() + problem.dq_accum_bytes() + 255) / 256 * 256;
}

// Under a block mask, beside each counter a bit per key tile (AttentionBwdParams::dq_visits).
int dq_visit_words(const BackwardProblem& problem, const KernelSpec& spec) {
  if (!problem.forward.block_sparse) return 0;
  return static_cast<int>((blocks(problem.forward.seqlen_k, spec.block_n) + 31) / 32);
}

size_t dq_order_counters(const BackwardProblem& problem, const KernelSpec& spec) {
  return size_t(problem.forward.heads_q) * dq_order_counters_per_head(problem, spec.block_m);
}

size_t backward_workspace_bytes(const BackwardProblem& problem, DqAccumulation dq, const KernelSpec& spec) {
  switch (dq) {
    case DqAccumulation::separate: return problem.delta_bytes();
    case DqAccumulation::atomic: return problem.dq_accum_offset() + problem.dq_accum_bytes();
    case DqAccumulation::ordered:
      return dq_order_offset(problem) +
             sizeof(int) * dq_order_counters(problem, spec) * (1 + dq_visit_words(problem, spec));
  }
  return 0;
}

}  // namespace

BackwardLaunch::BackwardLaunch(const FamilyCall& call, DqAccumulation dq)
    : workspace(call.forward().device, call.stream, backward_workspace_bytes(call.backward(), dq, call.spec)),
      params(call.backward().params) {
  const BackwardProblem& problem = call.backward();
  const ForwardProblem& f = problem.forward;
  params.delta = reinterpret_cast<float*>(workspace.get());
  params.dq_accum =
      dq == DqAccumulation::separate ? nullptr : reinterpret_cast<float*>(workspace.get() + problem.dq_accum_offset());
  params.dq_order = nullptr;
  params.dq_visits = nullptr;
  params.dq_visit_words = 0;
  if (dq == DqAccumulation::ordered) {
    // The counters, then under a block mask their rows of visit bits, zeroed together.
    const CUdeviceptr counters = workspace.get() + dq_order_offset(problem);
    const size_t count = dq_order_counters(problem, call.spec);
    params.dq_order = reinterpret_cast<int*>(counters);
    params.dq_order_head_stride = dq_order_counters_per_head(problem, call.spec.block_m);
    params.dq_visit_words = dq_visit_words(problem, call.spec);
    if (params.dq_visit_words > 0) params.dq_visits = reinterpret_cast<unsigned*>(counters + sizeof(int) * count);
    FLASHJIT_CU(cuMemsetD32Async, counters, 0u, count * (1 + params.dq_visit_words), call.stream);
  }
  const auto batch = static_cast<unsigned>(f.batch);
  query_rows = {blocks(f.seqlen_q, kBwdRowPassRows), static_cast<unsigned>(f.heads_q), batch};
  key_tiles = {blocks(f.seqlen_k, call.spec.block_n), static_cast<unsigned>(f.heads_kv), batch};
  has_queries = f.batch > 0 && f.seqlen_q > 0 && f.heads_q > 0;
  has_keys = f.batch > 0 && f.seqlen_k > 0 && f.heads_kv > 0;
}

}  // namespace flashjit::detail
