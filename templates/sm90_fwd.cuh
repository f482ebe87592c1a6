// Hopper forward (sm_90a): FlashAttention-3's structure on TMA, mbarriers and wgmma.
//   Warp specialisation: warpgroup 0 is the producer (one thread issues TMA loads: the Q tile, then
//   K and V tiles into a ring of kStages stages, K and V on separate full/empty barrier pairs, K one
//   tile ahead of V; the group gives its registers away with setmaxnreg); the kConsumers
//   warpgroups after it own 64 query rows each.
//   A consumer step (intra-warpgroup overlap): issue S' = Q K'^T for the next key tile and
//   O += P V for the current one (P from registers, V MN-major in shared memory), both async; wait
//   for S' only (then free K's slot) and run its softmax while the PV GEMM still runs (so the
//   source says; ptxas hoists the wait for PV above the softmax, see README); then wait
//   for PV, free V's slot and rescale O (with one Q slot, the rescale waits for the next step and
//   runs between its two GEMM issues). Ping-pong: a named-barrier token passes between the consumer
//   warpgroups so that they issue their GEMMs in turn, and one's softmax overlaps the other's GEMMs.
//   Persistent: gridDim.x CTAs (the SMs, less any the caller keeps free) take work tiles (query
//   block, head, batch) from a global counter, in sections of (batch, head) pairs whose K/V fit in
//   L2 together, longest query blocks first within a section: a CTA that finishes early takes the
//   next tile, which balances causal work. The producer fetches each tile and publishes it (index
//   and coordinates) to the consumers in shared memory with the Q tile (on that Q slot's q_full);
//   -1 ends the loop. A consumer with no rows in a tile (a last query block) skips its GEMMs there
//   but keeps its turns and barrier arrivals; so does one under a causal or window mask for the
//   tile's key blocks right of its own 64 rows' band (the CTA's taller tile visits them). Two Q
//   slots where shared memory allows, so the next tile's Q loads while this one runs. The next
//   tile is claimed just before this one's last K and V loads (+4-5% at head dim 128, 2k; claiming
//   it before loading any of this one's was tried: causal rows fell 3-8% against cuDNN between two
//   runs, likely as a CTA held a claimed tile while others ran dry).
//   With two Q slots the pipeline does not drain between work tiles: a tile's first QK^T issues
//   beside the previous tile's last P V, its softmax overlaps that GEMM, and the previous tile's
//   epilogue follows the step (a tile's first P V overwrites O instead of accumulating). Only an
//   empty tile (no visible key) or the end drains it; with one Q slot (the default tiles at head
//   dims 192 and 256), every tile does, as the next Q can only load after this tile's last QK^T.
//   ptxas serializes wgmma (warning C7520) when a wgmma sits on a path it cannot prove warp-uniform,
//   which would undo the overlap: uniform values go through warp_uniform(), and the barrier waits
//   come before the first wgmma of a step, never between two.
//   Shared memory: kQStages Q tiles (kPanels panels of kBlockM rows x 128 bytes), kStages K and V
//   tiles (panels of kBlockN rows), then the barriers; the base is aligned to 1024 bytes (the
//   swizzle atom). TMA boxes are 64 values wide, so columns past the tensor's head dim read zeros.
//   Epilogue: with two Q slots, a finished tile's O goes by stmatrix into that tile's Q slot (Q's
//   layout) and out by TMA stores while the next tile runs; the slot returns to the producer a step
//   later, once TMA has read it (measured +3.5% at head dim 128, 2k and 8k, over 4-byte stores from
//   the registers). With one Q slot and no ping-pong (head dims 192 and 256), the last consumer
//   stages its O in the V tile all consumers' last P V has read (+3% at 2k) and the others store
//   from the registers; varlen always stores from the registers.
//   Tail splits: where the work tiles do not fill whole rounds of the CTAs, the last round's tiles
//   can run as split items over contiguous shares of their key blocks (split-KV for the schedule's
//   tail; the host decides, see choose_tail_split). An item ends with the drain, writes its
//   unnormalised O and row statistics to global memory and counts itself in per warp; the warp that
//   completes its rows' count merges all the items in item order and stores O and the LSE. Only
//   specs with tail_splits (Config::kTailSplits) have that code, inlined once: every work item's O,
//   a tile without keys included, leaves through the one store after the drain.
//   Continuing specs (Config::kContinues; ring attention's steps): each row's O and LSE merge by the
//   logsumexp rule into a running fp32 state (AttentionFwdParams::state_o and lse) from the
//   registers, which are written back, or where the row ends, as the output; O is never staged for
//   TMA there.
//   Varlen: the maps cover the packed rows as one batch entry; rows past a sequence's end belong
//   to the next sequence, so its edge tiles are always masked and its rows past the end never
//   written.
//   FP8 (Element e4m3, OutputElement bf16): Q K^T and P V are 8-bit wgmma k32 steps, whose shared
//   operands must be K-major: the producer warpgroup's three spare warps transpose each V tile into a
//   Vt ring (transpose_v_tiles; V's stage is then freed by them, Vt's by the consumers), with keys
//   permuted within each 16 to match P's registers; P is rounded to e4m3 after an offset of 2^6
//   (softmax_scores); q_descale k_descale scale the scores and v_descale O (per batch and KV head).
//   O leaves from the registers (the Q slots' layout is for 8-bit values). Specs with
//   v_pretransposed (kVPretransposed) take V^T from global memory instead, written before the
//   forward by the module's transpose_v entry (sm90_fwd_transpose_v_kernel) with the same key order:
//   the producer loads it by TMA into the Vt ring, and there is no V ring and no transposer.
//   From templates/common/: the Q, K and V rings (pipeline.cuh), the persistent schedule and its
//   published tiles (tile_scheduler.cuh), the band (mask.cuh), the online softmax (softmax.cuh).
#pragma once

#include "common/modifiers.cuh"
#include "common/pipeline.cuh"
#include "common/sm90.cuh"
#include "common/tile_scheduler.cuh"
#include "common/softmax.cuh"
#include "common/tile_sm80.cuh"

namespace flashjit::kernels {

template <class Config>
struct Sm90FwdShape {
  using Element = typename Config::Element;
  using OutputElement = typename Config::OutputElement;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStages = Config::kNumStages;
  static constexpr int kConsumers = kBlockM / 64;  // consumer warpgroups of 64 rows
  static constexpr int kThreads = Config::kNumWarps * 32;
  // FP8 (e4m3) inputs: Q, K and V one byte a value, O in bf16 (OutputElement). wgmma's 8-bit k
  // step is 32 values, 32 bytes as the 16-bit one's 16 values, and it reads both operands K-major:
  // V, MN-major for P V, is transposed in shared memory by the producer warpgroup's other warps
  // (kTransposeWarps; see transpose_v_tile), into the Vt ring beside the V one.
  static constexpr bool kFp8 = sizeof(Element) == 1;
  static constexpr int kGemmK = kFp8 ? 32 : 16;    // values per wgmma k step
  static constexpr int kPanelValues = 128 / sizeof(Element);
  static constexpr int kPanels = (kHeadDim + kPanelValues - 1) / kPanelValues;  // 128-byte-wide column panels
  static constexpr int kQPanelBytes = kBlockM * 128;
  static constexpr int kQBytes = kPanels * kQPanelBytes;
  static constexpr int kKVPanelBytes = kBlockN * 128;
  static constexpr int kKVTileBytes = kPanels * kKVPanelBytes;
  // V transposed (FP8): kHeadDim rows of kBlockN keys, in 128-key panels (a last panel of fewer
  // keys fills only the first bytes of each row).
  static constexpr int kVtPanels = kFp8 ? (kBlockN + 127) / 128 : 0;
  static constexpr int kVtPanelBytes = kFp8 ? kHeadDim * 128 : 0;
  static constexpr int kVtTileBytes = kVtPanels * kVtPanelBytes;
  // With v_pretransposed (kVPretransposed) V^T comes from global memory, written by the transpose_v
  // entry before the forward: TMA fills the Vt ring, and there is no V ring and no transposer.
  static constexpr bool kVPretransposed = Config::kVPretransposed != 0;
  static_assert(!kVPretransposed || kFp8, "V is transposed beforehand for FP8 only");
  static constexpr int kTransposeWarps = kFp8 && !kVPretransposed ? 3 : 0;
  static constexpr int kVRingStages = kVPretransposed ? 0 : kStages;
  // Q slots: with two, the next work tile's Q loads while this one's runs (where shared memory
  // has room for a second; codegen decides).
  static constexpr int kQStages = Config::kQStages;
  // q_full and q_empty per Q slot, then k_full, v_full, k_empty and v_empty per stage (FP8: then
  // vt_full and vt_empty).
  static constexpr int kBarrierBytes = 8 * (2 * kQStages + (kFp8 ? 6 : 4) * kStages);
  // User modifiers and the block-mask walk (NoModifiers for a plain spec).
  using Mods = typename ModifiersOf<Config>::type;
  // After the barriers: the work item the producer published with each Q slot (32 bytes each), then
  // with a block mask each K stage's SparseTile (8 bytes), which the producer writes with the load;
  // FP8: the V slot that ends the transposers' loop (8 bytes).
  static constexpr int kSparseTileBytes = Mods::kBlockSparse ? 8 * kStages : 0;
  static constexpr int kEndSlotBytes = kFp8 ? 8 : 0;
  static constexpr int kSmemBytes = 1024 + kQStages * kQBytes + (kStages + kVRingStages) * kKVTileBytes +
                                    kStages * kVtTileBytes + kBarrierBytes + 32 * kQStages + kSparseTileBytes +
                                    kEndSlotBytes;
  // Offsets from the 1024-aligned base: the Q slots, the K, V and (FP8) Vt rings, the barriers, and
  // the transposers' end slot.
  static constexpr int kKOffset = kQStages * kQBytes;
  static constexpr int kVOffset = kKOffset + kStages * kKVTileBytes;
  static constexpr int kVtOffset = kVOffset + kVRingStages * kKVTileBytes;
  static constexpr int kBarrierOffset = kVtOffset + kStages * kVtTileBytes;
  static constexpr int kEndSlotOffset = kBarrierOffset + kBarrierBytes + 32 * kQStages + kSparseTileBytes;
  // The V ring (its barriers after the Q slots' and K's full ones) and FP8's Vt ring (after all others).
  using VRing = PipelineRing<kStages, 8 * (2 * kQStages + kStages), 8 * (2 * kQStages + 3 * kStages)>;
  using VtRing = PipelineRing<kStages, 8 * (2 * kQStages + 4 * kStages), 8 * (2 * kQStages + 5 * kStages)>;
  static_assert(kSmemBytes == Config::kSmemBytes, "the shared-memory layout is the size codegen launches it with");
  // setmaxnreg split of the 64K registers (codegen's, FlashAttention-3's): the producer keeps a few.
  static constexpr int kProducerRegisters = Config::kProducerRegisters;
  static constexpr int kConsumerRegisters = Config::kConsumerRegisters;
  // Within what the launch allocates per CTA (__launch_bounds__ with one CTA per SM: 65536 / threads,
  // in steps of 8): setmaxnreg.inc waits for free registers, so a larger split hangs.
  static_assert(128 * kProducerRegisters + 128 * kConsumers * kConsumerRegisters <= kThreads * (65536 / kThreads / 8 * 8),
                "the registers the launch allocates");
  // Ping-pong pays where the softmax is a large share of a step (FlashAttention-3 uses it up to
  // head dim 128); above that the GEMMs dominate and the token only adds waits.
  static constexpr bool kPingPong = kHeadDim <= 128;

