// Kernel arguments shared verbatim by the host (runtime/ includes this file) and the device
// families, so their layout cannot drift. Plain C++ only: no CUDA keywords, no toolkit headers.
#pragma once

namespace flashjit {

// One side of a block mask in FlexAttention's format, int32. Rows are the blocks of the side a
// CTA walks from (query blocks in the forward, key blocks in the backward), columns those of the
// other side: per row block, the count and the ascending list of the column blocks it partly sees
// (the mask modifier decides per element) and of those it fully sees (no element mask). Counts are
// (batch, heads, rows) and lists (batch, heads, rows, list_capacity); batch and heads may be 1
// (stride 0) to share one mask. A kernel tile of the column side covers part of a block: the
// block's tiles_per_block tiles are walked in turn. Ids outside [0, num_column_blocks) contribute
// nothing.
struct BlockSparseParams {
  const int* num_blocks;  // null: no block mask
  const int* indices;
  const int* full_num_blocks;  // null: no fully visible blocks
  const int* full_indices;
  long long num_batch_stride, num_head_stride;  // of num_blocks (rows contiguous)
  long long full_num_batch_stride, full_num_head_stride;
  long long indices_batch_stride, indices_head_stride, indices_row_stride;  // of indices (ids contiguous)
  long long full_indices_batch_stride, full_indices_head_stride, full_indices_row_stride;
  int row_block_size, column_block_size;
  int tiles_per_block;    // column_block_size / the kernel's tile along the columns
  int num_column_blocks;  // ceil(column length / column_block_size)
  int list_capacity;      // ids per list row
};

// Forward attention, all families. Tensors are (batch, seqlen, heads, head_dim) in any stride order
// with the last dim contiguous; strides are in elements. With cu_seqlens_q/k (varlen), sequences
// are packed along the seqlen dim, batch strides are unused and seqlen_q/k hold the maximum length.
struct AttentionFwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;                // (batch, heads_q, seqlen_q) or, varlen, (heads_q, total_q); may be null
  const int* cu_seqlens_q;   // (batch + 1) prefix sums, or null
  const int* cu_seqlens_k;
  // Varlen only, optional: sequence b's rows are [cu_seqlens[b], cu_seqlens[b] + seqused[b]).
  const int* seqused_q;
  const int* seqused_k;

  long long q_batch_stride, q_row_stride, q_head_stride;
  long long k_batch_stride, k_row_stride, k_head_stride;
  long long v_batch_stride, v_row_stride, v_head_stride;
  long long o_batch_stride, o_row_stride, o_head_stride;
  long long lse_batch_stride, lse_head_stride;  // rows of one head are contiguous

  int batch;
  int num_heads_q;
  int num_heads_kv;  // num_heads_q is a multiple of it (GQA / MQA)
  int head_dim;      // the problem's; the kernel's kHeadDim may be larger (rounded up)
  int seqlen_q;
  int seqlen_k;
  // Keys visible to query row i: [i + seqlen_k - seqlen_q - window_left,
  //                                i + seqlen_k - seqlen_q + window_right]; < 0 means unbounded.
  int window_left;
  int window_right;
  float softmax_scale;       // multiplies QK^T
  float softcap;             // > 0: scores become softcap * tanh(scores / softcap)
  // A user modifier's side tensors, in its declared order (read-only, flat), and the block mask by
  // query block (rows: query blocks, columns: key blocks): read only by specs that render them.
  const void* modifier_tensors[8];
  BlockSparseParams block_mask;
  // A continuing forward's running result (specs that continue: ring attention's steps), read only
  // by those specs: O so far, normalised, fp32, head_dim values per LSE entry and laid out as the
  // LSE is (state_o[lse index * head_dim + column]), and lse itself as the running LSE (-inf: no key
  // yet). With state_read the rows merge into it (else they start it). Rows [state_final_begin,
  // state_final_end) end there: they write o, normalised, and the final LSE; the others the state.
  float* state_o;
  int state_read;
  int state_final_begin, state_final_end;
};

// A CUtensorMap as the kernels see it (cuda.h stays out of this file): built on the host by
// cuTensorMapEncodeTiled and copied in, passed inside a __grid_constant__ parameter.
struct alignas(64) TmaDescriptor {
  unsigned long long opaque[16];
};

// One FP8 tensor's dequantisation factors, (batch, heads_kv) at these strides (0 shares one).
struct Fp8Descale {
  const float* data;  // null: 1
  long long batch_stride, head_stride;
};

