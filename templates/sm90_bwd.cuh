// Hopper backward (sm_90a): the fa2_bwd algorithm (K/V outer, recompute from the saved LSE, dK and
// dV in registers, dQ added to an fp32 accumulator) on TMA and wgmma. Its entries, in order:
//   preprocess       delta = rowsum(dO * O); zeroes the dQ accumulator (common/bwd.cuh).
//   dq_visits        (deterministic mode under a block mask only) which key tiles visit each query
//                    block, from the transposed lists.
//   dkdv_atomic_dq   one CTA per kBlockN keys of one K/V head: a producer warp loads K and V once
//                    and streams the query steps (Q and dO by TMA, LSE and delta by the warp's
//                    lanes) through a ring of kStages; two consumer warpgroups per step of kBlockM
//                    queries compute, in FlashAttention-3's order (each GEMM overlapping the
//                    elementwise work or the dQ hand-off listed after it)
//                      S^T = K Q^T, dP^T = V dO^T                  (wgmma, both operands in smem)
//                      P^T elementwise, once S^T is in             (registers)
//                      dV += P^T dO                                (wgmma, P^T from registers)
//                      dS^T elementwise, once dP^T is in           (registers and smem)
//                      dQ = dS K, then dK += dS^T Q                (wgmma; dS^T and K from smem, dS^T
//                                                                   from registers)
//                    (with a softcap or score modifier, whose dS^T needs the score, P^T and dS^T
//                    wait for both GEMMs; in steps longer than 64 at head dims 64 and 96, dV's GEMM
//                    follows dS^T, see kDvAfterDs), and hand their dQ shares, through shared
//                    memory, to a spare warp of the producer group, which adds them to the
//                    accumulator by TMA reductions (where the buffer fits: head dims 64, 96 and
//                    128; at 192 and 256 the consumers add dQ with their own 8-byte atomics). The
//                    buffer passes between them on two mbarriers (full: every consumer thread
//                    arrives itself, named barriers made compute-sanitizer's racecheck report
//                    hazards; free: the writer once TMA has read it). Deterministic mode (specs
//                    with ordered_dq) orders each query block's adds by key tile on a counter
//                    (p.dq_order), so reruns sum dQ in one order; under a block mask the order is
//                    the key tiles' own, each waiting for the tiles below it that visit the block
//                    (the dq_visits entry marks them first). How the consumers share the work
//                    depends on the head dim:
//                      64   each owns 64 keys (kBlockN 128); dQ is one 64-column panel, so they take
//                           turns: on even steps consumer 0 computes it over all 128 keys, on odd
//                           steps consumer 1 (the other only signals that its dS^T rows are in);
//                           in steps of 128 queries (FlashAttention-3's tile here) each computes it
//                           for its half of the queries instead (see kDqSplitsQueries);
//                      96, 128  each owns 64 keys and computes one 64-column panel of dQ over all 128
//                           keys (the warpgroups' dS^T meet in smem); at 96 the second panel's last
//                           32 columns are past the head dim (zeros in K) and are not added. Steps
//                           may be 80 queries here (FlashAttention-3's tile without a mask): dQ is
//                           then computed transposed, dQ^T = K^T dS^T, from dS panels of 64 keys
//                           (see kDqTransposed), at 64 too (by the consumer whose turn it is);
//                      192, 256  dK and dV of 64 keys would need up to 256 registers a thread, so both
//                           share 64 keys (kBlockN 64): each computes S^T and dP^T for half the
//                           queries, writes its P^T and dS^T columns to smem, and after one barrier
//                           accumulates dK, dV and dQ for two 64-column panels of the head dim from
//                           the exchanged tiles. At 192 the fourth panel of every tile is never
//                           loaded: what it holds reaches only columns past the head dim, which are
//                           never stored.
//   convert_dq       the accumulator -> dQ in the output dtype (common/bwd.cuh).
// GQA: a CTA walks the query steps of every query head sharing its K/V head, so dK and dV are summed
// in registers. Query steps outside the mask are never visited; edge steps are masked per element
// (queries past the sequence too: with varlen, TMA reads the next sequence's rows there).
// User modifiers and block masks (common/modifiers.cuh): under a block mask the producer walks the
// key tile's row of the transposed lists (FlexAttention's q_num_blocks/q_indices) for each query
// head instead, and records each stage's step (first query, head, partly visible or not) for the
// consumers, who run the user's mask on partly visible steps (every step without a block mask) and
// the score modifier with its derivative (the user's, or dual numbers) on every element.
// Shared memory (1024-byte aligned, every tile in 64-value panels with the 128-byte swizzle TMA
// writes): K, V (kBlockN rows); kStages slots of Q and dO (kBlockM rows); two dS^T buffers (keys x
// queries, queries contiguous: the dQ GEMM's MN-major A operand; transposed dQ: dS, queries x keys
// in two 64-key panels, its K-major B), and split by head dim two of P^T;
// the dQ panels for the writer warp; kStages slots of LSE (base 2) and delta; the barriers.
#pragma once

#include "common/bwd.cuh"
#include "common/modifiers.cuh"
#include "common/pipeline.cuh"
#include "common/sm90.cuh"
#include "common/tile_sm80.cuh"  // require_dynamic_smem

namespace flashjit::kernels {

template <class Config>
struct Sm90BwdShape {
  using Element = typename Config::Element;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kBlockM = Config::kBlockM;    // queries per step
  static constexpr int kBlockN = Config::kBlockN;    // keys per CTA
  static constexpr int kStages = Config::kNumStages;
  static constexpr int kThreads = Config::kNumWarps * 32;
  // User modifiers and the block-mask walk (NoModifiers for a plain spec).
  using Mods = typename ModifiersOf<Config>::type;
  static constexpr bool kBlockSparse = Mods::kBlockSparse;
  // The producer records each step for the consumers under a block mask (their steps are in the
  // lists) and with user modifiers (computing them there, ptxas spilled at head dim 128).
  static constexpr bool kRecordsSteps = Mods::kBlockSparse || Mods::kHasMask || Mods::kHasScore;
  static constexpr int kConsumers = kThreads / 128 - 1;
  // How the two consumers share a step (see the top): by keys (64 each) at head dims up to 128;
  // above, where one warpgroup cannot hold dK and dV of 64 keys, by queries for S^T and dP^T and by
  // two panels each of the head dim for dK, dV and dQ, with P^T and dS^T exchanged through shared
  // memory.
  static constexpr bool kSplitHeadDim = kHeadDim > 128;
  // 64-column panels TMA loads (at 96 the last half-filled with zeros), and the panels a tile has
  // in shared memory (split by head dim, two per consumer: at 192 one is never loaded).
  static constexpr int kLoadedPanels = (kHeadDim + 63) / 64;
  static constexpr int kPanels = kSplitHeadDim ? 2 * kConsumers : kLoadedPanels;
  static constexpr int kKeysPerConsumer = kSplitHeadDim ? kBlockN : 64;
  static constexpr int kScoreQueries = kSplitHeadDim ? kBlockM / kConsumers : kBlockM;  // S^T columns per consumer
  static constexpr int kGradCols = kSplitHeadDim ? kPanels * 64 / kConsumers : kHeadDim;  // dK, dV columns per consumer
  static constexpr int kKvPanelBytes = kBlockN * 128, kKvTileBytes = kPanels * kKvPanelBytes;
  static constexpr int kStepPanelBytes = kBlockM * 128, kStepTileBytes = kPanels * kStepPanelBytes;
  static constexpr int kKvLoadedBytes = kLoadedPanels * kKvPanelBytes, kStepLoadedBytes = kLoadedPanels * kStepPanelBytes;
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  // The dQ GEMM of one consumer, over all kBlockN keys: whole 64-column panels of the head dim, or
  // at head dim 64 (one panel) all of it, the consumers taking turns by step (see the top). At 96
  // and 192 the second consumer's panels reach past the head dim: it adds only the columns inside.
  // Steps of 128 queries (FlashAttention-3's tile at head dim 64): each consumer computes dQ for its
  // half of the queries instead, all 64 columns over all 128 keys (A its 64-query panel of dS^T).
  static constexpr bool kDqSplitsQueries = kBlockM == 128;
  static constexpr bool kDqAlternates = kPanels < kConsumers && !kDqSplitsQueries;
  // Otherwise each consumer computes its own panels of the head dim.
  static constexpr bool kDqSplitsColumns = !kDqAlternates && !kDqSplitsQueries;
  static constexpr int kDqCols = kDqSplitsColumns ? kPanels * 64 / kConsumers : kHeadDim;
  static constexpr bool kDqPastHeadDim = kDqSplitsColumns && kConsumers * kDqCols > kHeadDim;
  // Steps of 80 queries (FlashAttention-3's tile at head dim 128 without a mask) are not one 128-byte
  // row of dS^T, and wgmma's M is 64: dQ is computed transposed, dQ^T = K^T dS^T (the consumer's
  // 64-column panel of K as an MN-major A, M its head dim; N the step's queries). Its B operand is
  // dS itself (queries x keys, keys contiguous: K-major), which each consumer writes for its 64 keys
  // as one panel by stmatrix.trans; dQ^T reaches the writer's panels by 4-byte stores.
  static constexpr bool kDqTransposed = kBlockM == 80;
  // dS^T (keys x queries) holds 64 queries per 128-byte row: steps of 128 are two panels of them
  // (transposed dQ: dS, one panel per consumer's 64 keys).
  static constexpr int kDsPanelBytes = kDqTransposed ? kBlockM * 128 : kBlockN * 128;
  static constexpr int kDqAccumulators = (kDqTransposed ? kBlockM : kDqCols) / 2;

