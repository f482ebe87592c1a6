// Rules of the Hopper forward family (templates/sm90_fwd.cuh): query tiles of block_m rows over a
// TMA producer warpgroup and block_m / 64 wgmma consumer warpgroups, K/V tiles of block_n keys in
// a ring of num_stages stages, one or two Q slots. The shared-memory arithmetic mirrors
// Sm90FwdShape in the template.
#include <fmt/format.h>

#include "../family_rules.hpp"
#include "../wgmma.hpp"
#include "flashjit/codegen/render.hpp"

namespace flashjit::codegen_detail {
namespace {

int consumers(const KernelSpec& s) { return s.block_m / 64; }
bool fp8(const KernelSpec& s) { return s.dtype == DType::e4m3; }
int panels(const KernelSpec& s) { return (s.head_dim * element_bytes(s.dtype) + 127) / 128; }  // 128-byte-wide

int smem_bytes_with(const KernelSpec& s, int q_stages) {
  const int q_bytes = panels(s) * s.block_m * 128, kv_tile_bytes = panels(s) * s.block_n * 128;
  const int key_tile_info_bytes = s.block_sparse ? 8 * s.num_stages : 0;  // each K stage's tile under a block mask
  // FP8: a ring of transposed V tiles (128-key panels of head_dim rows), its barriers, and the
  // transposers' end slot. With V transposed beforehand TMA fills the Vt ring and there is no V ring.
  const int vt_tile_bytes = (s.block_n + 127) / 128 * s.head_dim * 128;
  const int vt_ring_bytes = fp8(s) ? s.num_stages * (vt_tile_bytes + 16) + 8 : 0;
  const int kv_rings = s.v_pretransposed ? 1 : 2;
  return 1024 + q_stages * q_bytes + kv_rings * s.num_stages * kv_tile_bytes +
         8 * (2 * q_stages + 4 * s.num_stages) + 32 * q_stages + key_tile_info_bytes + vt_ring_bytes;
}
// Two Q slots (the next work tile's Q loads during this one) where shared memory has room.
int q_stages(const KernelSpec& s) { return smem_bytes_with(s, 2) <= max_smem_per_block(s.arch) ? 2 : 1; }
int smem_bytes(const KernelSpec& s) { return smem_bytes_with(s, q_stages(s)); }

// A consumer thread holds O (head_dim / 2 fp32), the next tile's scores (block_n / 2) and the
// current tile's probabilities as 16-bit pairs (block_n / 4) at once, plus registers of addresses,
// indices and softmax state, within its setmaxnreg budget. The overheads are fitted to ptxas's
// reports over every candidate (fp16 and bf16, every mask): 32 registers with no mask or a causal
// one (spill-free up to d64 m192 n128, d64 m128 n224, d96 n192, d128 n192, d256 n80); with a
// softcap or a window the scores need about 1/16 register more per key and 56 on top (d128 n160,
// d192 n112, d64 m128 n192 and d64 m192 n112 spill there).
// setmaxnreg split of the 64K registers (FlashAttention-3's): the producer warpgroup keeps a few.
// The split must stay within what the launch allocates (168 x 384 = 64512 with two consumers):
// setmaxnreg.inc waits until the registers are free, so a split over it hangs the consumers. A
// block mask's walk (list offsets, counts, the step's id) needs more of the producer: 40 with two
// consumers (24 spilled 40 bytes), so the consumers get 232. (Head dim 256 spilled 8-12 bytes
// until only lane 0 of a consumer warp read each stage's recorded key tile.)
int consumer_registers_needed(const KernelSpec& s);
// FP8's producer warpgroup also transposes V (three warps), which spilled in 24 registers at head
// dim 128: where the consumers' need leaves room, the split gives it 40 (two consumers) or 56 (three).
// (With V transposed beforehand there are no transposers; the split stays as it is, untimed.)
bool fp8_producer_gets_more(const KernelSpec& s) {
  return fp8(s) && consumer_registers_needed(s) <= (consumers(s) == 2 ? 232 : 152);
}
int consumer_register_budget(const KernelSpec& s) {
  if (consumers(s) == 3) return fp8_producer_gets_more(s) ? 152 : 160;
  return s.block_sparse || fp8_producer_gets_more(s) ? 232 : 240;
}
int producer_registers(const KernelSpec& s) {
  if (consumers(s) == 3) return fp8_producer_gets_more(s) ? 56 : 32;
  return s.block_sparse || fp8_producer_gets_more(s) ? 40 : 24;
}
int consumer_registers_needed(const KernelSpec& s) {
  // (A block mask without a softcap or window costs the scores less: d256 n64 fits in 232.)
  if (s.block_sparse && !s.has_softcap && s.mask != MaskKind::window) return s.head_dim / 2 + 3 * s.block_n / 4 + 48;
  const bool heavy_scores = s.has_softcap || s.mask == MaskKind::window || s.modifier != nullptr;
  // FP8's P takes half the registers: block_n / 8 of four e4m3 values.
  const int probability_registers = s.block_n / (fp8(s) ? 8 : 4);
  return s.head_dim / 2 + s.block_n / 2 + probability_registers + (heavy_scores ? s.block_n / 16 + 56 : 32);
}

std::optional<std::string> validate_tiles(const KernelSpec& s) {
  if (s.block_m != 128 && s.block_m != 192)
    return fmt::format("sm90_fwd runs one consumer warpgroup per 64 query rows, two or three: block_m must be 128 or "
                       "192, got {}", s.block_m);
  if (s.num_warps != 4 * (1 + consumers(s)))
    return fmt::format("sm90_fwd runs a producer warpgroup and {} consumers for block_m {}: num_warps must be {}, "
                       "got {}", consumers(s), s.block_m, 4 * (1 + consumers(s)), s.num_warps);
  if (s.block_n < 64 || s.block_n > 256 || s.block_n % 16 != 0)
    return fmt::format("block_n must be a multiple of 16 from 64 to 256 for sm90_fwd, got {}", s.block_n);
  if (fp8(s) && s.block_n % 32 != 0)
    return fmt::format("FP8 sm90_fwd steps both GEMMs by 32 keys: block_n must be a multiple of 32, got {}", s.block_n);
  if (consumer_registers_needed(s) > consumer_register_budget(s))
    return fmt::format("head_dim {} with block_n {} needs about {} registers per consumer thread, over the {} that "
                       "{} consumer warpgroups get", s.head_dim, s.block_n, consumer_registers_needed(s),
                       consumer_register_budget(s), consumers(s));
  if (s.num_stages < 2 || s.num_stages > 4)
    return fmt::format("num_stages must be 2 to 4 for sm90_fwd (one tile computes while the next loads), got {}",
                       s.num_stages);
  if (smem_bytes(s) > max_smem_per_block(s.arch))
    return fmt::format("needs {} bytes of shared memory per block, {} allows {}", smem_bytes(s), s.arch.name(),
                       max_smem_per_block(s.arch));
  return std::nullopt;
}

void set_default_tiles(KernelSpec& s) {
  // FlashAttention-3's shapes cut to what stays spill-free with P kept in registers.
  auto set = [&](int block_m, int block_n, int stages) {
    s.block_m = block_m;
    s.block_n = block_n;
    s.num_warps = 4 * (1 + block_m / 64);
    s.num_stages = stages;
  };
  // A softcap's tanh and a window's two-sided mask need registers: with either, head dim 64 takes
  // two consumer warpgroups (240 registers each) instead of three (160), and 192 a narrower key tile.
  // User modifiers and block masks count as both. A block mask's tiles are 128 x 128 where the
  // head dim allows (FlexAttention's default block), so one tile is one block.
  const bool heavy_scores = s.has_softcap || s.mask == MaskKind::window || s.modifier != nullptr || s.block_sparse;
  if (fp8(s)) {
    // Three consumer warpgroups where the registers allow: 96-key tiles at head dim 128 ran
    // 1.08-1.22x the 128 x 128 tiles unmasked and 1.02-1.10x causal (2k-16k, H200). At 256 the best
    // tile (96 or 64 keys) was 0-5% faster, mixed between runs: 128 x 128 stays. (Three stages
    // measured the same as two: the consumers set the pace.)
    // At 256 V comes transposed beforehand (v_pretransposed): 1.09-1.45x the same tile with V
    // transposed in shared memory, full and causal, 2k-16k, both layouts (H100, stop 58), where
    // shared memory was the second limit; at 64 and 128 the two modes were within -11% to +6%.
    if (s.head_dim <= 64 && !heavy_scores) {
      set(192, 128, 2);
    } else if (s.head_dim > 96 && s.head_dim <= 128 && !heavy_scores) {
      set(192, 96, 2);
    } else {
      set(128, 128, 2);
      if (validate_tiles(s)) set(128, 64, 2);  // (head dim 256 with a softcap or a window: registers)
      s.v_pretransposed = s.head_dim > 192 && !heavy_scores;
    }
    return;
  }
  if (s.head_dim <= 64) heavy_scores ? set(128, 128, 2) : set(192, 96, 2);
  else if (s.head_dim <= 128) set(128, 128, 2);
  else if (s.head_dim <= 192) set(128, s.block_sparse ? 64 : heavy_scores ? 96 : 112, 2);  // (64 divides a block)
  else set(128, 64, 2);
}

int threads(const KernelSpec& s) { return 32 * s.num_warps; }

// The tail splits' workspace (AttentionSm90FwdParams): a counter per 16 rows of a split tile, and
// per split item a float4 of row statistics and head_dim / 4 float4s of O per consumer thread.
std::vector<KernelConstant> constants(const KernelSpec& s) {
  return {{"kQStages", q_stages(s)},
          {"kTailSplits", s.tail_splits ? 1 : 0},
          {"kVPretransposed", s.v_pretransposed ? 1 : 0},
          {"kSmemBytes", smem_bytes(s)},
          {"kProducerRegisters", producer_registers(s)},
          {"kConsumerRegisters", consumer_register_budget(s)},
          {"kSplitCountersPerTile", s.block_m / 16},
          {"kSplitStatsFloatsPerItem", s.block_m * 8},
          {"kSplitOutputFloatsPerItem", s.block_m * s.head_dim}};
}

// S = Q K^T over block_n keys (both operands in shared memory) and O += P V over head_dim columns
// (P from registers; V MN-major, or FP8's transposed V K-major), and O's type (bf16 for FP8).
std::string config_members(const KernelSpec& s) {
  return std::string(fp8(s) ? "  using OutputElement = flashjit::kernels::bfloat16_t;\n" : "  using OutputElement = Element;\n") +
         wgmma_member_function("wgmma_qk", s.block_n, s.dtype, WgmmaOperands::ss_k_major) +
         wgmma_member_function("wgmma_pv", s.head_dim, s.dtype,
                               fp8(s) ? WgmmaOperands::rs_k_major : WgmmaOperands::rs_b_mn_major);
}

}  // namespace

extern const FamilyRules kSm90FwdRules;
const FamilyRules kSm90FwdRules{
    Family::sm90_fwd,
    "sm90_fwd",
    "sm90_fwd.cuh",
    /*computes_gradients=*/false,
    {{"forward", "flashjit::AttentionSm90FwdParams", "flashjit::kernels::sm90_fwd_kernel", true, "kSmemBytes"},
     {"transpose_v", "flashjit::AttentionSm90FwdParams", "flashjit::kernels::sm90_fwd_transpose_v_kernel", true}},
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
    /*takes_tail_splits=*/true,
    /*takes_fp8=*/true,
};

}  // namespace flashjit::codegen_detail