  // One consumer warp's share of the softmax: 16 rows, kBlockN keys, kHeadDim output columns.
  struct Warp {
    using Element = typename Config::Element;
    static constexpr int kMFrags = 1;
    static constexpr int kSFrags = kBlockN / 8;
    static constexpr int kOFrags = kHeadDim / 8;
  };

  static_assert(kBlockM % 64 == 0 && kThreads == 128 * (1 + kConsumers), "one producer and kConsumers warpgroups");
  static_assert(kHeadDim % 32 == 0 && kBlockN % 16 == 0 && kStages >= 2, "whole k16 steps, two stages to overlap");
  static_assert(!kFp8 || (kBlockN % 32 == 0 && kHeadDim % 32 == 0), "FP8: whole k32 steps of both GEMMs");
  static_assert(kQStages == 1 || kQStages == 2, "one or two Q slots");
  // The tail splits' workspace as the host sizes it: per split item, a float4 of row statistics and
  // kHeadDim / 4 float4s of O per consumer thread; a counter per warp (16 rows) of a split tile.
  static_assert(Config::kSplitStatsFloatsPerItem == kConsumers * 128 * 4 &&
                    Config::kSplitOutputFloatsPerItem == kConsumers * (kHeadDim / 8) * 128 * 4 &&
                    Config::kSplitCountersPerTile == 4 * kConsumers,
                "the split items' workspace is laid out as the host sizes it");

  // With two Q slots a finished tile's O is staged in its own Q slot (Q's panel layout, each consumer
  // in the 64 rows only its QK^T read) and leaves by TMA stores, while the next tile runs in the other
  // slot; the producer refills the slot a step later, long before it needs it. With one Q slot the
  // next tile's Q is loading into it by then, and no other space is free: O leaves from registers.
  // (FP8: the slot's layout is for 8-bit values, O's is bf16.)
  static constexpr bool kStagesOutputInQSlot = kQStages == 2 && !kFp8;
  // With one Q slot and no ping-pong (head dims 192 and 256), the last consumer warpgroup stages its
  // O in the first 64 rows of the V tile that every consumer's last P V has just read (the producer
  // refills that stage only for the next tile's second block); the others store from registers
  // meanwhile. The consumers meet on a barrier first: without ping-pong their last P V end
  // together, with it the first would wait half a step.
  static constexpr bool kStagesOutputInVStage = kQStages == 1 && !kPingPong && kBlockN >= 64 && !kFp8;
};

// Key tiles [n_block_min, n_block_max) that query block m0 must visit; walked from the last. With a
// block mask they are steps through the row's lists (sparse_tile maps a step to its tile).
struct KeyTileRange {
  int n_block_min, n_block_max;
  int count() const { return n_block_max - n_block_min; }
};
template <int kBlockM, int kBlockN, MaskKind kMask, class Mods>
__device__ __forceinline__ KeyTileRange key_tile_range(const AttentionFwdParams& p, const SequenceExtent& seq,
                                                       const Sm90WorkTile& work, int splits) {
  const int m0 = work.m_block * kBlockM;
  KeyTileRange tile;
  if constexpr (Mods::kBlockSparse) {
    tile = {0, sparse_row(p.block_mask, work.batch, work.head, m0 / p.block_mask.row_block_size).count};
  } else {
    const KeyRange keys = AttentionMask<kMask>(p, seq.seqlen_q, seq.seqlen_k).keys_of(p, m0, kBlockM);
    const int n_block_min = keys.begin / kBlockN;
    tile = {n_block_min, keys.end > keys.begin ? (keys.end + kBlockN - 1) / kBlockN : n_block_min};
  }
  if (work.split < 0) return tile;
  // A split item's share: the (split % splits)-th of `splits` contiguous runs of the tile's blocks.
  const int share = work.split % splits, count = tile.count();
  return {tile.n_block_min + count * share / splits, tile.n_block_min + count * (share + 1) / splits};
}

// FP8: the producer warpgroup's warps 1-3 turn each V tile (kBlockN keys of kHeadDim bytes, the
// 128-byte-swizzled panels TMA writes) into Vt (kHeadDim rows of kBlockN keys: the K-major B
// operand 8-bit wgmma needs for P V), in V's ring order, until the slot the producer marks as the
// end. Within each 16 keys, Vt's column 4 t + i holds key 2 t + (i & 1) + 8 (i >> 1): the keys
// that lane t of a quad holds in P's C layout (pack_probabilities), so P needs no shuffles. A job
// is 16 keys x 32 columns: one ldmatrix.trans reads them as four 8x8 16-bit matrices (keys 0-7 and
// 8-15 of two 16-byte column chunks), which gives each thread two keys' bytes at two columns per
// matrix; byte permutes make four keys at one column of them; one stmatrix writes 8 Vt rows x 16
// bytes per matrix. (FlashAttention-3 transposes FP8 V in its producer warps too.)
// Every address derives from the shared-memory symbol and the lane from %tid, which ptxas recomputes
// rather than holds: passed in, they spilled in the producer's 24 registers (head dim 256, causal).
template <class Shape>
__device__ void transpose_v_tiles(int transposer) {
  extern __shared__ __align__(1024) unsigned char smem[];
  constexpr int kKeyGroups = Shape::kBlockN / 16, kJobs = kKeyGroups * (Shape::kHeadDim / 32);
  const unsigned base = (shared_address(smem) + 1023u) & ~1023u;
  const typename Shape::VRing v_ring{base + Shape::kBarrierOffset};
  const typename Shape::VtRing vt_ring{base + Shape::kBarrierOffset};
  const unsigned sV = base + Shape::kVOffset, sVt = base + Shape::kVtOffset, end_v_slot = base + Shape::kEndSlotOffset;
  for (int slot = 0;; ++slot) {
    const int stage = v_ring.stage(slot);
    v_ring.wait_full(slot);
    int end_slot;
    asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(end_slot) : "r"(end_v_slot) : "memory");
    if (end_slot == slot) return;
    vt_ring.wait_empty(slot);
    const unsigned v_tile = sV + stage * Shape::kKVTileBytes, vt_tile = sVt + stage * Shape::kVtTileBytes;
    // (Two jobs at a time, reads first, measured 4-15% slower at head dims 128 and 256. The lane's
    // address parts are recomputed in each job: kept live across the loop, head dim 256, whose
    // producer has 24 registers, spilled.)
    for (int job = transposer; job < kJobs; job += Shape::kTransposeWarps) {
      const int lane = fresh_thread_index() % 32, matrix = lane / 8, matrix_row = lane % 8;  // (this lane's matrix row)
      const int key_group = job % kKeyGroups, column0 = job / kKeyGroups * 32;
      // ldmatrix: matrix j holds keys 8 (j % 2) .. + 7 of the group at column chunk column0 / 16 + j / 2.
      const int key = key_group * 16 + matrix % 2 * 8 + matrix_row, column = column0 + matrix / 2 * 16;
      unsigned r[4];
      ldmatrix_x4_trans(r, v_tile + column / 128 * Shape::kKVPanelBytes + key * 128 +
                               ((column % 128 / 16 ^ key % 8) << 4));
      // stmatrix: thread g's registers hold Vt rows 2 g and 2 g + 1 of each column chunk. Matrix j
      // (e = j % 2) takes row 2 g + e from threads g < 4 and row 2 g + 1 - e from the others: its 8
      // rows then differ mod 8, so their swizzled 16-byte chunks fall in distinct banks (rows 2 g + e
      // alone, two by two in the same banks, cost half the stores' bandwidth).
      const int vt_row = column0 + matrix / 2 * 16 + 2 * matrix_row + (matrix % 2 ^ (matrix_row >= 4));
      const unsigned even = lane >= 16 ? 0x7531 : 0x6420, odd = lane >= 16 ? 0x6420 : 0x7531;  // (g = lane / 4)
      stmatrix_x4(vt_tile + key_group / 8 * Shape::kVtPanelBytes + vt_row * 128 + ((key_group % 8 ^ vt_row % 8) << 4),
                  byte_permute(r[0], r[1], even), byte_permute(r[0], r[1], odd), byte_permute(r[2], r[3], even),
                  byte_permute(r[2], r[3], odd));
    }
    fence_proxy_async_shared();  // the Vt writes before the consumers' wgmma reads them
    __syncwarp();
    if (fresh_thread_index() % 32 == 0) {
      mbarrier_arrive(vt_ring.full_barrier(stage));
      mbarrier_arrive(v_ring.empty_barrier(stage));
    }
  }
}

