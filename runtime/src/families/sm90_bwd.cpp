// sm90_bwd at run time: fa2_bwd's entry sequence with atomic dQ (preprocess -> dkdv_atomic_dq ->
// convert_dq), with TMA maps of q, k, v and dout; in deterministic mode (its spec has ordered_dq)
// the dQ adds go in a fixed order of key tiles (DqAccumulation::ordered). It shares fa2_bwd's
// tuning entries, so that the tuner times both and one entry holds the winner. Its kernel head dims
// are the forward's (64, 96, 128, 192, 256), others rounded up; it runs where TMA can read the four
// tensors, deterministic mode included (up to head dim 128 its dQ writer warp orders the adds, its
// TMA map clipping the columns past the head dim; above, the consumers order them); under a block
// mask the dq_visits entry first marks which key tiles visit each query block, and each tile waits
// for those before it. All of it passed the GPU tests (float64 references, bitwise reruns) and
// compute-sanitizer; beside fa2_bwd it ran 1.3-2.8x faster at head dims 96-224 and level or faster
// at 32 (bench/results/bwd_modes_h100.json), so automatic dispatch takes it wherever it runs.
#include <fmt/format.h>

#include "../family.hpp"
#include "../tma.hpp"

namespace flashjit::detail {
namespace {

std::optional<std::string> unusable_reason(const PassProblem& problem, const Arch& arch) {
  if (auto reason = hopper_arch_reason(Family::sm90_bwd, arch)) return reason;
  return problem.backward != nullptr ? tma_unusable_reason(*problem.backward) : tma_unusable_reason(problem.forward);
}

// The keys per CTA are fixed by the head dim (see sm90_bwd.cuh); the query step (64, or 80 and at
// head dim 64 128 where they are legal) and the ring's depth vary.
std::vector<KernelSpec> tuning_candidates(const KernelSpec& base) {
  std::vector<KernelSpec> candidates;
  for (int block_m : {64, 80, 128})
    for (int stages : {2, 3}) {
      KernelSpec s = base;
      s.block_m = block_m;
      s.num_stages = stages;
      if (!s.validate()) candidates.push_back(s);
    }
  return candidates;
}

// fa2_bwd's arguments and the TMA maps of q, k, v and dout; under a block mask its walk by key
// block fitted to the kernel's tiles.
AttentionSm90BwdParams hopper_params(const KernelSpec& spec, const ForwardProblem& f, const AttentionBwdParams& bwd) {
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
  if (bwd.dq_accum != nullptr && bwd.workspace_rows > 0)
    params.dq_accum_map = make_dq_accum_tma_map(bwd.dq_accum, a.head_dim, bwd.workspace_rows, a.num_heads_q, spec.block_m);
  if (f.block_sparse)
    fit_block_mask_to_tiles(params.bwd.transposed_block_mask, spec, /*rows_are_queries=*/false, spec.block_n,
                            spec.block_m, "backward");
  return params;
}

void run(const FamilyCall& call) {
  const bool ordered = call.spec.ordered_dq;  // deterministic mode (dispatch, or a forced spec that matches)
  const BackwardLaunch b(call, ordered ? DqAccumulation::ordered : DqAccumulation::atomic);
  const AttentionSm90BwdParams params = hopper_params(call.spec, call.forward(), b.params);
  if (b.has_queries) call.launch("preprocess", b.query_rows, params);
  if (ordered && call.forward().block_sparse && b.has_keys) call.launch("dq_visits", b.key_tiles, params);
  if (b.has_keys) call.launch("dkdv_atomic_dq", b.key_tiles, params);
  if (b.has_queries) call.launch("convert_dq", b.query_rows, params);
}

}  // namespace

extern const RuntimeFamily kSm90BwdFamily;
const RuntimeFamily kSm90BwdFamily{Family::sm90_bwd, Pass::backward, Backend::sm90, /*automatic=*/true, Family::fa2_bwd,
                                   unusable_reason, tuning_candidates, run};

}  // namespace flashjit::detail