  // dQ writers (codegen decides, where the buffer fits): the consumers store a step's dQ to shared
  // memory, 32-column panels of block_m rows with the 128-byte swizzle, and one producer-group warp
  // adds it to the accumulator by TMA reductions, off the consumers' path. The swizzle spreads a
  // warp's 256-byte store over every bank twice, the minimum. Where the producer records steps, the
  // step's query head and m0 (and in deterministic mode under a block mask its turn, its rank) ride
  // in a slot after the panels, for the writer.
  static constexpr bool kDqWriters = Config::kDqWriters != 0;
  static constexpr int kDqBufferPanels = (kDqSplitsColumns ? kConsumers * kDqCols : kHeadDim) / 32;
  static constexpr int kDqPanelBytes = kBlockM * 128;

  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKOffset + kKvTileBytes;
  static constexpr int kQOffset = kVOffset + kKvTileBytes;
  static constexpr int kDoOffset = kQOffset + kStages * kStepTileBytes;
  static constexpr int kDsOffset = kDoOffset + kStages * kStepTileBytes;
  static constexpr int kPOffset = kDsOffset + 2 * kDsBytes;  // P^T, double-buffered like dS^T (head dim 256)
  static constexpr int kDqOffset = kPOffset + (kSplitHeadDim ? 2 * kDsBytes : 0);  // 1024-byte aligned
  static constexpr int kDqStepOffset = kDqOffset + (kDqWriters ? kDqBufferPanels * kDqPanelBytes : 0);
  static constexpr int kLseOffset = kDqStepOffset + (kDqWriters ? 16 : 0);
  static constexpr int kDeltaOffset = kLseOffset + kStages * kBlockM * 4;
  // Deterministic mode under a block mask: each step's turn at its query block is a rank among the
  // visiting key tiles, which the producer warp counts as it records the step.
  static constexpr bool kRanksTurns = Mods::kBlockSparse && OrderedDqOf<Config>::value;
  // Where it records them, each stage's query step (m0, query head, partial: QueryStep; the rank
  // where it counts them), written with the stage's loads.
  static constexpr int kStepInfoOffset = kDeltaOffset + kStages * kBlockM * 4;
  static constexpr int kBarrierOffset = kStepInfoOffset + (kRecordsSteps ? 16 * kStages : 0);
  static constexpr int kDqConsumerThreads = kDqAlternates ? 128 : 128 * kConsumers;  // a step's dQ
  // kv_full, then full and empty per stage, then the dQ buffer's full and free.
  static constexpr int kSmemBytes = 1024 + kBarrierOffset + 8 * (1 + 2 * kStages) + (kDqWriters ? 16 : 0);
  static_assert(kSmemBytes == Config::kSmemBytes, "the shared-memory layout is the size codegen launches it with");

  // setmaxnreg split (codegen's): the producer group keeps a few.
  static constexpr int kProducerRegisters = Config::kProducerRegisters;
  static constexpr int kConsumerRegisters = Config::kConsumerRegisters;
  static_assert(128 * kProducerRegisters + 128 * kConsumers * kConsumerRegisters <= 65536, "the register file");

  static_assert(kConsumers == 2, "a producer warpgroup and two consumers");
  static_assert(kBlockM == 64 || (kBlockM == 80 && kDqTransposed && !kSplitHeadDim && kDqWriters && !kBlockSparse) ||
                    (kBlockM == 128 && kHeadDim == 64 && kDqWriters && !kBlockSparse),
                "steps of 64 queries (one 128-byte swizzle row of dS^T); of 80 at head dims 64 to 128 with the dQ "
                "writer warp (dQ transposed) and no block mask (whose blocks are 128 queries); or of 128 at head "
                "dim 64 with the writer warp (dQ split by queries) and no block mask");
  static_assert(kBlockN == (kSplitHeadDim ? 1 : kConsumers) * kKeysPerConsumer,
                "keys split between the consumers, or shared where the head dim is split");
  static_assert(kDqCols % 64 == 0, "each consumer computes whole 64-column panels of dQ");
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                "head dims 64, 96, 128, 192 and 256");
};

// The row passes run on 256 of the block's threads: 64 rows split into whole passes of them.
constexpr int kSm90BwdRowPassThreads = 256;

template <class Config>
__device__ void sm90_bwd_preprocess_kernel(const AttentionSm90BwdParams& params) {
  if (threadIdx.x >= kSm90BwdRowPassThreads) return;
  bwd_preprocess<Config, kSm90BwdRowPassThreads, /*kSeqused=*/true>(params.bwd);
}

template <class Config>
__device__ void sm90_bwd_convert_dq_kernel(const AttentionSm90BwdParams& params) {
  if (threadIdx.x >= kSm90BwdRowPassThreads) return;
  bwd_convert_dq<Config, kSm90BwdRowPassThreads, /*kSeqused=*/true>(params.bwd);
}

// The order counter of the query block holding row m0 of query head `head` (deterministic mode),
// and the index of its row of visit bits under a block mask.
template <int kBlockM>
__device__ __forceinline__ int dq_order_index(const AttentionBwdParams& p, const SequenceExtent& seq, int batch,
                                              int head, int m0) {
  return head * p.dq_order_head_stride + workspace_row(p.fwd, seq, batch, m0) / kBlockM + batch;
}

// Deterministic mode under a block mask, before dkdv_atomic_dq (same grid): the key tiles that visit
// each query block, a bit per tile in the block's row of p.dq_visits, from the transposed lists the
// dkdv walk follows (so the ranks agree with the visits whatever the forward's lists say). Entries
// past the sequence add nothing and are left out. Other specs launch it never; it compiles empty.
template <class Config>
__device__ void sm90_bwd_dq_visits_kernel(const AttentionSm90BwdParams& params) {
  using Shape = Sm90BwdShape<Config>;
  if constexpr (Shape::kBlockSparse && OrderedDqOf<Config>::value) {
    static_assert(Config::kMask == MaskKind::kNone, "a block mask replaces the built-in masks (tiles in grid order)");
    const AttentionBwdParams& p = params.bwd;
    const AttentionFwdParams& f = p.fwd;
    const int n_block = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
    const SequenceExtent seq = sequence_extent<true>(f, batch);
    const int n0 = n_block * Shape::kBlockN;
    if (n0 >= seq.seqlen_k) return;
    const int heads_per_kv = f.num_heads_q / f.num_heads_kv;
    const BlockSparseParams& mask_by_key = p.transposed_block_mask;
    for (int h = 0; h < heads_per_kv; ++h) {
      const int head = kv_head * heads_per_kv + h;
      const SparseRow row = sparse_row(mask_by_key, batch, head, n0 / mask_by_key.row_block_size);
      for (int i = threadIdx.x; i < row.count; i += blockDim.x) {
        const int m0 = sparse_tile<Shape::kBlockM>(mask_by_key, row, i).start;
        if (m0 >= seq.seqlen_q) continue;
        const long long row = dq_order_index<Shape::kBlockM>(p, seq, batch, head, m0);
        atomicOr(p.dq_visits + row * p.dq_visit_words + n_block / 32, 1u << (n_block % 32));
      }
    }
  }
}

// Key tile n_block's turn at a query block under a block mask: the visiting tiles before it (the
// block's row of visit bits), counted by the lanes of a warp together.
__device__ __forceinline__ int dq_visit_rank(const unsigned* visits, int n_block, int lane) {
  int count = 0;
  for (int word = lane; word <= n_block / 32; word += 32) {
    const unsigned below = word < n_block / 32 ? ~0u : (1u << (n_block % 32)) - 1u;
    count += __popc(__ldg(visits + word) & below);
  }
  return __reduce_add_sync(0xffffffffu, count);
}

// The key tile a CTA of the dkdv grid (key tiles, K/V heads, batch) works on. Causal: CTAs start
// in the order of their linear index, and a key tile's work falls with its index (fewer queries
// see it), so with key tiles fastest each head's longest tile could start in the last wave. Here
// (batch, head) pairs are taken in groups, key tiles slowest within a group: a group's longest
// tiles start first and its shortest end it (longest first). A group's Q, dO and fp32 dQ stay
// within 24 MB of L2; the key-tiles-fastest order kept ~16 MB of them live (head dim 128, 1k-4k).
// `last_tile_first` reverses the key tiles (deterministic mode under a mask: each query block's
// adds then run from the last key tile back, see DqAddOrder, and a tile must start no later
// than the one it waits for).
struct BwdKeyTile {
  int n_block, kv_head, batch;
};