// v_pretransposed, varlen: the first of sequence `batch`'s columns of V^T. Each sequence before it has
// 16 columns of room past its keys, and the start is rounded down to 16, so every sequence's
// permuted groups of 16 keys stay its own. (The host sizes V^T by the same rule.)
__device__ __forceinline__ int transposed_v_first_column(const SequenceExtent& seq, int batch) {
  return (seq.k_start + 16 * batch) & ~15;
}

// v_pretransposed (FP8): V^T in global memory for the forward's Vt ring (AttentionSm90FwdParams::vt).
// A CTA takes 64 keys of one sequence and KV head: their V rows into shared memory (16 bytes a
// thread; bytes past the head dim and keys past the sequence read as zeros), then the kHeadDim rows
// of V^T out, 4 columns a thread, the keys permuted within each 16 as transpose_v_tiles permutes
// them. Columns stop at the sequence's length rounded up to 16 (beyond: the next sequence's room, or
// TMA's zero fill).
template <class Config>
__device__ void sm90_fwd_transpose_v_kernel(const AttentionSm90FwdParams& params) {
  using Shape = Sm90FwdShape<Config>;
  if constexpr (Shape::kVPretransposed) {
    constexpr int kHeadDim = Shape::kHeadDim, kKeys = 64, kChunks = kHeadDim / 16;
    __shared__ __align__(16) unsigned char rows[kKeys][kHeadDim + 16];  // (+16: a row's bytes shift banks)
    const AttentionFwdParams& p = params.fwd;
    const bool varlen = p.cu_seqlens_k != nullptr;
    const int key0 = blockIdx.x * kKeys, kv_head = blockIdx.y;
    // (Batches past the grid's limit of 65535 take turns.)
    for (int batch = blockIdx.z; batch < p.batch; batch += gridDim.z) {
      const SequenceExtent seq = sequence_extent<true>(p, batch);
      const int columns = (seq.seqlen_k + 15) / 16 * 16 - key0;  // this CTA's, a multiple of 16
      if (columns <= 0) continue;
      const unsigned char* v = static_cast<const unsigned char*>(p.v) + seq.v_batch_offset +
                               static_cast<long long>(kv_head) * p.v_head_stride;
      for (int i = threadIdx.x; i < kKeys * kChunks; i += blockDim.x) {
        const int key = i / kChunks, byte0 = i % kChunks * 16;
        uint4 chunk = make_uint4(0u, 0u, 0u, 0u);
        if (key0 + key < seq.seqlen_k) {
          const unsigned char* row = v + static_cast<long long>(seq.k_start + key0 + key) * p.v_row_stride;
          if (byte0 + 16 <= p.head_dim) {
            chunk = *reinterpret_cast<const uint4*>(row + byte0);
          } else {
            unsigned char bytes[16];
#pragma unroll
            for (int b = 0; b < 16; ++b) bytes[b] = byte0 + b < p.head_dim ? row[byte0 + b] : 0;
            chunk = *reinterpret_cast<const uint4*>(bytes);
          }
        }
        *reinterpret_cast<uint4*>(&rows[key][byte0]) = chunk;
      }
      __syncthreads();
      unsigned char* vt = params.vt + static_cast<long long>(kv_head) * params.vt_head_stride + key0 +
                          (varlen ? transposed_v_first_column(seq, batch) : batch * params.vt_batch_stride);
      for (int i = threadIdx.x; i < kHeadDim * (kKeys / 4); i += blockDim.x) {
        const int d = i / (kKeys / 4), column = i % (kKeys / 4) * 4;
        if (column >= columns) continue;
        // Columns 4 t .. 4 t + 3 of a group of 16 hold its keys 2 t, 2 t + 1, 2 t + 8 and 2 t + 9.
        const int key = column / 16 * 16 + column % 16 / 2;
        const unsigned packed = unsigned(rows[key][d]) | unsigned(rows[key + 1][d]) << 8 |
                                unsigned(rows[key + 8][d]) << 16 | unsigned(rows[key + 9][d]) << 24;
        *reinterpret_cast<unsigned*>(vt + static_cast<long long>(d) * params.vt_row_stride + column) = packed;
      }
      __syncthreads();  // (before the next batch's rows overwrite these)
    }
  }
}