// Hopper forward (sm90_fwd): the forward's arguments plus TMA maps of q, k, v and o, each a 4-D tensor
// (head_dim, seqlen, heads, batch) with 128-byte-wide, 128-byte-swizzled boxes (64 16-bit values, or
// 128 FP8 ones).
// The kernel is persistent: its work tiles are (query block, head, batch), num_m_blocks of
// kBlockM rows per sequence (the longest, when varlen), ordered in sections of `section_pairs`
// (batch, head) pairs whose K/V share the L2. Work items are the tiles, the last num_split_tiles
// each replaced by `splits` items (below). Each CTA starts with item blockIdx.x and then takes
// gridDim.x + atomicAdd(tile_counter, 1): the counter must be zero at launch. Null: launched with
// a CTA per work item, each takes its blockIdx.x alone.
struct AttentionSm90FwdParams {
  TmaDescriptor q_map;
  TmaDescriptor k_map;
  TmaDescriptor v_map;
  TmaDescriptor o_map;  // boxes of 64 rows; used where o_via_tma
  AttentionFwdParams fwd;
  int num_m_blocks;
  int section_pairs;
  int* tile_counter;
  // Nonzero: O may leave through shared memory and TMA stores of o_map. Not with varlen, where the
  // map clips rows only at the packed tensor's end, not at each sequence's.
  int o_via_tma;
  // Tail splits: the schedule's last `num_split_tiles` work tiles run as `splits` work items each,
  // item c over the c-th of `splits` contiguous shares of the tile's key blocks (so the last round
  // of tiles does not leave most CTAs idle). An item writes its unnormalised O and row statistics
  // to `split_output` and `split_row_stats` (fp32, float4 per thread); the warp that completes a
  // tile's count of its rows in `split_counters` (one per 16 rows of a split tile, zero at launch)
  // merges the items in item order and stores the output.
  int num_split_tiles;
  int splits;
  float* split_output;
  float* split_row_stats;
  int* split_counters;
  // FP8 (e4m3) specs: dequantisation factors (FlashAttention-3's q/k/v_descale), float32 per (batch,
  // KV head): the scores are (Q K^T) q_descale k_descale and O is (P V) v_descale. Null: 1.
  Fp8Descale q_descale, k_descale, v_descale;
  // FP8 specs with v_pretransposed: V^T, written by the transpose_v entry before the forward and
  // read through vt_map (a (batch, heads_kv, head_dim, columns) tensor, columns contiguous and
  // 128-key boxes of head_dim rows). Within each 16 keys column 4 t + i holds key 2 t + (i & 1) +
  // 8 (i >> 1), as in the shared-memory transpose. Columns: keys, rounded up to 16; varlen packs the
  // sequences with 16 columns of room each (sequence b starts at column cu_seqlens_k[b] + 16 b).
  TmaDescriptor vt_map;
  unsigned char* vt;
  long long vt_row_stride, vt_head_stride, vt_batch_stride;
};

// Backward attention (fa2_bwd). `fwd` holds the forward's inputs and options: q, k, v, o, the
// forward's lse (required), sequence and mask fields. Gradients have the layout rules of the
// tensors they belong to. The workspaces are fp32 and indexed by a flat query row: batch *
// seqlen_q + row, or the packed row when varlen (`workspace_rows` of them per head).
// Query rows per CTA of the backward's row passes (preprocess, convert_dq); the host sizes their
// grids with it.
constexpr int kBwdRowPassRows = 64;

struct AttentionBwdParams {
  AttentionFwdParams fwd;
  const void* d_o;
  void* dq;
  void* dk;
  void* dv;
  float* delta;     // (heads_q, workspace_rows): rowsum(dO * O), written by the preprocess entry
  float* dq_accum;  // (heads_q, workspace_rows, head_dim): atomic dQ sums, or null (fa2_bwd's deterministic mode)
  // sm90_bwd's deterministic mode (ordered_dq specs), else null: one counter per (query head, query
  // block), zeroed before the launch, that orders the key tiles' adds to the block's dQ rows (in the
  // order DqAddOrder in sm90_bwd.cuh sets). The block of (batch, row) is workspace_row / block_m +
  // batch (unique: a sequence's rows start a new block), dq_order_head_stride counters a head.
  int* dq_order;
  int dq_order_head_stride;

  long long do_batch_stride, do_row_stride, do_head_stride;
  long long dq_batch_stride, dq_row_stride, dq_head_stride;
  long long dk_batch_stride, dk_row_stride, dk_head_stride;
  long long dv_batch_stride, dv_row_stride, dv_head_stride;
  int workspace_rows;
  // The block mask by key block (FlexAttention's q_num_blocks/q_indices lists: rows are key blocks,
  // columns query blocks), for block-sparse specs.
  BlockSparseParams transposed_block_mask;
  // A continuing backward (specs that continue: ring attention's steps), read only by those specs:
  // this call's dQ, dK and dV add to fp32 running sums (batch, rows, heads, head_dim), laid out with
  // the strides below (dk_state and dv_state share theirs) and zeroed before the first step; on the
  // last step (gradients_final) the sums leave as dq, dk and dv in the output dtype instead.
  float* dq_state;
  float* dk_state;
  float* dv_state;
  long long dq_state_batch_stride, dq_state_row_stride, dq_state_head_stride;
  long long dkv_state_batch_stride, dkv_state_row_stride, dkv_state_head_stride;
  int gradients_final;
  // Deterministic mode under a block mask, beside each dq_order counter: which key tiles visit the
  // block, a bit per key tile in dq_visit_words words (built by sm90_bwd's dq_visits entry from the
  // transposed lists the key tiles walk); a tile's turn at the block is its rank among them. Else
  // null. (Last: the fields before it keep their offsets in the kernels' parameter space.)
  unsigned* dq_visits;
  int dq_visit_words;
};

