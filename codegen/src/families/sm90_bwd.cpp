// Rules of the Hopper backward family (templates/sm90_bwd.cuh): a producer warpgroup and two wgmma
// consumer warpgroups, query steps of block_m = 64 (or 80 at head dims 64 to 128: dQ transposed; or
// 128 at head dim 64: dQ split by queries) in a ring of num_stages. At head dims 64, 96 and 128 the
// consumers own 64 keys each (block_n 128); at 192 and 256 they share 64 keys (block_n 64) and split
// the head dim, exchanging P^T through shared memory. Tiles hold whole 64-column panels (head dim 96
// loads two, 192 three and a fourth of zeros). The shared-memory arithmetic mirrors Sm90BwdShape in
// the template.
#include <fmt/format.h>

#include "../family_rules.hpp"
#include "../wgmma.hpp"
#include "flashjit/codegen/render.hpp"

namespace flashjit::codegen_detail {
namespace {

constexpr int kConsumers = 2;
bool split_head_dim(const KernelSpec& s) { return s.head_dim > 128; }
// 64-column panels per tile in shared memory: split, the consumers own two each.
int panels(const KernelSpec& s) { return split_head_dim(s) ? 2 * kConsumers : (s.head_dim + 63) / 64; }
int keys_per_cta(const KernelSpec& s) { return split_head_dim(s) ? 64 : 64 * kConsumers; }

int smem_bytes_without_dq_buffer(const KernelSpec& s) {
  const int kv_tile = panels(s) * s.block_n * 128, step_tile = panels(s) * s.block_m * 128;
  const int ds = s.block_n * s.block_m * 2, rows = s.num_stages * s.block_m * 4;
  const int exchanged_tiles = split_head_dim(s) ? 4 : 2;  // dS^T double-buffered, and P^T where split
  // Each stage's query step, recorded for the consumers under a block mask or modifiers.
  const int step_info = s.block_sparse || s.modifier != nullptr ? 16 * s.num_stages : 0;
  return 1024 + 2 * kv_tile + 2 * s.num_stages * step_tile + exchanged_tiles * ds + 2 * rows + step_info +
         8 * (1 + 2 * s.num_stages);
}

// The step's dQ (block_m rows of fp32 in 32-column panels: the head dim, or where it is split
// between the consumers, both consumers' whole 64-column panels), handed from the consumers to the
// producer group's writer warp, which adds it to the accumulator by TMA reductions; the step's slot
// (16 bytes) and the buffer's two mbarriers (full, free).
int dq_buffer_bytes(const KernelSpec& s) { return s.block_m * panels(s) * 64 * 4 + 16 + 16; }

// A writer warp where the buffer fits beside the rest: head dims 64, 96 and 128 (at 96 and 128 with
// two stages). At 192 and 256 the consumers add dQ with their own atomics.
bool dq_writers(const KernelSpec& s) {
  return smem_bytes_without_dq_buffer(s) + dq_buffer_bytes(s) <= max_smem_per_block(s.arch);
}

int smem_bytes(const KernelSpec& s) {
  return smem_bytes_without_dq_buffer(s) + (dq_writers(s) ? dq_buffer_bytes(s) : 0);
}

// Steps of 80 queries (FlashAttention-3's tile at head dim 128 without a mask): dQ computed
// transposed (dQ^T = K^T dS^T) in whole 64-column panels (at head dim 64 by the consumers in turn)
// and handed to the writer warp. Not where the head dim is split, nor under a block mask, whose
// blocks are 128 queries.
bool takes_80_query_steps(const KernelSpec& s) { return !split_head_dim(s) && !s.block_sparse; }
// Steps of 128 queries (FlashAttention-3's tile at head dim 64): two 64-query panels of dS^T, each
// consumer computing dQ for one of them and handing it to the writer warp.
bool takes_128_query_steps(const KernelSpec& s) { return s.head_dim == 64 && !s.block_sparse; }

std::optional<std::string> validate_tiles(const KernelSpec& s) {
  const bool long_steps =
      (s.block_m == 80 && takes_80_query_steps(s)) || (s.block_m == 128 && takes_128_query_steps(s));
  if (s.block_m != 64 && !long_steps)
    return fmt::format("sm90_bwd walks the queries in steps of 64 (one swizzled row of dS^T), of 80 at head dims "
                       "64 to 128 or of 128 at head dim 64, without a block mask: block_m must be 64{}{}, got {}",
                       takes_80_query_steps(s) ? " or 80" : "", takes_128_query_steps(s) ? " or 128" : "", s.block_m);
  if (s.block_n != keys_per_cta(s))
    return fmt::format("sm90_bwd at head dim {} runs {}: block_n must be {}, got {}", s.head_dim,
                       split_head_dim(s) ? "two consumer warpgroups sharing 64 keys" : "two consumer warpgroups of 64 keys",
                       keys_per_cta(s), s.block_n);
  if (s.num_warps != 4 * (1 + kConsumers))
    return fmt::format("sm90_bwd runs a producer warpgroup and {} consumers: num_warps must be {}, got {}", kConsumers,
                       4 * (1 + kConsumers), s.num_warps);
  if (s.num_stages < 2 || s.num_stages > 3)
    return fmt::format("num_stages must be 2 or 3 for sm90_bwd (one query step computes while the next loads), "
                       "got {}", s.num_stages);
  if (s.block_m != 64 && !dq_writers(s))
    return fmt::format("sm90_bwd's steps of {} queries hand dQ to the writer warp, whose buffer {} stages leave no "
                       "room for",
                       s.block_m, s.num_stages);
  if (smem_bytes(s) > max_smem_per_block(s.arch))
    return fmt::format("needs {} bytes of shared memory per block, {} allows {}", smem_bytes(s), s.arch.name(),
                       max_smem_per_block(s.arch));
  // Ordered dQ adds (deterministic mode) are the writer warp's up to head dim 128, off the consumers'
  // path (its buffer fits beside two stages and three); above, where it never fits, the consumers
  // take the turns themselves.
  if (s.ordered_dq && !split_head_dim(s) && !dq_writers(s))
    return fmt::format("ordered dQ adds (deterministic mode) at head dim {} are the dQ writer warp's, which {} stages "
                       "leave no room for",
                       s.head_dim, s.num_stages);
  return std::nullopt;
}

void set_default_tiles(KernelSpec& s) {
  s.block_n = keys_per_cta(s);
  // 80 where no mask cuts the steps (FlashAttention-3's choice at head dim 128): causal spilled 32
  // bytes at 128, and at 64 and 96 ran 0.96-0.98x the steps of 64 at 2k (1.01-1.04x from 8k; H100).
  // At head dim 64, 128 (FlashAttention-3's tile there) unmasked and causal: the tuner's winner at
  // 2k-16k, 1.05-1.13x the steps of 80 or 64 (H100). Windows, softcaps and modifiers stay on 64
  // (80 and 128 untimed there; the tuner times them).
  const bool unmodified = !s.has_softcap && s.modifier == nullptr;
  if (takes_128_query_steps(s) && unmodified && s.mask != MaskKind::window) s.block_m = 128;
  else if (takes_80_query_steps(s) && unmodified && s.mask == MaskKind::none) s.block_m = 80;
  else s.block_m = 64;
  s.num_warps = 4 * (1 + kConsumers);
  s.num_stages = 2;
}

int threads(const KernelSpec& s) { return 32 * s.num_warps; }

// The dkdv entry's shared memory and setmaxnreg split (FlashAttention-3's for two consumer
// warpgroups; under a block mask too: the producer's list walk fits its 24 registers, and 40/232
// spilled the consumers of a document mask at head dim 128). The row passes use none: launched with
// the main kernel's (up to 224 KB) they ran one CTA per SM, at half the memory bandwidth.
std::vector<KernelConstant> constants(const KernelSpec& s) {
  return {{"kDqWriters", dq_writers(s) ? 1 : 0},
          {"kSmemBytes", smem_bytes(s)},
          {"kProducerRegisters", 24},
          {"kConsumerRegisters", 240}};
}

// Per consumer: S^T and dP^T (64 keys x the consumer's queries, both operands K-major in shared
// memory); dK and dV (64 keys x the consumer's columns, P^T and dS^T from registers, or where the
// head dim is split from the exchanged tiles); dQ (64 queries x whole 64-column panels, dS^T and K
// both MN-major in shared memory), or for steps of 80 dQ^T (a 64-column panel x block_m queries, K
// MN-major and dS K-major).
std::string config_members(const KernelSpec& s) {
  const bool split = split_head_dim(s);
  const int score_queries = split ? s.block_m / kConsumers : s.block_m;
  const int grad_cols = split ? panels(s) * 64 / kConsumers : s.head_dim;
  const int dq_cols = panels(s) < kConsumers ? 64 : panels(s) * 64 / kConsumers;
  const bool dq_transposed = s.block_m == 80;
  return wgmma_member_function("wgmma_scores", score_queries, s.dtype, WgmmaOperands::ss_k_major) +
         wgmma_member_function("wgmma_key_gradient", grad_cols, s.dtype,
                               split ? WgmmaOperands::ss_b_mn_major : WgmmaOperands::rs_b_mn_major) +
         (dq_transposed ? wgmma_member_function("wgmma_dq", s.block_m, s.dtype, WgmmaOperands::ss_a_mn_major)
                        : wgmma_member_function("wgmma_dq", dq_cols, s.dtype, WgmmaOperands::ss_mn_major));
}

}  // namespace

extern const FamilyRules kSm90BwdRules;
const FamilyRules kSm90BwdRules{
    Family::sm90_bwd,
    "sm90_bwd",
    "sm90_bwd.cuh",
    /*computes_gradients=*/true,
    {{"preprocess", "flashjit::AttentionSm90BwdParams", "flashjit::kernels::sm90_bwd_preprocess_kernel", true},
     {"dq_visits", "flashjit::AttentionSm90BwdParams", "flashjit::kernels::sm90_bwd_dq_visits_kernel", true},
     {"dkdv_atomic_dq", "flashjit::AttentionSm90BwdParams", "flashjit::kernels::sm90_bwd_dkdv_atomic_dq_kernel", true,
      "kSmemBytes"},
     {"convert_dq", "flashjit::AttentionSm90BwdParams", "flashjit::kernels::sm90_bwd_convert_dq_kernel", true}},
    /*min_sm=*/90,
    /*needs_arch_specific=*/true,
    /*head_dims=*/{64, 96, 128, 192, 256},
    validate_tiles,
    set_default_tiles,
    threads,
    constants,
    config_members,
    /*min_blocks_per_sm=*/nullptr,
    /*takes_modifiers=*/true,
    /*takes_block_mask=*/true,
    /*takes_continuation=*/true,
    /*takes_seqused=*/true,
    /*takes_tail_splits=*/false,
    /*takes_fp8=*/false,
    /*takes_ordered_dq=*/true,
};

}  // namespace flashjit::codegen_detail