template <class Config>
__device__ void sm90_fwd_kernel(const AttentionSm90FwdParams& params) {
  using Shape = Sm90FwdShape<Config>;
  using Warp = typename Shape::Warp;
  using Element = typename Shape::Element;
  using OutputElement = typename Shape::OutputElement;
  constexpr bool kFp8 = Shape::kFp8;
  constexpr int kBlockM = Shape::kBlockM, kBlockN = Shape::kBlockN, kStages = Shape::kStages;
  constexpr int kQStages = Shape::kQStages, kConsumers = Shape::kConsumers;
  constexpr MaskKind kMask = Config::kMask;
  using Mods = typename Shape::Mods;
  constexpr float kLog2e = 1.4426950408889634f;
  const AttentionFwdParams& p = params.fwd;

  extern __shared__ __align__(1024) unsigned char smem[];
  require_dynamic_smem(Shape::kSmemBytes);
  const unsigned base = (shared_address(smem) + 1023u) & ~1023u;
  const unsigned sQ = base;                         // kQStages tiles
  const unsigned sK = base + Shape::kKOffset;       // kStages tiles
  const unsigned sV = base + Shape::kVOffset;       // kStages tiles
  const unsigned sVt = base + Shape::kVtOffset;     // FP8: kStages transposed V tiles
  const unsigned barriers = base + Shape::kBarrierOffset;
  // The rings: the Q slots (one load per work tile) and the K and V stages (one per key block), and
  // FP8's Vt stages. Their barriers: the Q slots' full then empty ones, then K full, V full, K empty,
  // V empty, then Vt full and Vt empty.
  const PipelineRing<kQStages, 0, 8 * kQStages> q_ring{barriers};
  const PipelineRing<kStages, 8 * 2 * kQStages, 8 * (2 * kQStages + 2 * kStages)> k_ring{barriers};
  const typename Shape::VRing v_ring{barriers};
  // FP8: the transposers fill the Vt ring from the V one, the consumers' P V reads it (pv_ring).
  const typename Shape::VtRing vt_ring{barriers};
  const auto pv_ring = [&] {
    if constexpr (kFp8) return vt_ring;
    else return v_ring;
  }();
  auto bar_q_full = [&](int slot) { return q_ring.full_barrier(slot); };
  auto bar_q_empty = [&](int slot) { return q_ring.empty_barrier(slot); };
  auto bar_k_empty = [&](int stage) { return k_ring.empty_barrier(stage); };
  auto bar_v_empty = [&](int stage) { return pv_ring.empty_barrier(stage); };  // (the consumers')
  // The work tile each Q slot holds (PublishedTile), published by the producer with the Q tile.
  auto published_tile = [&](int slot) { return barriers + Shape::kBarrierBytes + 32 * slot; };
  // The work tile's KeyTileRange follows it in the slot (bytes 24-31): the consumers read their
  // key blocks rather than derive them (the mask's key range, a split item's share: divisions).
  constexpr unsigned kPublishedKeysOffset = 24;
  // With a block mask: the key tile each K stage holds (written before its load's expect_tx, so its
  // k_full wait makes it visible; read before the stage is freed).
  auto key_tile_info = [&](int stage) { return barriers + Shape::kBarrierBytes + 32 * kQStages + 8 * stage; };
  // FP8: the V slot the producer never fills, -1 until it is known (the transposers stop there).
  const unsigned end_v_slot = base + Shape::kEndSlotOffset;

  // Warp-uniform values go through a shuffle so that ptxas can see they are uniform: a wgmma on a
  // path it must treat as divergent is serialized (C7520), and the overlap is lost.
  const int tid = threadIdx.x, lane = tid % 32;
  const int warp = warp_uniform(tid / 32), group = warp / 4;
  // Split items are compiled in only where the spec splits tails (codegen's kTailSplits).
  constexpr bool kTailSplits = Config::kTailSplits != 0;
  const int num_work_items = sm90_work_items<kTailSplits>(params);
  const bool varlen = p.cu_seqlens_q != nullptr;
  // The counter's next value; without a counter (one CTA per work item, no scratch memory to zero
  // for a small launch) a value past the end.
  auto claim_next_item = [&] { return params.tile_counter != nullptr ? atomicAdd(params.tile_counter, 1) : num_work_items; };
  // A continuing spec merges O into its running state from the registers: no staging for TMA.
  constexpr bool kContinues = ContinuesOf<Config>::value;
  const bool o_via_tma = !kContinues && Shape::kStagesOutputInQSlot && params.o_via_tma != 0;
  const bool o_via_v_stage = !kContinues && Shape::kStagesOutputInVStage && params.o_via_tma != 0;

  if (tid == 0) {
    // The producer thread fills a stage; lane 0 of each consumer warp frees it.
    q_ring.init(1, 4 * kConsumers);
    // (FP8: V stages are freed by the transposers, Vt stages by the consumers.)
    // (V transposed beforehand: no V ring, and the producer fills the Vt ring.)
    const int v_readers = kFp8 ? Shape::kTransposeWarps : 4 * kConsumers;
    for (int s = 0; s < kStages; ++s) {  // K and V together, in the order of the kernel before the rings
      mbarrier_init(k_ring.full_barrier(s), 1);
      if (!Shape::kVPretransposed) mbarrier_init(v_ring.full_barrier(s), 1);
      mbarrier_init(k_ring.empty_barrier(s), 4 * kConsumers);
      if (!Shape::kVPretransposed) mbarrier_init(v_ring.empty_barrier(s), v_readers);
    }
    if constexpr (kFp8) {
      vt_ring.init(Shape::kVPretransposed ? 1 : Shape::kTransposeWarps, 4 * kConsumers);
      asm volatile("st.shared.s32 [%0], -1;\n" ::"r"(end_v_slot) : "memory");
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (group == 0) {  // producer
    registers_decrease<Shape::kProducerRegisters>();
    if constexpr (kFp8 && !Shape::kVPretransposed) {
      if (warp != 0) {
        transpose_v_tiles<Shape>(warp - 1);
        return;
      }
    }
    if (tid != 0) return;
    int kv_count = 0, q_count = 0;  // loads so far: they select the slot or stage and the barrier phase
    for (int index = blockIdx.x, next_index = -1;; index = next_index) {
      Sm90WorkTile work{};
      SequenceExtent seq{};
      if (index < num_work_items) {
        work = sm90_work_item<kTailSplits>(params, index);
        seq = sequence_extent<true>(p, work.batch);
        if (work.m_block * kBlockM >= seq.seqlen_q) {  // varlen: a shorter sequence
          next_index = gridDim.x + claim_next_item();
          continue;
        }
      }
      // A Q slot is free: publish the tile (or the end) with it, on that slot's q_full.
      const int q_slot = q_count % kQStages;
      q_ring.wait_empty(q_count);
      ++q_count;
      publish_tile(published_tile(q_slot), index < num_work_items ? index : -1, work);
      if (index >= num_work_items) {
        mbarrier_arrive(bar_q_full(q_slot));
        if constexpr (kFp8 && !Shape::kVPretransposed) {
          // The transposers' end: the next V slot's full barrier completes with no load, once the
          // slot is free, after its number is published.
          v_ring.wait_empty(kv_count);
          asm volatile("st.shared.s32 [%0], %1;\n" ::"r"(end_v_slot), "r"(kv_count) : "memory");
          mbarrier_arrive(v_ring.full_barrier(v_ring.stage(kv_count)));
        }
        break;
      }
      const int m0 = work.m_block * kBlockM;
      const int kv_head = work.head / (p.num_heads_q / p.num_heads_kv), tma_batch = varlen ? 0 : work.batch;
      const KeyTileRange keys = key_tile_range<kBlockM, kBlockN, kMask, Mods>(p, seq, work, params.splits);
      // (Under a block mask the consumers would otherwise read its counts from global memory on
      // their critical path at every work tile.)
      asm volatile("st.shared.v2.s32 [%0], {%1, %2};\n" ::"r"(published_tile(q_slot) + kPublishedKeysOffset),
                   "r"(keys.n_block_min), "r"(keys.n_block_max)
                   : "memory");
      SparseRow sparse{};
      if constexpr (Mods::kBlockSparse)
        sparse = sparse_row(p.block_mask, work.batch, work.head, m0 / p.block_mask.row_block_size);
      mbarrier_arrive_expect_tx(bar_q_full(q_slot), Shape::kQBytes);
      for (int panel = 0; panel < Shape::kPanels; ++panel)
        tma_load_4d(sQ + q_slot * Shape::kQBytes + panel * Shape::kQPanelBytes, params.q_map, bar_q_full(q_slot),
                    panel * Shape::kPanelValues, seq.q_start + m0, work.head, tma_batch);
      // A continuing tile's running state, read in its epilogue: fetched into L2 with its Q, so that
      // the consumers' loads there wait for L2 rather than for memory.
      if (kContinues && p.state_read) {
        const long long first_row = work.batch * p.lse_batch_stride + work.head * p.lse_head_stride +
                                    (varlen ? seq.q_start : 0) + m0;
        const int rows = min(kBlockM, seq.seqlen_q - m0);
        prefetch_l2(p.state_o + first_row * p.head_dim, p.state_o + (first_row + rows) * p.head_dim);
        prefetch_l2(p.lse + first_row, p.lse + first_row + rows);
      }
      // Tile i of this work tile is key block n_block_max - 1 - i, in ring slot kv_count + i. K runs
      // one tile ahead of V: the consumers free a K slot as soon as its QK^T is done but a V slot
      // only after the next tile's softmax, so the next K never queues behind a V slot in use.
      // With a block mask, step n_block_max - 1 - i of the row's lists instead.
      auto tile_at = [&](int i) -> SparseTile {
        if constexpr (Mods::kBlockSparse) return sparse_tile<kBlockN>(p.block_mask, sparse, keys.n_block_max - 1 - i);
        else return {(keys.n_block_max - 1 - i) * kBlockN, 1};
      };
      // (A K load also records its tile for the consumers, once they have freed the stage.)
      auto load = [&](unsigned smem_ring, const TmaDescriptor& map, const auto& ring, int i, const SparseTile& tile,
                      bool records_tile) {
        const int slot = kv_count + i, stage = ring.stage(slot), n0 = tile.start;
        ring.wait_empty(slot);
        if (Mods::kBlockSparse && records_tile)
          asm volatile("st.shared.v2.s32 [%0], {%1, %2};\n" ::"r"(key_tile_info(stage)), "r"(tile.start), "r"(tile.partial)
                       : "memory");
        mbarrier_arrive_expect_tx(ring.full_barrier(stage), Shape::kKVTileBytes);
        for (int panel = 0; panel < Shape::kPanels; ++panel)
          tma_load_4d(smem_ring + stage * Shape::kKVTileBytes + panel * Shape::kKVPanelBytes, map,
                      ring.full_barrier(stage), panel * Shape::kPanelValues, seq.k_start + n0, kv_head, tma_batch);
      };
      // V^T from global memory (v_pretransposed) into the Vt ring: 128-key boxes of kHeadDim rows at
      // the tile's columns (the sequence's own, when varlen: transposed_v_first_column).
      auto load_vt = [&](int i, const SparseTile& tile) {
        const int slot = kv_count + i, stage = vt_ring.stage(slot);
        vt_ring.wait_empty(slot);
        mbarrier_arrive_expect_tx(vt_ring.full_barrier(stage), Shape::kVtTileBytes);
        const int column0 = (varlen ? transposed_v_first_column(seq, work.batch) : 0) + tile.start;
        for (int panel = 0; panel < Shape::kVtPanels; ++panel)
          tma_load_4d(sVt + stage * Shape::kVtTileBytes + panel * Shape::kVtPanelBytes, params.vt_map,
                      vt_ring.full_barrier(stage), column0 + 128 * panel, 0, kv_head, tma_batch);
      };
      // The next tile is claimed before this one's last K and V loads, which wait for free slots: the
      // atomic's round trip overlaps those waits instead of delaying the next tile's Q and first K.
      // (The counter's value is first read after the loop, so the thread does not wait for it there;
      // adding gridDim.x at the claim made ptxas wait for the atomic on the spot.)
      const int claim_at = max(keys.count() - 1, 0);
      int claimed = 0;
      // V runs a tile behind K. Under a block mask it loads the tile K loaded a step before (one
      // list read per tile); otherwise its tile is computed at its load, as K's is.
      SparseTile last_k_tile{};
      for (int i = 0; i <= keys.count() && keys.count() > 0; ++i) {
        if (i == claim_at) claimed = claim_next_item();
        const SparseTile v_tile = last_k_tile;
        if (i < keys.count()) {
          const SparseTile k_tile = tile_at(i);
          load(sK, params.k_map, k_ring, i, k_tile, true);
          if constexpr (Mods::kBlockSparse) last_k_tile = k_tile;
        }
        if (i > 0) {
          if constexpr (Shape::kVPretransposed) load_vt(i - 1, tile_at(i - 1));
          else load(sV, params.v_map, v_ring, i - 1, Mods::kBlockSparse ? v_tile : tile_at(i - 1), false);
        }
      }
      if (keys.count() == 0) claimed = claim_next_item();
      next_index = gridDim.x + claimed;
      kv_count += keys.count();
    }
    return;
  }

  // Consumers.
  registers_increase<Shape::kConsumerRegisters>();
  const int consumer = group - 1, warp_in_group = warp % 4;
  const int warp_row0 = consumer * 64 + warp_in_group * 16;  // this warp's rows in the tile
  // Ping-pong token: consumer c waits on barrier 1 + c (its own 128 threads plus the previous
  // consumer's 128 arriving), then passes the token on. The first consumer starts holding it.
  const int my_turn = 1 + consumer, next_turn = 1 + (consumer + 1) % kConsumers;
  if (Shape::kPingPong && consumer == 0) named_barrier_arrive(my_turn, 256);
  auto wait_turn = [&] { if (Shape::kPingPong) named_barrier_sync(my_turn, 256); };
  auto pass_turn = [&] { if (Shape::kPingPong) named_barrier_arrive(next_turn, 256); };
  // Barrier 4 + c: consumer c's warps have staged their O rows (ids 1..3 carry the token); 7: every
  // consumer's last P V of a tile has read its V tile (before the last consumer writes O there).
  const int output_staged = 4 + consumer, v_tile_read = 7;

  // Scores a softcap or a score modifier has rewritten are final: only log2(e) remains to apply.
  constexpr bool kFinalScores = Config::kHasSoftcap || Mods::kHasScore;
  // A row no key is visible to: LSE -inf under a user's mask (FlexAttention's), else +inf.
  constexpr bool kEmptyRowLse = Mods::kHasMask || Mods::kBlockSparse;
  // FP8: Q K^T times q_descale k_descale is the score (per batch and KV head; 1 otherwise), and P is
  // offset by 2^6 (see softmax_scores).
  constexpr int kProbabilityLog2Offset = kFp8 ? 6 : 0;
  auto descale_at = [&](const Fp8Descale& d, int batch, int head) {
    const int kv_head = head / (p.num_heads_q / p.num_heads_kv);
    return d.data != nullptr ? __ldg(d.data + batch * d.batch_stride + kv_head * d.head_stride) : 1.f;
  };
  auto qk_descale_of = [&](int batch, int head) {
    return kFp8 ? descale_at(params.q_descale, batch, head) * descale_at(params.k_descale, batch, head) : 1.f;
  };
  // log2(e) times the softmax scale for raw scores (Q K^T), and the softcap's scale.
  auto score_log2_scale = [&](float qk_descale) { return kFinalScores ? kLog2e : p.softmax_scale * kLog2e * qk_descale; };
  auto softcap_scale_of = [&](float qk_descale) {
    return Config::kHasSoftcap ? p.softmax_scale * qk_descale / p.softcap : 0.f;
  };

  // S = Q K^T into `s` (async; the caller commits): k steps (16 values, or 32 in FP8) advance both
  // K-major descriptors by 32 bytes inside a 128-byte panel.
  auto issue_qk = [&](float (&s)[kBlockN / 2], int q_slot, int stage) {
    unsigned long long q_tile = smem_descriptor_sw128(sQ + q_slot * Shape::kQBytes + consumer * 64 * 128, 16, 1024);
    launder(q_tile);
    const unsigned long long k_tile = smem_descriptor_sw128(sK + stage * Shape::kKVTileBytes, 16, 1024);
#pragma unroll
    for (int ks = 0; ks < Shape::kHeadDim / Shape::kGemmK; ++ks) {
      const unsigned k_bytes = (ks % 4) * 32;
      Config::wgmma_qk(s, smem_descriptor_advance(q_tile, (ks / 4) * Shape::kQPanelBytes + k_bytes),
                       smem_descriptor_advance(k_tile, (ks / 4) * Shape::kKVPanelBytes + k_bytes), ks > 0);
    }
  };
  // P V's k steps: P as wgmma A fragments, four registers each.
  constexpr int kPvSteps = kBlockN / Shape::kGemmK;
  // O += P V (async), or O = P V for a work tile's first key block (`accumulate` false: O still
  // holds the previous tile's output). V is MN-major, each 16-key step is 16 rows (2048 bytes)
  // further, and the 64-dim panels are kKVPanelBytes apart (the descriptor's leading offset).
  // FP8: Vt is K-major, as K is for Q K^T: 32-key steps 32 bytes apart in 128-key panels.
  auto issue_pv = [&](float (&o)[Shape::kHeadDim / 2], unsigned (&a)[kPvSteps][4], int stage, bool accumulate) {
    if constexpr (kFp8) {
      const unsigned long long vt_tile = smem_descriptor_sw128(sVt + stage * Shape::kVtTileBytes, 16, 1024);
#pragma unroll
      for (int ks = 0; ks < kPvSteps; ++ks)
        Config::wgmma_pv(o, a[ks], smem_descriptor_advance(vt_tile, (ks / 4) * Shape::kVtPanelBytes + (ks % 4) * 32),
                         ks > 0 || accumulate);
    } else {
      const unsigned long long v_tile =
          smem_descriptor_sw128(sV + stage * Shape::kKVTileBytes, Shape::kKVPanelBytes, 1024);
#pragma unroll
      for (int ks = 0; ks < kPvSteps; ++ks)
        Config::wgmma_pv(o, a[ks], smem_descriptor_advance(v_tile, ks * 16 * 128), ks > 0 || accumulate);
    }
  };
  // Softcap and the mask of tile n0 on fresh scores, then the softmax's first half.
  // Softcap, user modifiers and the mask of key tile `tile` on fresh scores, then the softmax's first
  // half. (batch, head: the work tile's, for the user's functions.)
  auto scores_to_probabilities = [&](RowStatistics<Warp>& st, float (&s)[1][Warp::kSFrags][4],
                                     const SequenceExtent& seq, int m0, const SparseTile& tile, int batch, int head,
                                     float qk_descale) {
    // (This thread's first row is written out in each branch: computed once above the softcap it
    // stayed live, and d256 causal spilled 12 bytes.)
    const int n0 = tile.start;
    if constexpr (Config::kHasSoftcap) {
#pragma unroll
      for (int ni = 0; ni < Warp::kSFrags; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][ni][e] = p.softcap * tanh_accurate(s[0][ni][e] * softcap_scale_of(qk_descale));
    }
    if constexpr (Mods::kBlockSparse) {
      // A partly visible block's elements go through the mask modifier; a fully visible one's are
      // hidden only past the keys' end.
      const bool partial = tile.partial != 0;
      if (Mods::kHasScore || partial || n0 + kBlockN > seq.seqlen_k)
        modify_scores<Mods, Warp>(s, p, batch, head, seq.seqlen_q, seq.seqlen_k, m0 + warp_row0 + lane / 4, n0, lane,
                                  partial || n0 + kBlockN > seq.seqlen_k, partial);
    } else {
      if constexpr (Mods::kHasScore || Mods::kHasMask)
        modify_scores<Mods, Warp>(s, p, batch, head, seq.seqlen_q, seq.seqlen_k, m0 + warp_row0 + lane / 4, n0, lane,
                                  Mods::kHasMask, true);
      // Varlen: rows past this sequence hold the next one's keys, not zeros; masking removes them.
      const AttentionMask<kMask> mask(p, seq.seqlen_q, seq.seqlen_k);
      if (warp_uniform(mask.cuts(p, m0, kBlockM, n0, kBlockN)))
        mask.template mask_tile<Warp>(s, p, m0 + warp_row0 + lane / 4, n0, lane);
    }
    return softmax_scores<Warp, /*kLazyRescale=*/true, kProbabilityLog2Offset>(st, s, score_log2_scale(qk_descale));
  };
  // The key tile in K stage `stage`, step n_block of the work tile: recorded by the producer under a
  // block mask (read once the stage is full, before it is freed: volatile, so it stays after the
  // volatile barrier wait; no memory clobber, so the GEMM code around it keeps its schedule), else
  // block n_block. Lane 0 reads it for the warp: the lane that frees the stage (read by every lane,
  // compute-sanitizer's racecheck reported the producer's next write as a hazard).
  auto read_key_tile = [&](int stage, int n_block) -> SparseTile {
    if constexpr (Mods::kBlockSparse) {
      int n0 = 0, partial = 0;
      if (lane == 0)
        asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n" : "=r"(n0), "=r"(partial) : "r"(key_tile_info(stage)));
      return {warp_uniform(n0), warp_uniform(partial)};
    } else {
      return {n_block * kBlockN, 1};
    }
  };
  // P as wgmma A fragments: the C layout of two n8 tiles is the A layout of one k16 step. FP8: a
  // k32 step's register holds four keys of a row where the C layout has pairs 8 keys apart, so
  // keys 2t, 2t + 1, 2t + 8, 2t + 9 of each 16 go in as 4t .. 4t + 3 (Vt's columns are permuted
  // to match; transpose_v_tiles).
  auto pack_probabilities = [&](unsigned (&a)[kPvSteps][4], const float (&s)[1][Warp::kSFrags][4]) {
#pragma unroll
    for (int ks = 0; ks < kPvSteps; ++ks) {
      if constexpr (kFp8) {
        const float(&t)[Warp::kSFrags][4] = s[0];
        a[ks][0] = pack4_e4m3(t[4 * ks][0], t[4 * ks][1], t[4 * ks + 1][0], t[4 * ks + 1][1]);
        a[ks][1] = pack4_e4m3(t[4 * ks][2], t[4 * ks][3], t[4 * ks + 1][2], t[4 * ks + 1][3]);
        a[ks][2] = pack4_e4m3(t[4 * ks + 2][0], t[4 * ks + 2][1], t[4 * ks + 3][0], t[4 * ks + 3][1]);
        a[ks][3] = pack4_e4m3(t[4 * ks + 2][2], t[4 * ks + 2][3], t[4 * ks + 3][2], t[4 * ks + 3][3]);
      } else {
        a[ks][0] = pack2<Element>(s[0][2 * ks][0], s[0][2 * ks][1]);
        a[ks][1] = pack2<Element>(s[0][2 * ks][2], s[0][2 * ks][3]);
        a[ks][2] = pack2<Element>(s[0][2 * ks + 1][0], s[0][2 * ks + 1][1]);
        a[ks][3] = pack2<Element>(s[0][2 * ks + 1][2], s[0][2 * ks + 1][3]);
      }
    }
  };
  // This warp is done with the K (or V or Q) tile behind a barrier.
  auto release = [&](unsigned empty_barrier) {
    if (lane == 0) mbarrier_arrive(empty_barrier);
  };
  // A split item's end, warp by warp: write this warp's unnormalised O and row statistics (raw
  // max, the thread's partial sums), then count the item in. The warp whose count completes its
  // rows' merges every item's, in item order from global memory (its own too), so the result does
  // not depend on which item finished last: reruns are bitwise identical. It returns true with the
  // merged O and statistics in `o` and `st`, to store; the other warps return false.
  auto merge_split_items = [&](const Sm90WorkTile& work, RowStatistics<Warp>& st, float (&o)[Shape::kHeadDim / 2]) {
    const int tid = fresh_thread_index(), lane = tid % 32;
    const int consumer = tid / 128 - 1, thread_in_group = tid % 128;
    const int split_tile = work.split / params.splits, first_item = split_tile * params.splits;
    // Per item and consumer: O as kHeadDim / 8 float4 columns of the 128 threads (coalesced), and one
    // float4 of statistics per thread.
    auto item_output = [&](int item) {
      return reinterpret_cast<float4*>(params.split_output) +
             (static_cast<long long>(item) * kConsumers + consumer) * (Shape::kHeadDim / 8) * 128 + thread_in_group;
    };
    auto item_statistics = [&](int item) {
      return reinterpret_cast<float4*>(params.split_row_stats) + (static_cast<long long>(item) * kConsumers + consumer) * 128 +
             thread_in_group;
    };
    float4* out = item_output(work.split);
#pragma unroll
    for (int i = 0; i < Shape::kHeadDim / 8; ++i)
      __stcg(out + i * 128, make_float4(o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]));
    __stcg(item_statistics(work.split),
           make_float4(st.row_max[0][0], st.row_max[0][1], st.row_sum[0][0], st.row_sum[0][1]));
    __threadfence();  // the writes above before this warp's count
    __syncwarp();
    int counted = 0;
    if (lane == 0)
      counted = atomicAdd(params.split_counters + split_tile * (kBlockM / 16) + consumer * 4 + tid / 32 % 4, 1);
    if (warp_uniform(counted) != params.splits - 1) return false;
    __threadfence();  // the other items' writes, made before their counts, are visible from here
    float row_max[2] = {-positive_infinity(), -positive_infinity()};
    for (int item = first_item; item < first_item + params.splits; ++item) {
      const float4 stats = __ldcg(item_statistics(item));
      row_max[0] = fmaxf(row_max[0], stats.x);
      row_max[1] = fmaxf(row_max[1], stats.y);
    }
    // (A row that no item saw keeps max -inf; subtracting 0 then keeps every weight 0.)
    const float scale_log2 = score_log2_scale(qk_descale_of(work.batch, work.head));
    float max_scaled[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      max_scaled[h] = row_max[h] == -positive_infinity() ? 0.f : row_max[h] * scale_log2;
      st.row_sum[0][h] = 0.f;  // (fmaf(w, x, 0) is w x exactly: the sums start with the first item's)
    }
#pragma unroll
    for (int i = 0; i < Shape::kHeadDim / 2; ++i) o[i] = 0.f;
    for (int item = first_item; item < first_item + params.splits; ++item) {
      const float4 stats = __ldcg(item_statistics(item));
      const float weight[2] = {exp2_approx(stats.x * scale_log2 - max_scaled[0]),
                               exp2_approx(stats.y * scale_log2 - max_scaled[1])};
      st.row_sum[0][0] = fmaf(weight[0], stats.z, st.row_sum[0][0]);
      st.row_sum[0][1] = fmaf(weight[1], stats.w, st.row_sum[0][1]);
      const float4* in = item_output(item);
#pragma unroll
      for (int i = 0; i < Shape::kHeadDim / 8; ++i) {
        const float4 x = __ldcg(in + i * 128);  // element 4 i + e is in row half e / 2
        o[4 * i] = fmaf(weight[0], x.x, o[4 * i]);
        o[4 * i + 1] = fmaf(weight[0], x.y, o[4 * i + 1]);
        o[4 * i + 2] = fmaf(weight[1], x.z, o[4 * i + 2]);
        o[4 * i + 3] = fmaf(weight[1], x.w, o[4 * i + 3]);
      }
    }
    st.row_max[0][0] = row_max[0];
    st.row_max[0][1] = row_max[1];
    return true;
  };
  // A continuing spec's rows (ring attention's steps): this step's O and LSE merged by the
  // logsumexp rule into the running state (p.lse and p.state_o, read where p.state_read; see
  // AttentionFwdParams), then written back in fp32, or where the row ends (in [p.state_final_begin,
  // p.state_final_end)) as the output, normalised, with the final LSE. Branch-free: every access is
  // predicated (load_global_if), as a per-lane branch here costs the key loop its uniform registers.
  auto continue_output = [&](const Sm90WorkTile& work, const RowStatistics<Warp>& st,
                             const float (&o)[Shape::kHeadDim / 2]) {
    const SequenceExtent seq = sequence_extent<true>(p, work.batch);
    const int tid = fresh_thread_index(), lane = tid % 32;
    const int thread_row0 = work.m_block * kBlockM + tid / 32 % 4 * 16 + (tid / 128 - 1) * 64 + lane / 4;
    const int col0 = (lane % 4) * 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = thread_row0 + h * 8;
      const bool in_sequence = row < seq.seqlen_q;
      const long long lse_index = work.batch * p.lse_batch_stride + work.head * p.lse_head_stride +
                                  (varlen ? seq.q_start + row : row);
      const float sum = quad_sum(st.row_sum[0][h]);
      const bool reads = p.state_read && in_sequence;
      // (The quad's four lanes load the same word: one request.)
      const float state_lse = load_global_if(reads, p.lse + lse_index, -positive_infinity());
      const LseMerge merged =
          merge_logsumexp(state_lse, row_logsumexp<kFinalScores, /*kEmptyRowNegative=*/true>(p, st.row_max[0][h], sum));
      const float step_factor = sum > 0.f ? merged.weight_b / sum : 0.f;  // O here is unnormalised
      const bool ends = row >= p.state_final_begin && row < p.state_final_end;
      float* state_row = p.state_o + lse_index * p.head_dim + col0;
      OutputElement* out_row = static_cast<OutputElement*>(p.o) + seq.o_batch_offset +
                               (seq.q_start + row) * p.o_row_stride + work.head * p.o_head_stride + col0;
      // This lane's columns that exist (the head dim may be below the kernel's), none past the end.
      const int write_width = in_sequence ? p.head_dim - col0 : 0, read_width = reads ? write_width : 0;
      // The state's columns in groups of 8 pairs (16 registers) whose loads all issue before the
      // group's first store (the stores would otherwise keep each load's latency apart).
      constexpr int kGroup = Warp::kOFrags < 8 ? Warp::kOFrags : 8;
#pragma unroll
      for (int nd0 = 0; nd0 < Warp::kOFrags; nd0 += kGroup) {
        float2 before[kGroup];  // (0 where unread)
#pragma unroll
        for (int g = 0; g < kGroup; ++g)
          before[g] = load_global_pair_if((nd0 + g) * 8 < read_width, state_row + (nd0 + g) * 8);
#pragma unroll
        for (int g = 0; g < kGroup; ++g) {
          const int nd = nd0 + g;
          const bool writes = nd * 8 < write_width;
          float2 value = make_float2(o[4 * nd + 2 * h] * step_factor, o[4 * nd + 2 * h + 1] * step_factor);
          value.x = fmaf(before[g].x, merged.weight_a, value.x);
          value.y = fmaf(before[g].y, merged.weight_a, value.y);
          store_global_u32_if(writes && ends, out_row + nd * 8, pack2<OutputElement>(value.x, value.y));
          store_global_pair_if(writes && !ends, state_row + nd * 8, value);
        }
      }
      // The final LSE of a row that saw no key follows the kernel's convention (+inf, or -inf under
      // a user's mask); the state keeps -inf, the empty sum's.
      store_global_if(in_sequence && lane % 4 == 0, p.lse + lse_index,
                      ends && merged.lse == -positive_infinity()
                          ? row_logsumexp<kFinalScores, kEmptyRowLse>(p, merged.lse, 0.f)
                          : merged.lse);
    }
  };
  // Normalise the O of work tile `work` and store it with its LSE. Through TMA (`box` nonzero: the
  // consumer's 64-row box in a Q slot or a V tile, panels `panel_bytes` apart): stmatrix writes the
  // rows in the 128-byte-swizzled panel layout TMA reads, and the consumer's first thread sends them
  // with one TMA store per panel; the space is freed once TMA has read it (release_staged_output).
  // Otherwise straight from the registers (4-byte pairs). The caller finds the tile's coordinates
  // again (finished_tile): cheaper than keeping them live beside the next tile's across a step.
  auto store_output = [&](const Sm90WorkTile& work, const RowStatistics<Warp>& st,
                          const float (&o)[Shape::kHeadDim / 2], unsigned box, unsigned panel_bytes) {
    if constexpr (kContinues) {
      continue_output(work, st, o);
      return;
    }
    const SequenceExtent seq = sequence_extent<true>(p, work.batch);
    const int tid = fresh_thread_index(), lane = tid % 32;  // (consumer threads start at 128)
    const int consumer = tid / 128 - 1;
    const int thread_row0 = work.m_block * kBlockM + tid / 32 % 4 * 16 + consumer * 64 + lane / 4;
    // FP8: O is P V times v_descale; the sums carry P's offset, which the LSE takes out.
    const float output_scale = kFp8 ? descale_at(params.v_descale, work.batch, work.head) : 1.f;
    float sum[2], inv_sum[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sum[h] = quad_sum(st.row_sum[0][h]);
      inv_sum[h] = sum[h] > 0.f ? output_scale / sum[h] : 0.f;
    }
    if (box != 0) {
      // Lanes 8 j .. 8 j + 7 address the rows of matrix j: rows h = j % 2 of 8-column block j / 2.
      const int row = tid / 32 % 4 * 16 + lane / 8 % 2 * 8 + lane % 8;
#pragma unroll
      for (int pair = 0; pair < Warp::kOFrags / 2; ++pair) {
        const int block = 2 * pair + lane / 16;  // 16-byte chunk of the row, before the swizzle
        const unsigned address = box + block / 8 * panel_bytes + row * 128 + ((block % 8 ^ row % 8) << 4);
        const float* f = o + 8 * pair;
        stmatrix_x4(address, pack2<OutputElement>(f[0] * inv_sum[0], f[1] * inv_sum[0]),
                    pack2<OutputElement>(f[2] * inv_sum[1], f[3] * inv_sum[1]),
                    pack2<OutputElement>(f[4] * inv_sum[0], f[5] * inv_sum[0]),
                    pack2<OutputElement>(f[6] * inv_sum[1], f[7] * inv_sum[1]));
      }
      fence_proxy_async_shared();
      named_barrier_sync(output_staged, 128);
      if (tid % 128 == 0) {  // (never varlen: the map's rows are one sequence's)
#pragma unroll
        for (int panel = 0; panel < Shape::kPanels; ++panel)
          tma_store_4d(params.o_map, box + panel * panel_bytes, panel * 64,
                       work.m_block * kBlockM + consumer * 64, work.head, work.batch);
        bulk_commit_group();
      }
    } else {
      OutputElement* gO = static_cast<OutputElement*>(p.o) + seq.o_batch_offset + seq.q_start * p.o_row_stride +
                          work.head * p.o_head_stride;
      // Each store predicated on its row and columns being there (a head dim below the kernel's
      // leaves columns out), in asm: no branches, and one address register at constant offsets.
      // (Branches per column gave each store its own address, the next waiting on the previous;
      // a full-width copy of the loop without them cost a tenth of the kernel's code.)
      const int col0 = (lane % 4) * 2;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = thread_row0 + h * 8;
        const int write_width = row < seq.seqlen_q ? p.head_dim - col0 : 0;
        OutputElement* out_row = gO + static_cast<long long>(row) * p.o_row_stride + col0;
#pragma unroll
        for (int nd = 0; nd < Warp::kOFrags; ++nd)
          store_global_u32_if(nd * 8 < write_width, out_row + nd * 8,
                              pack2<OutputElement>(o[4 * nd + 2 * h] * inv_sum[h], o[4 * nd + 2 * h + 1] * inv_sum[h]));
      }
    }
    if (p.lse != nullptr && lane % 4 == 0) {
      // (Raw FP8 scores are Q K^T before the descales; final ones include them.)
      const float max_to_score = kFp8 && !kFinalScores ? qk_descale_of(work.batch, work.head) : 1.f;
      constexpr float kSumToExp = 1.f / (1 << kProbabilityLog2Offset);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = thread_row0 + h * 8;
        if (row >= seq.seqlen_q) continue;
        const long long lse_row = varlen ? seq.q_start + row : row;
        p.lse[work.batch * p.lse_batch_stride + work.head * p.lse_head_stride + lse_row] =
            row_logsumexp<kFinalScores, kEmptyRowLse>(p, st.row_max[0][h] * max_to_score, sum[h] * kSumToExp);
      }
    }
  };
  // The same for a work item: a split item's O is merged first (which overwrites `st` and `o`), and
  // stored only by the warp that completes its rows, from the registers. (Only where the pipeline
  // has drained: at the step that starts the next tile, the merge's registers would spill.)
  auto store_item_output = [&](const Sm90WorkTile& work, RowStatistics<Warp>& st, float (&o)[Shape::kHeadDim / 2],
                               unsigned box, unsigned panel_bytes) {
    if constexpr (Shape::kHeadDim <= 128) {
      // One inlined store for both (each is a tenth of the kernel's code, and of its compile time).
      bool stores = true;
      if (kTailSplits && work.split >= 0) {
        stores = merge_split_items(work, st, o);
        box = 0;
      }
      if (stores) store_output(work, st, o, box, panel_bytes);
    } else {  // (above 128 one store after either spilled: the merged O's registers beside the other's)
      if (!kTailSplits || work.split < 0) store_output(work, st, o, box, panel_bytes);
      else if (merge_split_items(work, st, o)) store_output(work, st, o, 0, 0);
    }
  };
  // After a staged O: once TMA has read it (the issuing thread waits), each warp frees the space
  // (its arrival on the Q slot's or V stage's empty barrier).
  auto release_staged_output = [&](unsigned empty_barrier) {
    if (lane == 0) {
      if (warp_in_group == 0) bulk_wait_group_read<0>();
      mbarrier_arrive(empty_barrier);
    }
  };
  // This consumer's box in Q slot `q_slot` where O goes there (o_via_tma), else 0 (registers).
  auto q_slot_box = [&](int q_slot) {
    return o_via_tma ? sQ + q_slot * Shape::kQBytes + consumer * 64 * 128 : 0u;
  };

  // The tile published with Q slot `q_slot`, while the consumers hold the slot. Lane 0 alone reads
  // it: the same thread later arrives on that slot's q_empty, which orders the read before the
  // producer's next write. The shuffles also show ptxas the values are warp-uniform.
  auto read_tile = [&](int q_slot) {
    PublishedTile t{};
    if (lane == 0) t = read_published_tile(published_tile(q_slot));
    return PublishedTile{warp_uniform(t.index),
                         {warp_uniform(t.work.m_block), warp_uniform(t.work.head), warp_uniform(t.work.batch),
                          kTailSplits ? warp_uniform(t.work.split) : -1}};
  };
  // A finished tile's coordinates for its O store: from its Q slot where O is staged there (the slot
  // is still held), else decoded from the index (the producer may have reused the slot).
  auto finished_tile = [&](int index, int q_slot) {
    return o_via_tma ? read_tile(q_slot).work : sm90_work_item<kTailSplits>(params, index);
  };

  // The work tile whose key blocks the consumers compute: it arrives with its Q tile, in Q slot
  // `q_slot`. `has_rows`: this consumer's 64 rows reach into the sequence, as in all but a last
  // query block (block_m 192 at S = 2048 leaves the third consumer none there: 3% of the work).
  struct FrontTile {
    int index, q_slot, m0, split, batch, head;
    float qk_descale;  // FP8's q_descale k_descale (1 otherwise)
    bool has_rows;
    SequenceExtent seq;
    KeyTileRange keys;
  };
  // Under a causal or window mask, how many of a tile's first key blocks (first in walking order:
  // the last keys) lie right of every key this consumer's own rows see: the CTA's taller tile visits
  // them for the consumers below it (at S = 512 causal a sixth of the steps). The consumer passes
  // over them without a GEMM; one block is always left, so that its rows' output takes the usual
  // path. Computed where it is needed: kept in FrontTile, it held one more register across the
  // loop, and the heaviest spec (head dim 64, window, softcap, continuing) spilled. Only in tiles
  // with key blocks shorter than the query tile: where block_n is a multiple of block_m, no
  // consumer's band ends a block early under equal lengths, and the step's slot arithmetic alone
  // cost head dim 128's m128n128 tile 1-2% (H100, causal 512-8k).
  constexpr bool kSkipsMaskedBlocks = kMask != MaskKind::kNone && !Mods::kBlockSparse && kBlockN < kBlockM;
  auto masked_leading_blocks = [&](const FrontTile& t) {
    if constexpr (!kSkipsMaskedBlocks) {
      return 0;
    } else {
      const KeyRange mine =
          AttentionMask<kMask>(p, t.seq.seqlen_q, t.seq.seqlen_k).keys_of(p, t.m0 + consumer * 64, 64);
      const int end_block = mine.end > 0 ? (mine.end + kBlockN - 1) / kBlockN : 0;
      return warp_uniform(max(0, min(t.keys.n_block_max - end_block, t.keys.count() - 1)));
    }
  };
  int kv_count = 0, q_count = 0;
  auto fetch_tile = [&](FrontTile& t) {
    t.q_slot = q_count % kQStages;
    q_ring.wait_full(q_count);
    ++q_count;
    const PublishedTile published = read_tile(t.q_slot);
    t.index = published.index;
    if (t.index < 0) return false;
    t.m0 = published.work.m_block * kBlockM;
    t.split = published.work.split;
    t.batch = published.work.batch;
    t.head = published.work.head;
    t.qk_descale = qk_descale_of(t.batch, t.head);
    t.seq = sequence_extent<true>(p, published.work.batch);
    if (lane == 0)
      asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n"
                   : "=r"(t.keys.n_block_min), "=r"(t.keys.n_block_max)
                   : "r"(published_tile(t.q_slot) + kPublishedKeysOffset)
                   : "memory");
    t.keys.n_block_min = warp_uniform(t.keys.n_block_min);
    t.keys.n_block_max = warp_uniform(t.keys.n_block_max);
    t.has_rows = warp_uniform(t.m0 + consumer * 64 < t.seq.seqlen_q) != 0;
    return true;
  };

  // With two Q slots the key blocks of consecutive work tiles form one stream: the step that
  // computes S for a work tile's first block also runs P V for the previous tile's last, so the
  // softmax of one tile's start overlaps the GEMM of the last one's end, and the epilogue follows
  // that step.
  // O is a flat array, the form the wgmma wrappers take (the mma.sync layout [1][kOFrags][4]
  // flattened). It sits apart from the row statistics: inside one struct, behind a reinterpreting
  // alias, NVVM left a 132-float state in local memory at head dim 256. A tile's first P V
  // overwrites it, so it is never zeroed in the loop (a branch that did would leave ptxas copies
  // of the accumulators, and a serialized wgmma pipeline).
  float o_flat[Shape::kHeadDim / 2];