// Backward attention (sm90_bwd): TMA maps of q, k, v and dO (laid out as the forward's maps, with
// block_m-row boxes for q and dO and block_n-row boxes for k and v) beside fa2_bwd's arguments.
struct AttentionSm90BwdParams {
  TmaDescriptor q_map;
  TmaDescriptor k_map;
  TmaDescriptor v_map;
  TmaDescriptor do_map;
  TmaDescriptor dq_accum_map;  // the fp32 dQ accumulator (head_dim, workspace rows, query heads), for TMA adds
  AttentionBwdParams bwd;
};


// Attention over a KV cache (kvcache_fwd). `fwd` holds q, o, lse and the options; its k and v are
// the caches, with k/v_row_stride the stride between a page's tokens (a contiguous cache's between
// its tokens) and k/v_head_stride between heads; seqlen_q is this call's query tokens and seqlen_k
// the cache's capacity per sequence. A paged cache is (num_pages, page_size, heads_kv, head_dim)
// addressed through block_table (batch, max_pages) of page ids; a contiguous one is one page per
// sequence (block_table null, k/v_page_stride its batch stride). Sequence b holds cache_seqlens[b]
// tokens before this call (null: capacity - seqlen_new), and k_new/v_new (batch, seqlen_new,
// heads_kv, head_dim) are appended after them; attention covers both, bottom-right aligned.
struct AttentionKvCacheParams {
  // The attention_tma entry (sm_90) reads K and V through TMA maps (64 values, rows, head_dim / 64
  // panels, heads_kv, pages), 128-byte swizzled, each box kv_tma_rows rows of every panel: the key
  // tile or, for smaller pages, the page (a contiguous cache is one page of `capacity` rows per
  // sequence).
  TmaDescriptor k_map;
  TmaDescriptor v_map;
  int kv_tma_rows;
  AttentionFwdParams fwd;
  const int* cache_seqlens;
  const int* block_table;  // null: contiguous
  long long block_table_batch_stride;
  int page_size;           // tokens per page (contiguous: the capacity)
  // pos / page_size as (umulhi(pos, magic) >> shift) for pos < 2^31 (magic 0: page_size 1).
  unsigned page_size_magic;
  int page_size_shift;
  int num_pages;           // page ids must lie in [0, num_pages)
  int capacity;            // tokens one sequence can hold: page_size * max_pages, or the cache's rows
  long long k_page_stride, v_page_stride;
  const void* k_new;
  const void* v_new;
  long long k_new_batch_stride, k_new_row_stride, k_new_head_stride;
  long long v_new_batch_stride, v_new_row_stride, v_new_head_stride;
  int seqlen_new;
  // Key-range splits (flash-decoding). With more than one, split c of a row writes its normalised O
  // and LSE to partial_o (num_splits, batch, heads_q, seqlen_q, kernel head_dim) and partial_lse
  // (num_splits, batch, heads_q, seqlen_q), fp32, and the combine entry merges them; or, with
  // merge_in_cluster (sm_90), the splits of a row are one thread-block cluster and merge through
  // each other's shared memory (no partials, no combine).
  int num_splits;
  int merge_in_cluster;
  float* partial_o;
  float* partial_lse;
};

// Building a block mask (block_mask family). The classify entry evaluates the mask modifier on
// every element of each (query block, key block) tile, kBlockM x kBlockN, and writes its state to
// tile_map (batch, heads, q_blocks, kv_blocks), uint8: 0 empty, 1 partly visible, 2 fully visible.
// The rows entry turns each map row into FlexAttention's kv lists (ascending ids), the columns
// entry each map column into the q lists (the backward's); all lists are int32, contiguous:
// counts (batch, heads, blocks) and ids (batch, heads, blocks, the other side's block count).
// `fwd` gives the extents (batch, num_heads_q as the mask's heads, seqlen_q, seqlen_k) and the
// modifier's side tensors.
struct BlockMaskParams {
  AttentionFwdParams fwd;
  unsigned char* tile_map;
  int q_blocks, kv_blocks;
  int* kv_num_blocks;
  int* kv_indices;
  int* full_kv_num_blocks;
  int* full_kv_indices;
  int* q_num_blocks;  // null: no q lists
  int* q_indices;
  int* full_q_num_blocks;
  int* full_q_indices;
};
constexpr int kTilePartial = 1;
constexpr int kTileFull = 2;

// What a kvcache_fwd kernel records in its module's flashjit_kvcache_status {code, batch, index,
// value} the first time a call's device-side data is out of range.
constexpr int kKvCacheSeqlenOutOfRange = 1;  // index: cache_seqlens[batch]; value: the most it may be
constexpr int kKvCachePageOutOfRange = 2;    // index: the block_table column; value: the page id read

}  // namespace flashjit