template <MaskKind kMask>
__device__ __forceinline__ BwdKeyTile bwd_key_tile(const AttentionFwdParams& f, int heads_per_kv, bool last_tile_first) {
  const int tiles = gridDim.x;
  auto in_launch_order = [&](int n_block) { return last_tile_first ? tiles - 1 - n_block : n_block; };
  if constexpr (kMask != MaskKind::kCausal) {
    return {in_launch_order(static_cast<int>(blockIdx.x)), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
  } else {
    constexpr long long kGroupBytes = 24ll << 20;
    const int heads = gridDim.y, pairs = gridDim.y * gridDim.z;
    const long long pair_bytes = 8ll * f.seqlen_q * heads_per_kv * f.head_dim;  // Q, dO (2 bytes), dQ (4)
    const int group = static_cast<int>(max(1ll, min(static_cast<long long>(pairs), kGroupBytes / max(pair_bytes, 1ll))));
    const int linear = blockIdx.x + tiles * (blockIdx.y + heads * blockIdx.z);
    const int first_pair = linear / (group * tiles) * group;
    const int pairs_here = min(group, pairs - first_pair);
    const int local = linear - first_pair * tiles;
    const int pair = first_pair + local % pairs_here;
    return {in_launch_order(local / pairs_here), pair % heads, pair / heads};
  }
}

// Deterministic mode: the order in which the key tiles visiting a query block add to its dQ rows,
// chosen so that a tile's turn comes without waiting. A block's counter holds 1 + the key of the
// last tile that added (keys rise along the order); a tile waits for its predecessor's where that
// tile adds to the block before it, and stores its own. Per mask:
//   none, up to kMaxRotatedTiles key tiles   tile j of N starts its walk at step j*S/N of its S
//        steps and wraps around, so at every step the tiles arrive one after another and add in
//        order of arrival (key: the arrival step; predecessor: tile j+1, mod N). This needs the N
//        tiles of a sequence and K/V head resident at once (FlashAttention-3's shift scheduler needs
//        a wave of them): the grid starts them together, and 32 fit on any Hopper part.
//   none, more tiles                         launch order (key: n): every tile walks from the first
//        step, so each waits at every step for the one before it to add.
//   causal, window                           last tile first (key: tiles - 1 - n): a tile's query
//        range starts later the later its keys, so the last tile visiting a block reaches it first
//        and each tile finds its predecessor's adds a step old (first-to-last made each wait a step
//        for the one before; causal ran at ~0.55x the unordered backward at 16k). bwd_key_tile
//        starts the tiles in this order, so the one waited for is running or done.
//   a block mask                             not here: launch order, each tile waiting for the tiles
//        before it that visit the block (their count, dq_visit_rank), whichever steps they take.
template <MaskKind kMask, bool kOrdered>
struct DqAddOrder {
  static constexpr bool kLastTileFirst = kMask != MaskKind::kNone;
  static constexpr int kMaxRotatedTiles = 32;
  struct Turn {
    int wait_for;  // the counter value to wait for, or -1: first at this block
    int done;      // the value to store after adding
  };
  int n_block, tiles, steps;
  bool rotated;
  int walk_start;        // rotated: the step this tile's walk starts at
  KeyRange predecessor;  // otherwise: the queries of the tile before this one (empty: none)

  template <class Mask>
  __device__ __forceinline__ DqAddOrder(const AttentionFwdParams& f, const Mask& mask, int n_block, int block_n,
                                        int seqlen_k, int steps)
      : n_block(n_block), tiles(gridDim.x), steps(steps), rotated(false), walk_start(0), predecessor{0, 0} {
    if constexpr (!kOrdered) return;  // (the atomic kernels walk in the natural order)
    const int tiles_here = (seqlen_k + block_n - 1) / block_n;  // varlen: this sequence's
    rotated = kMask == MaskKind::kNone && tiles_here <= kMaxRotatedTiles && steps >= tiles_here;
    if (rotated) {
      tiles = tiles_here;
      walk_start = first_step(n_block);
    } else {
      const int before = kLastTileFirst ? n_block + 1 : n_block - 1;
      if (before >= 0 && before * block_n < seqlen_k) predecessor = mask.queries_of(f, before * block_n, block_n);
    }
  }
  __device__ __forceinline__ int first_step(int tile) const { return tile * steps / tiles; }
  // The query step (head and block, in the walk's natural order) this tile visits at its step-th.
  __device__ __forceinline__ int slot(int step) const {
    if constexpr (!kOrdered) return step;
    const int at = step + walk_start;
    return at >= steps ? at - steps : at;
  }
  __device__ __forceinline__ Turn turn(int step, int m0, int block_m) const {
    if (rotated) {
      const int before = n_block + 1 == tiles ? 0 : n_block + 1;
      int arrival = slot(step) - first_step(before);  // the predecessor's step at this slot
      if (arrival < 0) arrival += steps;
      return {arrival < step ? arrival + 1 : -1, step + 1};
    }
    const bool visits = predecessor.end > predecessor.begin && m0 / block_m >= predecessor.begin / block_m &&
                        m0 < predecessor.end;
    const int key = kLastTileFirst ? tiles - 1 - n_block : n_block;
    return {visits ? key : -1, key + 1};
  }
};

template <class Config>
__device__ void sm90_bwd_dkdv_atomic_dq_kernel(const AttentionSm90BwdParams& params) {
  using Shape = Sm90BwdShape<Config>;
  using Element = typename Shape::Element;
  constexpr int kBlockM = Shape::kBlockM, kBlockN = Shape::kBlockN, kStages = Shape::kStages;
  constexpr int kHeadDim = Shape::kHeadDim;
  constexpr MaskKind kMask = Config::kMask;
  using Mods = typename Shape::Mods;
  constexpr float kLog2e = 1.4426950408889634f;
  const AttentionBwdParams& p = params.bwd;
  const AttentionFwdParams& f = p.fwd;

  extern __shared__ __align__(1024) unsigned char smem[];
  require_dynamic_smem(Shape::kSmemBytes);
  const unsigned base = (shared_address(smem) + 1023u) & ~1023u;
  const unsigned sK = base + Shape::kKOffset, sV = base + Shape::kVOffset;
  auto sQ = [&](int stage) { return base + Shape::kQOffset + stage * Shape::kStepTileBytes; };
  auto sDo = [&](int stage) { return base + Shape::kDoOffset + stage * Shape::kStepTileBytes; };
  auto sDs = [&](int buffer) { return base + Shape::kDsOffset + buffer * Shape::kDsBytes; };
  auto sP = [&](int buffer) { return base + Shape::kPOffset + buffer * Shape::kDsBytes; };
  unsigned char* const aligned = smem + (base - shared_address(smem));
  float* const sLse = reinterpret_cast<float*>(aligned + Shape::kLseOffset);      // (kStages, kBlockM), base 2
  float* const sDelta = reinterpret_cast<float*>(aligned + Shape::kDeltaOffset);  // (kStages, kBlockM)
  const unsigned bar_kv_full = base + Shape::kBarrierOffset;
  // The ring of query steps (Q, dO, LSE, delta).
  const PipelineRing<kStages, 8, 8 + 8 * kStages> ring{bar_kv_full};
  auto bar_full = [&](int stage) { return ring.full_barrier(stage); };
  auto bar_empty = [&](int stage) { return ring.empty_barrier(stage); };
  // The dQ buffer: written (every consumer thread of the step arrives), free again (the writer, once
  // TMA has read it).
  const unsigned bar_dq_full = bar_kv_full + 8 + 16 * kStages, bar_dq_free = bar_dq_full + 8;
  // Named barriers: 1 and 2 the consumers' dS^T exchange, 3 the adders' of a step's dQ taking their
  // turn in deterministic mode (the writer warp, or without it the consumers).
  constexpr int kDqTurnBarrier = 3;

  const int tid = threadIdx.x, lane = tid % 32;
  const int warp = warp_uniform(tid / 32), group = warp / 4;
  const int heads_per_kv = f.num_heads_q / f.num_heads_kv;
  constexpr bool kOrdered = OrderedDqOf<Config>::value;  // deterministic mode (p.dq_order set)
  // dS^T needs only P (no softcap or score modifier): dS = P (dP - delta) scale, whose
  // consumers take delta premultiplied by the scale (the producer's one multiply per query, for
  // one of theirs per element).
  constexpr bool kDsFromP = !Mods::kHasScore && !Config::kHasSoftcap;
  // Steps longer than 64 at head dims up to 96: dV's GEMM is issued after dS^T (the order of FA4's
  // sm90 backward), not under it. P's fp32 values then end with dS^T before P^T's packed registers
  // are held by the GEMM, so they fit beside dP^T; with dV's GEMM first, dS^T takes P from a packed
  // fp16 copy (see keep_p). At 128, beside dK's and dV's 128 accumulators, ptxas serialised the
  // wgmmas (C7512) and the backward ran 10% slower; steps of 64 lose the overlap and save nothing.
  constexpr bool kDvAfterDs = kDsFromP && kBlockM > 64 && kHeadDim <= 96;
  // The add order of a plain walk; under a block mask each turn is a count of visits instead.
  using AddOrder = DqAddOrder<kMask, kOrdered && !Shape::kBlockSparse>;
  const BwdKeyTile tile = bwd_key_tile<kMask>(f, heads_per_kv, kOrdered && AddOrder::kLastTileFirst);
  const int n_block = tile.n_block, kv_head = tile.kv_head, batch = tile.batch;
  const SequenceExtent seq = sequence_extent<true>(f, batch);
  const int n0 = n_block * kBlockN;
  if (n0 >= seq.seqlen_k) return;  // varlen: this sequence is shorter than the longest
  const bool varlen = f.cu_seqlens_q != nullptr;
  const int tma_batch = varlen ? 0 : batch;

  // Query steps that can see this key tile (the same walk as fa2_bwd's).
  const AttentionMask<kMask> mask(f, seq.seqlen_q, seq.seqlen_k);
  // The step loop's tile test reads these rather than the mask object's: through the object (its
  // cuts(), or its flags) ptxas loaded the window bound per element instead of keeping it in a
  // uniform register, and the d256 causal backward ran 2% slower on the H200 (2 rounds, both
  // layouts, every seqlen). Spelled out here, the SASS is the earlier kernel's.
  const int diagonal = mask.diagonal;
  const bool has_right = kMask != MaskKind::kNone && f.window_right >= 0;
  const bool has_left = kMask == MaskKind::kWindow && f.window_left >= 0;
  const KeyRange queries = mask.queries_of(f, n0, kBlockN);
  const int m_block_min = queries.begin / kBlockM;
  const int m_block_max = queries.end > queries.begin ? (queries.end + kBlockM - 1) / kBlockM : m_block_min;
  const int steps_per_head = m_block_max - m_block_min;
  const int num_steps = Shape::kBlockSparse
                            ? sparse_query_step_count(p.transposed_block_mask, batch, kv_head, heads_per_kv, n0)
                            : steps_per_head * heads_per_kv;
  const AddOrder add_order(f, mask, n_block, kBlockN, seq.seqlen_k, num_steps);
  auto step_head = [&](int step) { return kv_head * heads_per_kv + add_order.slot(step) / steps_per_head; };
  auto step_m0 = [&](int step) { return (m_block_min + add_order.slot(step) % steps_per_head) * kBlockM; };
  // Deterministic mode: the adders of a step's dQ (`adders` threads, this one `adder` among them) wait
  // for the adds of the tile before this one in the add order (DqAddOrder) on the query block's
  // counter, and once every adder's adds are in pass the turn on (the barrier makes the release
  // cumulative over them, as CUTLASS's semaphores rely on).
  // Under a block mask the counter counts the block's adds: a tile waits for as many as there are
  // visiting tiles before it (`rank`, recorded with the step), and its own raises the count. A list
  // entry past the sequence adds nothing and takes no turn.
  struct DqTurn {
    int* counter;
    typename AddOrder::Turn turn;
  };
  auto take_dq_turn = [&](int step, int head, int m0, int rank, int adder, int barrier, int adders) -> DqTurn {
    if constexpr (Shape::kRanksTurns) {
      if (m0 >= seq.seqlen_q) return {nullptr, {-1, 0}};
      int* counter = p.dq_order + dq_order_index<kBlockM>(p, seq, batch, head, m0);
      if (rank > 0) {
        if (adder == 0) wait_for_count(counter, rank);
        named_barrier_sync(barrier, adders);
      }
      return {counter, {rank, rank + 1}};
    } else {
      int* counter = p.dq_order + head * p.dq_order_head_stride + workspace_row(f, seq, batch, m0) / kBlockM + batch;
      const auto turn = add_order.turn(step, m0, kBlockM);
      if (turn.wait_for >= 0) {
        if (adder == 0) wait_for_counter(counter, turn.wait_for);
        named_barrier_sync(barrier, adders);
      }
      return {counter, turn};
    }
  };
  auto end_dq_turn = [&](const DqTurn& t, int adder, int barrier, int adders) {
    if constexpr (Shape::kRanksTurns) {
      if (t.counter == nullptr) return;
      named_barrier_sync(barrier, adders);
      if (adder == 0) raise_count_release(t.counter, t.turn.done);
    } else {
      named_barrier_sync(barrier, adders);
      if (adder == 0) store_counter_release(t.counter, t.turn.done);
    }
  };

  if (tid == 0) {
    mbarrier_init(bar_kv_full, 1);
    // Every thread that writes or reads LSE and delta arrives itself: the producer warp's lanes on
    // full (lane 0 with the TMA bytes), every consumer thread on empty.
    ring.init(32, 128 * Shape::kConsumers);
    if constexpr (Shape::kDqWriters) {
      mbarrier_init(bar_dq_full, Shape::kDqConsumerThreads);
      mbarrier_init(bar_dq_free, 1);
    }
    fence_barrier_init();
  }
  __syncthreads();

  // Where the head dim is the kernel's, the consumers' own dQ atomics need no column check.
  const bool full_width = f.head_dim == kHeadDim;

  if (group == 0) {  // producer: warp 0; lane 0 issues the TMA loads, every lane copies LSE and delta
    registers_decrease<Shape::kProducerRegisters>();
    if (warp != 0) {
      if (Shape::kDqWriters && warp == 1 && num_steps > 0) {
        // The dQ writer warp: each step, lane 0 adds the consumers' dQ panels to the accumulator by
        // TMA reductions (the map clips columns past the head dim and rows past the last; rows past
        // a sequence hold zeros) and frees the buffer once they have read it.
        const unsigned buffer = base + Shape::kDqOffset;
        for (int step = 0; step < num_steps; ++step) {
          // The step's head and m0: computed, or where the producer records steps, as the consumers
          // left them in the buffer's slot (a block mask's steps are not computable here).
          int head = 0, m0 = 0, rank = 0, unused;
          if constexpr (!Shape::kRecordsSteps) {
            head = step_head(step);
            m0 = step_m0(step);
          }
          mbarrier_wait(bar_dq_full, step & 1);
          if constexpr (Shape::kRanksTurns)
            asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(head), "=r"(m0), "=r"(rank), "=r"(unused)
                         : "r"(base + Shape::kDqStepOffset));
          else if constexpr (Shape::kRecordsSteps)
            asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];\n" : "=r"(head), "=r"(m0) : "r"(base + Shape::kDqStepOffset));
          DqTurn turn{};
          if constexpr (kOrdered) turn = take_dq_turn(step, head, m0, rank, lane, kDqTurnBarrier, 32);
          if (lane == 0) {
            if constexpr (kOrdered) fence_proxy_async_global();  // the turn's acquire before the adds
            const int row = workspace_row(f, seq, batch, m0);
#pragma unroll
            for (int panel = 0; panel < Shape::kDqBufferPanels; ++panel)
              if (panel * 32 < f.head_dim)
                tma_reduce_add_3d(params.dq_accum_map, buffer + panel * Shape::kDqPanelBytes, panel * 32, row, head);
            bulk_commit_group();
            if constexpr (kOrdered) {
              bulk_wait_group<0>();  // the adds done before the turn passes on
              fence_proxy_async_global();
            } else {
              bulk_wait_group_read<0>();
            }
          }
          if constexpr (kOrdered) end_dq_turn(turn, lane, kDqTurnBarrier, 32);
          __syncwarp();
          if (lane == 0) mbarrier_arrive(bar_dq_free);
        }
        if (lane == 0) bulk_wait_group<0>();
      }
      return;
    }
    if (lane == 0) {
      mbarrier_arrive_expect_tx(bar_kv_full, 2 * Shape::kKvLoadedBytes);
      for (int panel = 0; panel < Shape::kLoadedPanels; ++panel) {
        tma_load_4d(sK + panel * Shape::kKvPanelBytes, params.k_map, bar_kv_full, panel * 64, seq.k_start + n0,
                    kv_head, tma_batch);
        tma_load_4d(sV + panel * Shape::kKvPanelBytes, params.v_map, bar_kv_full, panel * 64, seq.k_start + n0,
                    kv_head, tma_batch);
      }
    }
    // Query step `step`: LSE and delta by every lane, Q and dO by TMA, and where it is recorded the
    // step itself for the consumers (and its turn, counted by every lane).
    auto load_step = [&](int step, const QueryStep& at) {
      const int stage = step % kStages, head = at.head, m0 = at.m0;
      int rank = 0;
      if constexpr (Shape::kRanksTurns)
        if (m0 < seq.seqlen_q)
          rank = dq_visit_rank(p.dq_visits + static_cast<long long>(dq_order_index<kBlockM>(p, seq, batch, head, m0)) *
                                                 p.dq_visit_words,
                               n_block, lane);
      ring.wait_empty(step);
      // Q and dO first (their TMA copies are the long wait), then every lane's LSE and delta.
      if (lane == 0) {
        if constexpr (Shape::kRanksTurns)
          asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(base + Shape::kStepInfoOffset + 16 * stage),
                       "r"(m0), "r"(head), "r"(at.partial), "r"(rank)
                       : "memory");
        else if constexpr (Shape::kRecordsSteps)
          asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %3};\n" ::"r"(base + Shape::kStepInfoOffset + 16 * stage),
                       "r"(m0), "r"(head), "r"(at.partial)
                       : "memory");
        mbarrier_expect_tx(bar_full(stage), 2 * Shape::kStepLoadedBytes);
        for (int panel = 0; panel < Shape::kLoadedPanels; ++panel) {
          tma_load_4d(sQ(stage) + panel * Shape::kStepPanelBytes, params.q_map, bar_full(stage), panel * 64,
                      seq.q_start + m0, head, tma_batch);
          tma_load_4d(sDo(stage) + panel * Shape::kStepPanelBytes, params.do_map, bar_full(stage), panel * 64,
                      seq.q_start + m0, head, tma_batch);
        }
      }
      // LSE (in base 2) and delta (times the scale where kDsFromP); queries past the sequence get 0
      // (the consumers mask them).
      const float* gLse = f.lse + batch * f.lse_batch_stride + head * f.lse_head_stride + (varlen ? seq.q_start : 0) + m0;
      const float* gDelta = p.delta + static_cast<long long>(head) * p.workspace_rows + workspace_row(f, seq, batch, m0);
      for (int i = lane; i < kBlockM; i += 32) {
        const bool valid = m0 + i < seq.seqlen_q;
        sLse[stage * kBlockM + i] = valid ? gLse[i] * kLog2e : 0.f;
        sDelta[stage * kBlockM + i] = valid ? (kDsFromP ? gDelta[i] * f.softmax_scale : gDelta[i]) : 0.f;
      }
      mbarrier_arrive(bar_full(stage));  // this lane's stores are in (lane 0's step record too)
    };
    if constexpr (Shape::kBlockSparse) {
      // Each query head's row of the transposed lists, in turn (its fully visible blocks first).
      const BlockSparseParams& mask_by_key = p.transposed_block_mask;
      int step = 0;
      for (int h = 0; h < heads_per_kv; ++h) {
        const int head = kv_head * heads_per_kv + h;
        const SparseRow row = sparse_row(mask_by_key, batch, head, n0 / mask_by_key.row_block_size);
        for (int i = 0; i < row.count; ++i, ++step) {
          const SparseTile queries = sparse_tile<kBlockM>(mask_by_key, row, i);
          load_step(step, {queries.start, head, queries.partial});
        }
      }
    } else {
      for (int step = 0; step < num_steps; ++step) load_step(step, {step_m0(step), step_head(step), 1});
    }
    return;
  }

  // Consumers.
  registers_increase<Shape::kConsumerRegisters>();
  constexpr int kScoreQueries = Shape::kScoreQueries, kGradCols = Shape::kGradCols;
  constexpr bool kSplitHeadDim = Shape::kSplitHeadDim;
  const int consumer = group - 1, warp_in_group = warp % 4;
  const int consumer_keys = kSplitHeadDim ? 0 : consumer * 64;             // this consumer's S^T rows
  const int consumer_queries = kSplitHeadDim ? consumer * kScoreQueries : 0;  // and columns
  const int consumer_cols = kSplitHeadDim ? consumer * kGradCols : 0;        // its dK and dV columns
  const int key_row0 = consumer_keys + warp_in_group * 16;  // this warp's keys in the tile
  // This consumer's columns of a step's dQ (at head dim 64 all of them: on its turns, or for its
  // half of the queries in steps of 128), and whether its group j of 8 lies inside the head dim (at
  // 96 and 192 the second consumer's last panel reaches past it).
  const int dq_col0 = Shape::kDqSplitsColumns ? consumer * Shape::kDqCols : 0;
  auto dq_group_inside = [&](int j) { return !Shape::kDqPastHeadDim || dq_col0 + j * 8 < kHeadDim; };
  const float scale_log2 = f.softmax_scale * kLog2e;
  const float softcap_scale = Config::kHasSoftcap ? f.softmax_scale / f.softcap : 0.f;

  float dk[kGradCols / 2], dv[kGradCols / 2];  // (64 keys, kGradCols) per warpgroup, wgmma accumulator layout
