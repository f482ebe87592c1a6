// runtime/api: validate the caller's tensors and options into a ForwardProblem (shapes, flags and
// the kernel arguments). Nothing here touches the GPU except the pointer checks, and everything is
// checked before anything is launched.
#pragma once

#include <vector>

#include "common/params.cuh"
#include "flashjit/flashjit.hpp"

namespace flashjit::detail {

struct ForwardProblem {
  DType dtype = DType::bf16;
  int device = 0;
  int batch = 0;
  int seqlen_q = 0;  // max over the batch when varlen
  int seqlen_k = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;
  bool is_varlen = false;
  int total_q = 0, total_k = 0;  // varlen: the packed rows of q and k
  MaskKind mask = MaskKind::none;
  bool has_softcap = false;
  std::shared_ptr<const AttentionModifier> modifier;  // options.mod's code
  bool block_sparse = false;                          // options.block_mask given (params.block_mask)
  bool continues = false;                             // options.continuation given (params.state_*)
  bool seqused = false;                               // varlen with seqused_q or seqused_k
  Backend backend = Backend::automatic;
  int sm_margin = 0;
  int num_splits = 0;  // tail splits of the persistent forward (AttentionOptions::num_splits)
  // AttentionOptions::prepare_backward, and which backward it prepares (options.deterministic).
  bool prepare_backward = false;
  bool deterministic_backward = false;
  // FP8 (dtype e4m3): AttentionOptions' q/k/v_descale (data null: 1).
  Fp8Descale q_descale{}, k_descale{}, v_descale{};
  std::optional<KernelSpec> forced_kernel;
  void* stream = nullptr;
  AttentionFwdParams params{};

  bool is_empty() const { return batch == 0 || seqlen_q == 0 || heads_q == 0; }
};

// Throw Error(invalid_argument) naming the argument and what was expected.
ForwardProblem make_forward_problem(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const TensorView& out, const TensorView* lse,
                                    const VarlenBatch* varlen, const AttentionOptions& options);

struct BackwardProblem {
  ForwardProblem forward;  // q, k, v, out, lse, options: validated exactly as the forward's
  bool deterministic = false;
  AttentionBwdParams params{};  // workspaces (delta, dq_accum) left null for the launcher

  // No queries still means dK = dV = 0 to write, and no keys dQ = 0: empty only with neither.
  bool is_empty() const {
    const bool has_queries = forward.batch > 0 && forward.seqlen_q > 0 && forward.heads_q > 0;
    const bool has_keys = forward.batch > 0 && forward.seqlen_k > 0 && forward.heads_kv > 0;
    return !has_queries && !has_keys;
  }
  size_t delta_bytes() const { return size_t(forward.heads_q) * params.workspace_rows * sizeof(float); }
  size_t dq_accum_bytes() const { return delta_bytes() * forward.head_dim; }
  // Where the dQ accumulator starts in the workspace: after delta, aligned for its float4 accesses.
  size_t dq_accum_offset() const { return (delta_bytes() + 255) / 256 * 256; }
};

// As make_forward_problem, plus dout (like out), the gradients (dq like q, dk like k, dv like v)
// and a required lse; errors name the backward.
BackwardProblem make_backward_problem(const TensorView& q, const TensorView& k, const TensorView& v,
                                      const TensorView& out, const TensorView& dout, const TensorView* lse,
                                      const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                      const VarlenBatch* varlen, const AttentionOptions& options);

// The part of a forward or backward problem over sequences [batch_begin, batch_begin + batch_count)
// and KV heads [kv_head_begin, kv_head_begin + kv_head_count) with their query heads: the same
// tensors, their pointers offset. Grids hold at most 65535 CTAs along y and z, where the families
// put heads and batch, so the runtime runs a larger problem as such slices, one after another.
struct ProblemSlice {
  int batch_begin, batch_count, kv_head_begin, kv_head_count;
};
constexpr int kMaxGridBatch = 65535;  // CTAs along a grid's y or z

// Whether the problem's batch and heads fit one launch (the families' grids).
inline bool fits_one_grid(const ForwardProblem& p) { return p.batch <= kMaxGridBatch && p.heads_q <= kMaxGridBatch; }
// Slices that each fit one launch and together cover the problem; throws Error(invalid_argument)
// for problems whose side tensors are indexed by sequence and head (a modifier, a block mask, a
// continuation) or whose GQA groups alone exceed the limit.
std::vector<ProblemSlice> grid_slices(const ForwardProblem& p);
ForwardProblem slice_problem(const ForwardProblem& p, const ProblemSlice& s);
BackwardProblem slice_problem(const BackwardProblem& p, const ProblemSlice& s);

// forward_kvcache's problem: `forward` describes q, out, lse and the options, with k/v the caches
// and seqlen_k the capacity of one sequence; `params` holds the cache's addressing and the
// appended tokens (splits and partials are left for the launcher).
struct KvCacheProblem {
  ForwardProblem forward;
  AttentionKvCacheParams params{};
  bool is_paged = false;
  int seqlen_new = 0;

  // Nothing to attend and nothing to append.
  bool is_empty() const { return forward.batch == 0 || forward.heads_kv == 0 || (forward.is_empty() && seqlen_new == 0); }
};

// Building a block mask: `forward` holds the device, stream, extents (batch, heads_q as the mask's
// heads, seqlen_q, seqlen_k) and the modifier; `params` the outputs (and the tile map when given).
struct BlockMaskProblem {
  ForwardProblem forward;
  BlockMaskParams params{};
  bool has_tile_map = false;  // from a tile map: no classify pass
  int q_block_size = 128, kv_block_size = 128;
  bool is_empty() const { return params.q_blocks == 0 || params.kv_blocks == 0 || forward.batch == 0 || forward.heads_q == 0; }
};

// Throws Error(invalid_argument) naming the argument and what was expected. `mod` null: from
// `tile_map` (not null).
BlockMaskProblem make_block_mask_problem(const AttentionMod* mod, const TensorView* tile_map, int64_t batch,
                                         int64_t heads, int64_t seqlen_q, int64_t seqlen_k,
                                         const BlockMaskBuffers& out, void* stream);

// Throws Error(invalid_argument) naming the argument and what was expected; reads nothing on the
// device (cache_seqlens and block_table are checked by the kernels).
KvCacheProblem make_kvcache_problem(const TensorView& q, const KvCache& cache, const TensorView& out,
                                    const TensorView* lse, const AttentionOptions& options);

// Reads cu_seqlens_q/k back on the problem's stream and throws Error(invalid_argument) unless they
// start at 0, never decrease, stay within the packed tensors and respect max_seqlen_q/k.
void check_cu_seqlens(const ForwardProblem& problem, const VarlenBatch& batch, int64_t total_q,
                      int64_t total_k);

// Checks that `view.data` is device memory on `view.device` (a host pointer would fault the kernel
// and poison the context). Needs the driver.
void check_device_pointer(const TensorView& view, const char* name);

}  // namespace flashjit::detail