#pragma unroll
  for (int i = 0; i < Shape::kHeadDim / 2; ++i) o_flat[i] = 0.f;
  // A key block this consumer skips (a tile without its rows, or masked_leading_blocks), in K/V
  // slot `slot`: no GEMM, so the others have the tensor core to themselves. It still takes the
  // ping-pong token once per key block, as the others do, and frees the K and V stage once loaded
  // (waiting for the load keeps its arrivals in the stage's current phase). The drain's V-staging
  // barrier runs only in tiles where no consumer skips every block.
  auto pass_over_block = [&](int slot) {
    const int stage = slot % kStages;
    k_ring.wait_full(slot);
    wait_turn();
    pass_turn();
    release(bar_k_empty(stage));
    pv_ring.wait_full(slot);
    release(bar_v_empty(stage));
  };
  FrontTile front;
  bool more = fetch_tile(front);
  while (more) {
    RowStatistics<Warp> st;
    st.reset();
    if (front.keys.count() != 0 && !front.has_rows) {  // no rows of this consumer's: no GEMM, no store
      release(bar_q_empty(front.q_slot));
      for (int i = 0; i < front.keys.count(); ++i, ++kv_count) pass_over_block(kv_count);
      more = fetch_tile(front);
      continue;
    }
    int back_index = front.index, back_slot = front.q_slot;
    bool fetched = false, stored_via_v_stage = false;
    if (front.keys.count() == 0) {  // no visible key: O is zero and the LSE +inf
#pragma unroll
      for (int i = 0; i < Shape::kHeadDim / 2; ++i) o_flat[i] = 0.f;
      mbarrier_arrive_if(!o_via_tma && fresh_thread_index() % 32 == 0, bar_q_empty(front.q_slot));
    } else {
      // The tile's first (last in key order) block: S, then its softmax; no P V is pending.
      const int skip_blocks = masked_leading_blocks(front);
      for (int i = 0; i < skip_blocks; ++i, ++kv_count) pass_over_block(kv_count);
      int stage = kv_count % kStages, n_block = front.keys.n_block_max - 1 - skip_blocks;
      int staged_slot = -1;
      auto free_staged_slot = [&] {
        if (staged_slot >= 0) release_staged_output(bar_q_empty(staged_slot));
        staged_slot = -1;
      };
      bool accumulate = false;  // whether O holds this tile's sum so far
      unsigned a[kPvSteps][4];
      {
        float s[1][Warp::kSFrags][4];
        float(&s_flat)[kBlockN / 2] = reinterpret_cast<float(&)[kBlockN / 2]>(s);
        k_ring.wait_full(kv_count, stage);
        wait_turn();
        fence_operands(s_flat);
        wgmma_fence();
        issue_qk(s_flat, front.q_slot, stage);
        wgmma_commit();
        const SparseTile tile = read_key_tile(stage, n_block);
        pass_turn();
        wgmma_wait<0>();
        fence_operands(s_flat);
        release(bar_k_empty(stage));
        if (!o_via_tma && front.keys.count() - skip_blocks == 1)
          release(bar_q_empty(front.q_slot));  // Q's last use (see the loop)
        scores_to_probabilities(st, s, front.seq, front.m0, tile, front.batch, front.head, front.qk_descale);
        pack_probabilities(a, s);
      }
      // With one Q slot, O's rescale to a step's running max waits for the next step and runs between
      // its QK^T and P V issues, while the tensor core computes QK^T (FlashAttention-3's order; +2-6%
      // at head dim 256). With two, the cross-tile steps run faster with it right after the P V
      // (measured: 0-10% slower at head dims 64 and 128 the other way).
      constexpr bool kRescaleUnderQk = kQStages == 1;
      OutputRescale<Warp> pending{};  // the rescale waiting for the next step (kRescaleUnderQk)
      pending.any_moved = false;
      // Steps: S of the next key block (the next work tile's first when this one is done) beside P V
      // of this one.
      for (;;) {
        const bool tile_done = warp_uniform(n_block == front.keys.n_block_min);
        int passed = 0;  // the next tile's masked_leading_blocks, passed over in this step
        if (tile_done) {
          // With one Q slot the next tile's Q loads only once this tile's last QK^T is done: waiting
          // for it here would stall this tile's last P V, so the pipeline drains first.
          if (kQStages == 1) break;
          // The next tile may need the slot of the O staged a step ago (a one-block tile between).
          free_staged_slot();
          more = fetch_tile(front);
          fetched = true;
          // (A tile without this consumer's rows is skipped after the drain. A split item, whose O is
          // merged, ends with the drain too.) Blocks the next tile skips pass here, between this
          // tile's last S and its last P V, which holds V's stage: the producer can load the slot of
          // the next tile's first S only if it lies within kStages - 1 of this one's; else drain.
          if (!more || front.keys.count() == 0 || !front.has_rows ||
              (kTailSplits && back_index >= sm90_whole_tiles(params)))
            break;
          if constexpr (kSkipsMaskedBlocks) {
            passed = masked_leading_blocks(front);
            if (passed > kStages - 1) break;
            for (int i = 0; i < passed; ++i) pass_over_block(kv_count + 1 + i);
          }
          n_block = front.keys.n_block_max - passed;
        }
        const int qk_slot = kv_count + 1 + passed;  // the K slot of this step's S
        const int next = qk_slot % kStages, next_block = n_block - 1;
        float s[1][Warp::kSFrags][4];
        float(&s_flat)[kBlockN / 2] = reinterpret_cast<float(&)[kBlockN / 2]>(s);
        k_ring.wait_full(qk_slot, next);
        pv_ring.wait_full(kv_count, stage);
        wait_turn();
        fence_operands(s_flat);
        fence_operands(o_flat);
        fence_operands(a);
        wgmma_fence();
        issue_qk(s_flat, front.q_slot, next);
        wgmma_commit();
        if constexpr (kRescaleUnderQk) {
          rescale_output<Warp>(o_flat, pending);
          fence_operands(o_flat);
          wgmma_fence();
        }
        issue_pv(o_flat, a, stage, accumulate);
        wgmma_commit();
        pass_turn();
        const SparseTile next_tile = read_key_tile(next, next_block);  // (under the GEMMs)
        wgmma_wait<1>();  // S of the next block is ready; P V still runs
        fence_operands(s_flat);
        release(bar_k_empty(next));
        // After a tile's last QK^T its Q is no longer read: the producer may refill the slot, unless O
        // is to be staged there. A staged O has had this step's GEMM issue to leave: free its slot.
        if (!o_via_tma && next_block == front.keys.n_block_min) release(bar_q_empty(front.q_slot));
        free_staged_slot();
        RowStatistics<Warp> st_next = st;
        if (tile_done) st_next.reset();
        OutputRescale<Warp> rescale =
            scores_to_probabilities(st_next, s, front.seq, front.m0, next_tile, front.batch, front.head,
                                    front.qk_descale);
        rescale.any_moved = rescale.any_moved && !tile_done;  // a new tile's first P V overwrites O
        wgmma_wait<0>();
        fence_operands(o_flat);
        fence_operands(a);
        release(bar_v_empty(stage));
        if constexpr (kRescaleUnderQk)
          pending = rescale;
        else
          rescale_output<Warp>(o_flat, rescale);
        pack_probabilities(a, s);
        if (tile_done) {  // the previous tile's O is complete (stored once P is packed: fewer live registers)
          store_output(finished_tile(back_index, back_slot), st, o_flat, q_slot_box(back_slot), Shape::kQPanelBytes);
          if (o_via_tma) staged_slot = back_slot;
          back_index = front.index;
          back_slot = front.q_slot;
        }
        accumulate = !tile_done;  // the next P V starts the new tile's O
        st = st_next;
        stage = next;
        kv_count += 1 + passed;
        n_block = next_block;
      }
      // P V of the tile's last block alone (the next tile has no key block, there is none, or it
      // waits for the one Q slot), then its output and the next tile.
      pv_ring.wait_full(kv_count, stage);
      if constexpr (kRescaleUnderQk) rescale_output<Warp>(o_flat, pending);
      fence_operands(o_flat);
      fence_operands(a);
      wgmma_fence();
      issue_pv(o_flat, a, stage, accumulate);
      wgmma_commit();
      wgmma_wait<0>();
      fence_operands(o_flat);
      fence_operands(a);
      // One Q slot: the last consumer stages its O in this V tile's first 64 rows once every
      // consumer's P V has read the tile; the others free the stage and store from registers. (All
      // of them sync: with arrive-only, a consumer a tile ahead could complete the barrier alone.)
      // Only where the last consumer has rows: then every consumer has; and not for a split item,
      // whose O is merged in global memory. (V staging means one Q slot, whose drain comes before the
      // next fetch: `front` is still the finished tile.)
      const bool v_staging = o_via_v_stage && front.split < 0 &&
                             warp_uniform(front.m0 + (kConsumers - 1) * 64 < front.seq.seqlen_q) != 0;
      const bool stages_in_v = v_staging && consumer == kConsumers - 1;
      if (v_staging) named_barrier_sync(v_tile_read, 128 * kConsumers);
      if (!stages_in_v) release(bar_v_empty(stage));
      ++kv_count;
      if (stages_in_v) {  // (never a split item: see v_staging)
        store_output(sm90_work_item<kTailSplits>(params, back_index), st, o_flat, sV + stage * Shape::kKVTileBytes,
                     Shape::kKVPanelBytes);
        release_staged_output(bar_v_empty(stage));
        stored_via_v_stage = true;
      }
    }
    if (!stored_via_v_stage) {
      store_item_output(finished_tile(back_index, back_slot), st, o_flat, q_slot_box(back_slot), Shape::kQPanelBytes);
      if (o_via_tma) release_staged_output(bar_q_empty(back_slot));  // (the next tile may be waiting for this slot)
    }
    if (!fetched) more = fetch_tile(front);
  }
  // The bulk stores complete before the CTA (and its shared memory) goes.
  if ((o_via_tma || o_via_v_stage) && tid % 128 == 0) bulk_wait_group<0>();
}

}  // namespace flashjit::kernels