#pragma unroll
  for (int i = 0; i < kGradCols / 2; ++i) dk[i] = dv[i] = 0.f;

  // (64 keys, kScoreQueries) = A (64 rows of sA, K-major) x B^T (the consumer's query rows of sB,
  // K-major), over the head dim: S^T from K and Q, dP^T from V and dO.
  auto issue_scores = [&](float (&acc)[kScoreQueries / 2], unsigned sA, unsigned sB) {
    unsigned long long a_tile = smem_descriptor_sw128(sA + consumer_keys * 128, 16, 1024);
    launder(a_tile);
    const unsigned long long b_tile = smem_descriptor_sw128(sB + consumer_queries * 128, 16, 1024);
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      const unsigned k_bytes = (ks % 4) * 32;
      Config::wgmma_scores(acc, smem_descriptor_advance(a_tile, (ks / 4) * Shape::kKvPanelBytes + k_bytes),
                           smem_descriptor_advance(b_tile, (ks / 4) * Shape::kStepPanelBytes + k_bytes), ks > 0);
    }
  };
  // acc (64 keys, kGradCols) += A (64 keys x kBlockM queries) x the consumer's columns of the step
  // tile at sB (kBlockM queries x head dim, MN-major), as one commit group: dV from P^T and dO, dK
  // from dS^T and Q. A comes from registers when the consumer computed all of it, else from the
  // exchanged tile at sA.
  auto issue_key_gradient = [&](float (&acc)[kGradCols / 2], unsigned (&a)[kBlockM / 16][4], unsigned sA, unsigned sB) {
    const unsigned long long b_tile =
        smem_descriptor_sw128(sB + (consumer_cols / 64) * Shape::kStepPanelBytes, Shape::kStepPanelBytes, 1024);
    fence_operands(acc);
    if constexpr (!kSplitHeadDim) fence_operands(a);
    wgmma_fence();
    if constexpr (kSplitHeadDim) {
      const unsigned long long a_tile = smem_descriptor_sw128(sA, 16, 1024);
#pragma unroll
      for (int ks = 0; ks < kBlockM / 16; ++ks)
        Config::wgmma_key_gradient(acc, smem_descriptor_advance(a_tile, ks * 32),
                                   smem_descriptor_advance(b_tile, ks * 16 * 128), true);
    } else {
#pragma unroll
      for (int ks = 0; ks < kBlockM / 16; ++ks)
        Config::wgmma_key_gradient(acc, a[ks], smem_descriptor_advance(b_tile, ks * 16 * 128), true);
    }
    wgmma_commit();
  };

  // The user's mask on this thread's elements of a partly visible step, as a bit set in the element
  // loop's order (i = 4 j + 2 h + c), computed ahead of it: one pass whose side-tensor loads issue
  // together, unguarded where the whole step lies inside the sequence. (Asked element by element
  // inside the loop, each load sat in a branch of its own.)
  static_assert(kScoreQueries / 2 <= 64, "the user's mask bits fit 64 bits");
  auto user_mask_hidden = [&](int query_head, int first_query) {
    unsigned long long hidden = 0;
    auto pass = [&](auto bounded) {
#pragma unroll
      for (int j = 0; j < kScoreQueries / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int q = first_query + consumer_queries + j * 8 + (lane % 4) * 2 + c;
            const int key = n0 + key_row0 + lane / 4 + h * 8;
            const bool inside = !decltype(bounded)::value || (q < seq.seqlen_q && key < seq.seqlen_k);
            if (inside && !Mods::mask(f, batch, query_head, q, key)) hidden |= 1ull << (4 * j + 2 * h + c);
          }
    };
    if (first_query + kBlockM <= seq.seqlen_q && n0 + kBlockN <= seq.seqlen_k) pass(BoolConstant<false>{});
    else pass(BoolConstant<true>{});
    return hidden;
  };

  // The step's queries: computed (before the wait, as ever), or where the producer records them,
  // read once the stage is full (with the step's turn where it counts them).
  auto recorded_query_step = [&](int stage, int& rank) -> QueryStep {
    int m0, head, partial;
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(m0), "=r"(head), "=r"(partial), "=r"(rank)
                 : "r"(base + Shape::kStepInfoOffset + 16 * stage));
    rank = warp_uniform(rank);
    return {warp_uniform(m0), warp_uniform(head), warp_uniform(partial)};
  };

  mbarrier_wait(bar_kv_full, 0);
  for (int step = 0; step < num_steps; ++step) {
    const int stage = step % kStages;
    const unsigned ds_tile = sDs(step % 2), p_tile = sP(step % 2);
    QueryStep at{};
    int rank = 0;  // (the step's turn under a block mask in deterministic mode)
    if constexpr (!Shape::kRecordsSteps) at = {step_m0(step), step_head(step), 1};
    ring.wait_full(step);
    if constexpr (Shape::kRecordsSteps) at = recorded_query_step(stage, rank);
    const int head = at.head, m0 = at.m0;
    float s[kScoreQueries / 2], dp[kScoreQueries / 2];
    fence_operands(s);
    fence_operands(dp);
    wgmma_fence();
    issue_scores(s, sK, sQ(stage));
    wgmma_commit();
    issue_scores(dp, sV, sDo(stage));
    wgmma_commit();
    // (While the GEMMs run.)
    unsigned long long user_hidden = 0;
    if constexpr (Mods::kHasMask)
      if (at.partial != 0) user_hidden = user_mask_hidden(head, m0);

    // P^T and dS^T, packed to 16-bit pairs as soon as they are computed (the C layout of two n8
    // tiles is the A layout of one k16 step: pair (j, h) is a[j / 2][2 (j % 2) + h]); dS^T also to
    // shared memory for the dQ GEMM, and P^T too where the consumers exchange them. Where dS^T needs
    // only P (kDsFromP), P^T is computed while dP^T's GEMM runs and dV's GEMM runs while dS^T is
    // computed (FlashAttention-3's order); otherwise both wait for dP^T.
    unsigned a_p[kBlockM / 16][4], a_ds[kBlockM / 16][4];
    // (Query rows past the sequence: TMA read zeros there, which must not count.)
    const bool asks_mask = Mods::kHasMask && at.partial != 0;  // the user's mask decides this step's elements
    const bool needs_mask = warp_uniform(asks_mask || n0 + kBlockN > seq.seqlen_k || m0 + kBlockM > seq.seqlen_q ||
                                         (has_right && n0 + kBlockN - 1 > m0 + diagonal + f.window_right) ||
                                         (has_left && n0 < m0 + kBlockM - 1 + diagonal - f.window_left));
    // 32-bit shared addresses: generic pointers would hold two registers each through the loop.
    const unsigned lse = base + Shape::kLseOffset + stage * kBlockM * 4;
    const unsigned delta = base + Shape::kDeltaOffset + stage * kBlockM * 4;
    // Element (j, h, c) of this thread: query consumer_queries + 8 j + 2 (lane % 4) + c of the step,
    // key key_row0 + lane / 4 + 8 h of the tile.
    auto step_query = [&](int j) { return consumer_queries + j * 8 + (lane % 4) * 2; };
    auto tile_key = [&](int h) { return key_row0 + lane / 4 + h * 8; };
    // Row `key` of the (keys x queries) tiles, queries query and query + 1: 16-byte chunk query / 8
    // of the row, swizzled by the row's position in its 8-row atom (key % 8 = lane / 4). The tiles
    // are 1024-byte aligned, so the swizzle is an XOR of the address with a constant per chunk: no
    // per-chunk offsets for ptxas to hoist out of the step loop (where registers are short, it
    // spilled them).
    static_assert(kScoreQueries % 8 == 0, "a consumer's queries start at a chunk");
    const unsigned pair_base = (key_row0 + lane / 4) * 128 + ((lane / 4) << 4) + (lane % 4) * 4;
    auto pair_address = [&](unsigned tile, int j, int h) {
      const int chunk = consumer_queries / 8 + j;  // < 8: steps of 64 queries (one 128-byte row)
      return ((tile + pair_base) ^ (chunk << 4)) + h * 8 * 128;
    };
    // Steps longer than 64 with dV's GEMM under dS^T: P for dS^T, kept in fp16 (for a bf16 kernel a
    // second copy): P lies in [0, 1], where fp16 keeps 11 significant bits, 3 more than the bf16 that
    // dS^T is rounded to (P^T's own bf16 put four gradient elements outside the tests' tolerance).
    // The fp32 values would hold 40 registers (64) across dP^T's wait beside P^T's 20 (32), held by
    // dV's GEMM; at 80 ptxas spilled.
    constexpr bool kDsFromHalfP = kDsFromP && kBlockM > 64 && !kDvAfterDs;
    constexpr bool kKeepsHalfP = kDsFromHalfP && !is_same<Element, half_t>::value;
    unsigned p_half[kKeepsHalfP ? kBlockM / 16 : 1][4];
    auto keep_p = [&](int j, int h) {
      const unsigned p_pair = pack2<Element>(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]);
      if constexpr (kKeepsHalfP)
        p_half[j / 2][2 * (j % 2) + h] = pack2<half_t>(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]);
      if constexpr (kSplitHeadDim)
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(pair_address(p_tile, j, h)), "r"(p_pair));
      else
        a_p[j / 2][2 * (j % 2) + h] = p_pair;
    };
    // Transposed dQ: dS goes out by k16 step t (pairs j = 2 t, 2 t + 1), one stmatrix.trans of its
    // four 8x8 matrices (the A fragment's order: keys +0/+8 of queries 16 t + 0..7, then of + 8..15).
    // Lane l gives row l % 8 of matrix l / 8 as stored: query 16 t + 8 (l / 16) + l % 8, the 16-byte
    // chunk of keys 16 warp_in_group + 8 ((l / 8) % 2) in the consumer's panel, swizzled by the
    // query's place in its 8-row atom (l % 8).
    const unsigned ds_rows = ds_tile + consumer * Shape::kDsPanelBytes + (8 * (lane / 16) + lane % 8) * 128 +
                             (((2 * warp_in_group + (lane / 8) % 2) ^ (lane % 8)) << 4);
    // Steps of 128: dS^T goes out by k16 step t too, one stmatrix of the same four matrices,
    // untransposed (the C fragment's pairs are rows of them): lane l gives row l % 8 of matrix l / 8,
    // key key_row0 + 8 ((l / 8) % 2) + l % 8, chunk 2 t + l / 16 of the queries (panel t / 4),
    // swizzled by the key's place in its atom (l % 8): an XOR of the lane's chunk with 2 t % 8.
    const unsigned ds_key_rows =
        ds_tile + (key_row0 + 8 * ((lane / 8) % 2) + lane % 8) * 128 + (((lane / 16) ^ (lane % 8)) << 4);
    auto keep_ds = [&](int j, int h) {
      const unsigned ds_pair = pack2<Element>(dp[4 * j + 2 * h], dp[4 * j + 2 * h + 1]);
      if constexpr (Shape::kDqTransposed) {
        a_ds[j / 2][2 * (j % 2) + h] = ds_pair;
        if (j % 2 == 1 && h == 1)
          stmatrix_x4_trans(ds_rows + (j / 2) * 16 * 128, a_ds[j / 2][0], a_ds[j / 2][1], a_ds[j / 2][2],
                            a_ds[j / 2][3]);
      } else if constexpr (Shape::kDqSplitsQueries) {
        const int t = j / 2;
        a_ds[t][2 * (j % 2) + h] = ds_pair;
        if (j % 2 == 1 && h == 1)
          stmatrix_x4((ds_key_rows ^ (((2 * t) % 8) << 4)) + (t / 4) * Shape::kDsPanelBytes, a_ds[t][0], a_ds[t][1],
                      a_ds[t][2], a_ds[t][3]);
      } else {
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(pair_address(ds_tile, j, h)), "r"(ds_pair));
        if constexpr (!kSplitHeadDim) a_ds[j / 2][2 * (j % 2) + h] = ds_pair;
      }
    };
    // dV += P^T dO: early where P^T is this consumer's own (registers), else once the other's
    // columns are in shared memory.
    auto issue_dv = [&] { issue_key_gradient(dv, a_p, p_tile, sDo(stage)); };

    wgmma_wait<kDsFromP ? 1 : 0>();  // S^T (and dP^T where dS^T needs the score)
    fence_operands(s);
    if constexpr (!kDsFromP) fence_operands(dp);
    // One body, compiled twice: with the masks for the steps that need them, and without for the
    // rest (most of them), where it is the exponentials and the packing alone. Asked per element
    // behind !needs_mask, ptxas computed every element's predicates on every step: the causal
    // section was 2.2x the unmasked one, and the step 9% longer on an H100.
    auto probabilities = [&](auto masked) {
      constexpr bool kMasked = decltype(masked)::value;
#pragma unroll
      for (int j = 0; j < kScoreQueries / 8; ++j) {
        const int query = step_query(j);  // step-relative, and query + 1
        const float2 lse2 = load_shared_pair(lse + 4 * query);
        const float lse_log2[2] = {lse2.x, lse2.y};
        [[maybe_unused]] float deltas[2] = {0.f, 0.f};  // (read only where dS^T needs the score)
        if constexpr (!kDsFromP) {
          const float2 delta2 = load_shared_pair(delta + 4 * query);
          deltas[0] = delta2.x;
          deltas[1] = delta2.y;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // the thread's two keys: g and g + 8
          const int key = tile_key(h);
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int i = 4 * j + 2 * h + c, q = m0 + query + c;
            // (The user's functions see elements inside the sequence only: the mask's after the
            // bounds, and the score's where the step may reach past them.)
            bool visible = true, inside = true;
            if constexpr (kMasked) {
              inside = q < seq.seqlen_q && n0 + key < seq.seqlen_k;
              // (Causal spelled out: its window_right is 0, and the query's bound is one uniform
              // register; through the mask's general test the causal 128-query steps spilled.)
              if constexpr (kMask == MaskKind::kCausal)
                visible = q < seq.seqlen_q && n0 + key < seq.seqlen_k && n0 + key - q <= diagonal;
              else
                visible = q < seq.seqlen_q && AttentionMask<kMask>::visible(f, q, n0 + key, seq.seqlen_k, diagonal);
              if constexpr (Mods::kHasMask) visible = visible && !((user_hidden >> i) & 1);
            }
            // Computed for every element, then selected: a branch around the exponential would
            // keep both paths' values alive across it (the causal variant spilled).
            if constexpr (kDsFromP) {
              const float prob = exp2_approx(fmaf(s[i], scale_log2, -lse_log2[c]));
              s[i] = visible ? prob : 0.f;
            } else {
              float ds, prob;
              if constexpr (Mods::kHasScore)
                prob = modified_probability_and_ds<Mods>(s[i], lse_log2[c], dp[i], deltas[c], inside, f, batch, head, q,
                                                          n0 + key, ds);
              else
                prob = probability_and_ds<Config>(s[i], lse_log2[c], dp[i], deltas[c], true, scale_log2, softcap_scale,
                                                  f, ds);
              s[i] = visible ? prob : 0.f;
              dp[i] = visible ? ds : 0.f;
            }
          }
          if constexpr (!kDvAfterDs) keep_p(j, h);
          if constexpr (!kDsFromP) keep_ds(j, h);
        }
      }
    };
    if (needs_mask) probabilities(BoolConstant<true>{});
    else probabilities(BoolConstant<false>{});
    if constexpr (kDsFromP) {
      constexpr bool kDvUnderDs = !kSplitHeadDim && !kDvAfterDs;
      if constexpr (kDvUnderDs) issue_dv();
      wgmma_wait<kDvUnderDs ? 1 : 0>();  // dP^T (where dV's GEMM went first, it may still run)
      fence_operands(dp);
#pragma unroll
      for (int j = 0; j < kScoreQueries / 8; ++j) {
        const float2 delta2 = load_shared_pair(delta + 4 * step_query(j));  // delta scale
        const float scaled_deltas[2] = {delta2.x, delta2.y};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int i = 4 * j + 2 * h + c;
            // 0 where P is (hidden elements: dP^T is finite there, from real or zero-filled rows).
            float prob = s[i];
            if constexpr (kDsFromHalfP) {
              unsigned half_pair;  // P's pair in fp16
              if constexpr (kKeepsHalfP) half_pair = p_half[j / 2][2 * (j % 2) + h];
              else half_pair = a_p[j / 2][2 * (j % 2) + h];
              const float2 kept = unpack_f16x2(half_pair);
              prob = c == 0 ? kept.x : kept.y;
            }
            dp[i] = prob * fmaf(dp[i], f.softmax_scale, -scaled_deltas[c]);
          }
          keep_ds(j, h);
          if constexpr (kDvAfterDs) keep_p(j, h);  // P^T packed as its fp32 pair ends
        }
      }
      if constexpr (kDvAfterDs) issue_dv();
    } else if constexpr (!kSplitHeadDim) {
      issue_dv();
    }
    fence_proxy_async_shared();  // dS^T (and P^T) are read by wgmma (the async proxy) below

    // dQ, once the dS^T rows it reads are in (every consumer's; split by head dim, the other
    // consumer's P^T and dS^T columns for dK and dV too). At head dim 64 in steps of 64 or 80 one
    // consumer computes it per step; the other only arrives. Barrier ids alternate with the step
    // there, so an arrival can never complete the previous step's barrier.
    const bool computes_dq = !Shape::kDqAlternates || step % 2 == consumer;
    if constexpr (Shape::kDqAlternates) {
      if (computes_dq) named_barrier_sync(1 + step % 2, 128 * Shape::kConsumers);
      else named_barrier_arrive(1 + step % 2, 128 * Shape::kConsumers);
    } else {
      named_barrier_sync(1, 128 * Shape::kConsumers);
    }
    if constexpr (kSplitHeadDim) issue_dv();
    float dq[Shape::kDqAccumulators];
    fence_operands(dq);
    if (computes_dq) {
      if constexpr (Shape::kDqTransposed) {
        // dQ^T (this consumer's 64 columns of the head dim x the step's queries) = K^T dS^T, over the
        // keys: A the columns' panel of K (MN-major), B dS, both consumers' key panels (K-major).
        unsigned long long a_tile =
            smem_descriptor_sw128(sK + (dq_col0 / 64) * Shape::kKvPanelBytes, Shape::kKvPanelBytes, 1024);
        launder(a_tile);
        const unsigned long long b_tile = smem_descriptor_sw128(ds_tile, 16, 1024);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks)
          Config::wgmma_dq(dq, smem_descriptor_advance(a_tile, ks * 16 * 128),
                           smem_descriptor_advance(b_tile, (ks / 4) * Shape::kDsPanelBytes + (ks % 4) * 32), ks > 0);
        wgmma_commit();
      } else {
        // dQ (the step's queries, or in steps of 128 this consumer's panel of 64 of them, x its
        // columns) = dS K, over the keys: A dS^T (MN-major), B the columns' panel of K (MN-major).
        const unsigned b_start = (dq_col0 / 64) * Shape::kKvPanelBytes;
        const unsigned a_start = Shape::kDqSplitsQueries ? consumer * Shape::kDsPanelBytes : 0;
        const unsigned long long a_tile = smem_descriptor_sw128(ds_tile + a_start, Shape::kDsBytes, 1024);
        unsigned long long b_tile = smem_descriptor_sw128(sK + b_start, Shape::kKvPanelBytes, 1024);
        launder(b_tile);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kBlockN / 16; ++ks)
          Config::wgmma_dq(dq, smem_descriptor_advance(a_tile, ks * 16 * 128),
                           smem_descriptor_advance(b_tile, ks * 16 * 128), ks > 0);
        wgmma_commit();
      }
    }
    issue_key_gradient(dk, a_ds, ds_tile, sQ(stage));  // last: dQ leaves while it runs
    // Q, dO, LSE and delta of this stage are free once dK's GEMM is done.
    auto release_stage = [&] {
      wgmma_wait<0>();
      fence_operands(dk);
      fence_operands(dv);
      if constexpr (!kSplitHeadDim) fence_operands(a_ds);
      mbarrier_arrive(bar_empty(stage));
    };
    if (!computes_dq) {
      release_stage();
      if constexpr (!kSplitHeadDim) fence_operands(a_p);  // (dV's GEMM read them)
      continue;
    }
    wgmma_wait<1>();  // dV and dQ
    fence_operands(dq);
    if constexpr (!kSplitHeadDim) fence_operands(a_p);  // (free from here: dV's GEMM read them)

    if constexpr (Shape::kDqWriters) {  // to the writer warp, through shared memory (rows past the sequence too: zeros)
      mbarrier_wait(bar_dq_free, (step & 1) ^ 1);  // a fresh barrier passes parity 1
      const bool first_dq_thread =
          warp_in_group == 0 && lane == 0 && (Shape::kDqSplitsQueries ? consumer == 0 : dq_col0 == 0);
      if (Shape::kRecordsSteps && first_dq_thread) {
        if constexpr (Shape::kRanksTurns)
          asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %3};\n" ::"r"(base + Shape::kDqStepOffset), "r"(head),
                       "r"(m0), "r"(rank)
                       : "memory");
        else
          asm volatile("st.shared.v2.s32 [%0], {%1, %2};\n" ::"r"(base + Shape::kDqStepOffset), "r"(head), "r"(m0)
                       : "memory");
      }
      if constexpr (Shape::kDqTransposed) {
        // Element (j, h, e) of dQ^T is column c = dq_col0 + 16 warp_in_group + lane / 4 + 8 h of the
        // head dim, query q = 8 j + 2 (lane % 4) + e: 32-column panel c / 32, row q, 16-byte chunk
        // (c % 32) / 4 swizzled by q % 8, word c % 4. The chunk is an XOR of the lane's bits with
        // 2 h + e, so each (h, e) is one base and j a constant offset; a warp's 32 stores reach
        // 8 chunks x 4 words, every bank once. Columns past the head dim (at 96 the second
        // consumer's last 32) are whole warps, which store nothing.
        if (dq_col0 + 16 * warp_in_group < kHeadDim) {
          const unsigned lane_base =
              base + Shape::kDqOffset + ((dq_col0 + 16 * warp_in_group) / 32) * Shape::kDqPanelBytes +
              2 * (lane % 4) * 128 + (((4 * (warp_in_group % 2)) ^ (lane / 16) ^ (2 * (lane % 4))) << 4) +
              ((lane / 4) % 4) * 4;
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e)
#pragma unroll
              for (int j = 0; j < kBlockM / 8; ++j)
                asm volatile("st.shared.f32 [%0], %1;\n" ::"r"((lane_base ^ ((2 * h + e) << 4)) + (8 * j + e) * 128),
                             "f"(dq[4 * j + 2 * h + e]));
        }
      } else {
        // Pair (j, h) is row dq_row0 + warp_in_group * 16 + lane / 4 + 8 h (dq_row0 the consumer's
        // queries in steps of 128), columns dq_col0 + 8 j + 2 (lane % 4) and the next: 32-column
        // panel dq_col0 / 32 + j / 4, 16-byte chunk 2 (j % 4) + (lane % 4) / 2 of the row, swizzled
        // by the row's place in its 8-row atom (lane / 4). As for dS^T, the swizzle is an XOR with a
        // constant per j of a 1024-byte-aligned panel's address. A half-warp's rows r and r ^ 1
        // would swizzle onto the same two chunks (twice the wavefronts for one 8-byte store), so odd
        // rows store pair j ^ 2 in pass j: chunk bit 2 flipped (the address XOR 64), and the sixteen
        // lanes cover all eight chunks of their rows.
        const bool odd_row = (lane / 4) % 2;
        const int dq_row0 = Shape::kDqSplitsQueries ? consumer * 64 : 0;
        const unsigned pair_base =
            (base + Shape::kDqOffset + (dq_col0 / 32) * Shape::kDqPanelBytes + (dq_row0 + warp_in_group * 16 + lane / 4) * 128 +
             ((((lane % 4) / 2) ^ (lane / 4)) << 4) + (lane % 2) * 8) ^
            (odd_row ? 64u : 0u);
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int j = 0; j < Shape::kDqCols / 8; ++j) {
            const int mine = odd_row ? j ^ 2 : j;  // the pair this lane stores in pass j
            if (dq_group_inside(mine))
              store_shared_pair(((pair_base + (j / 4) * Shape::kDqPanelBytes) ^ ((2 * (j % 4)) << 4)) + h * 8 * 128,
                                odd_row ? dq[4 * (j ^ 2) + 2 * h] : dq[4 * j + 2 * h],
                                odd_row ? dq[4 * (j ^ 2) + 2 * h + 1] : dq[4 * j + 2 * h + 1]);
          }
      }
      fence_proxy_async_shared();  // the writer's TMA (the async proxy) reads them
      mbarrier_arrive(bar_dq_full);
      release_stage();
      continue;
    }

    // Without the writer warp (head dims 192 and 256), deterministic mode's turn is the consumers'.
    constexpr bool kConsumersTakeTurns = kOrdered && !Shape::kDqWriters;
    static_assert(!kConsumersTakeTurns || !Shape::kDqAlternates, "both consumers add each step's dQ");
    const int adder = tid - 128;
    DqTurn turn{};
    if constexpr (kConsumersTakeTurns)
      turn = take_dq_turn(step, head, m0, rank, adder, kDqTurnBarrier, Shape::kDqConsumerThreads);
    float* accum = p.dq_accum + static_cast<long long>(head) * p.workspace_rows * f.head_dim;
    // These head dims are bound by L2's reduction requests, one per row and instruction, so each
    // lane adds 16 bytes, not its 8: for groups j and j + 1 (j even) the two lanes of a pair
    // (lane ^ 1) trade one 8-byte pair, after which lane t of the quad holds columns
    // 8 (j + t % 2) + 4 (t / 2) .. + 3, and the quad covers 64 contiguous bytes of its row: half the
    // requests. (The shuffles come first, on every lane: rows past the sequence skip the adds only.)
    // Head dims are multiples of 8, so a 4-column chunk is inside the head dim or past it whole.
    const bool odd_lane = lane % 2;
    const int chunk_col0 = dq_col0 + 8 * odd_lane + 4 * ((lane % 4) / 2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + warp_in_group * 16 + lane / 4 + h * 8;
      const bool row_inside = row < seq.seqlen_q;
      float* accum_row = accum + static_cast<long long>(workspace_row(f, seq, batch, row)) * f.head_dim + chunk_col0;
#pragma unroll
      for (int j = 0; j < Shape::kDqCols / 8; j += 2) {
        // (Selected by value: an index that depends on the lane would put dq in local memory.)
        const float a0 = dq[4 * j + 2 * h], a1 = dq[4 * j + 2 * h + 1];
        const float b0 = dq[4 * (j + 1) + 2 * h], b1 = dq[4 * (j + 1) + 2 * h + 1];
        const float got0 = __shfl_xor_sync(0xffffffffu, odd_lane ? a0 : b0, 1);
        const float got1 = __shfl_xor_sync(0xffffffffu, odd_lane ? a1 : b1, 1);
        const float4 chunk = odd_lane ? make_float4(got0, got1, b0, b1) : make_float4(a0, a1, got0, got1);
        // (Where the head dim is the kernel's, no column needs a bounds check: the adds share one
        // address register at constant offsets.)
        const bool inside = full_width ? dq_group_inside(j + odd_lane) : chunk_col0 + j * 8 < f.head_dim;
        if (row_inside && inside) atomic_add_quad(accum_row + j * 8, chunk);
      }
    }
    if constexpr (kConsumersTakeTurns) end_dq_turn(turn, adder, kDqTurnBarrier, Shape::kDqConsumerThreads);
    release_stage();
  }

  // Epilogue: dK and dV straight from the registers (4-byte pairs). Keys no query sees get zeros. A
  // continuing spec adds them to its fp32 running sums (8-byte pairs; the CTA owns its keys' rows),
  // which leave as dK and dV on the last step.
  if constexpr (ContinuesOf<Config>::value) {
    const long long state_offset = (f.cu_seqlens_k != nullptr ? 0 : batch * p.dkv_state_batch_stride) +
                                   (seq.k_start + n0) * p.dkv_state_row_stride + kv_head * p.dkv_state_head_stride;
    float* sDk = p.dk_state + state_offset;
    float* sDv = p.dv_state + state_offset;
    const long long dk_batch = f.cu_seqlens_k != nullptr ? 0 : batch * p.dk_batch_stride;
    const long long dv_batch = f.cu_seqlens_k != nullptr ? 0 : batch * p.dv_batch_stride;
    Element* gDk = static_cast<Element*>(p.dk) + dk_batch + (seq.k_start + n0) * p.dk_row_stride + kv_head * p.dk_head_stride;
    Element* gDv = static_cast<Element*>(p.dv) + dv_batch + (seq.k_start + n0) * p.dv_row_stride + kv_head * p.dv_head_stride;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = key_row0 + lane / 4 + h * 8;
      if (n0 + key >= seq.seqlen_k) continue;
#pragma unroll
      for (int j = 0; j < kGradCols / 8; ++j) {
        const int col = consumer_cols + j * 8 + (lane % 4) * 2;
        if (col >= f.head_dim) continue;
        float2* k_state = reinterpret_cast<float2*>(sDk + key * p.dkv_state_row_stride + col);
        float2* v_state = reinterpret_cast<float2*>(sDv + key * p.dkv_state_row_stride + col);
        const float2 k_sum = make_float2(k_state->x + dk[4 * j + 2 * h], k_state->y + dk[4 * j + 2 * h + 1]);
        const float2 v_sum = make_float2(v_state->x + dv[4 * j + 2 * h], v_state->y + dv[4 * j + 2 * h + 1]);
        if (p.gradients_final) {
          *reinterpret_cast<unsigned*>(gDk + key * p.dk_row_stride + col) = pack2<Element>(k_sum.x, k_sum.y);
          *reinterpret_cast<unsigned*>(gDv + key * p.dv_row_stride + col) = pack2<Element>(v_sum.x, v_sum.y);
        } else {
          *k_state = k_sum;
          *v_state = v_sum;
        }
      }
    }
    return;
  }
  const long long dk_batch = f.cu_seqlens_k != nullptr ? 0 : batch * p.dk_batch_stride;
  const long long dv_batch = f.cu_seqlens_k != nullptr ? 0 : batch * p.dv_batch_stride;
  Element* gDk = static_cast<Element*>(p.dk) + dk_batch + (seq.k_start + n0) * p.dk_row_stride + kv_head * p.dk_head_stride;
  Element* gDv = static_cast<Element*>(p.dv) + dv_batch + (seq.k_start + n0) * p.dv_row_stride + kv_head * p.dv_head_stride;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key_row0 + lane / 4 + h * 8;
    if (n0 + key >= seq.seqlen_k) continue;
#pragma unroll
    for (int j = 0; j < kGradCols / 8; ++j) {
      const int col = consumer_cols + j * 8 + (lane % 4) * 2;
      if (col >= f.head_dim) continue;
      *reinterpret_cast<unsigned*>(gDk + key * p.dk_row_stride + col) = pack2<Element>(dk[4 * j + 2 * h], dk[4 * j + 2 * h + 1]);
      *reinterpret_cast<unsigned*>(gDv + key * p.dv_row_stride + col) = pack2<Element>(dv[4 * j + 2 * h], dv[4 * j + 2 * h + 1]);
    }
  }
}

}  // namespace flashjit::kernels
