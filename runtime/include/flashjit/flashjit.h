/* flashjit's C API: the C++ Runtime::global() behind status codes and a thread-local message.
 * Every function returns FLASHJIT_OK or an error status; flashjit_last_error() then says why. */
#ifndef FLASHJIT_FLASHJIT_H
#define FLASHJIT_FLASHJIT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum flashjit_status {
  FLASHJIT_OK = 0,
  FLASHJIT_ERROR_INVALID_ARGUMENT = 1,
  FLASHJIT_ERROR_UNSUPPORTED = 2,
  FLASHJIT_ERROR_COMPILE_FAILED = 3,
  FLASHJIT_ERROR_NO_DRIVER = 4,
  FLASHJIT_ERROR_CUDA = 5,
  FLASHJIT_ERROR_CACHE = 6,
  FLASHJIT_ERROR_IO = 7,
  FLASHJIT_ERROR_OUT_OF_RESOURCES = 8,
  FLASHJIT_ERROR_INTERNAL = 9
} flashjit_status;

typedef enum flashjit_dtype {
  FLASHJIT_FLOAT16 = 0,
  FLASHJIT_BFLOAT16 = 1,
  FLASHJIT_FLOAT32 = 2,
  FLASHJIT_INT32 = 3,
  FLASHJIT_INT64 = 4,
  FLASHJIT_UINT8 = 5,
  FLASHJIT_FLOAT8_E4M3 = 6 /* PyTorch's float8_e4m3fn: FP8 forward inputs (flashjit_forward_fp8) */
} flashjit_dtype;

typedef enum flashjit_backend {
  FLASHJIT_BACKEND_AUTO = 0,
  FLASHJIT_BACKEND_REFERENCE = 1,
  FLASHJIT_BACKEND_FA2 = 2,
  FLASHJIT_BACKEND_SM90 = 3 /* Hopper family (TMA, wgmma); auto picks it on sm_90 when TMA can read q, k, v */
} flashjit_backend;

/* A strided view of device memory; strides in elements. An empty tensor (an extent of 0) may have
 * data NULL, as PyTorch's do: a call whose outputs are empty returns at once. The kernels read 16
 * bytes at a time, so q, k, v and the outputs need a 16-byte aligned data pointer, a contiguous last
 * dim and other strides in multiples of 8 elements; other views are refused by name (the Python
 * package copies them first). */
typedef struct flashjit_tensor {
  void* data;
  int32_t dtype; /* flashjit_dtype */
  int32_t device;
  int32_t rank;
  int64_t shape[4];
  int64_t strides[4];
} flashjit_tensor;

typedef struct flashjit_attention_options {
  float softmax_scale; /* <= 0 or NaN: 1 / sqrt(head_dim) */
  int32_t causal;
  int32_t window_left; /* -1: unbounded (so is a side past seqlen_q + seqlen_k) */
  int32_t window_right;
  float softcap;       /* 0: off */
  int32_t backend;     /* flashjit_backend */
  void* stream;        /* CUstream, NULL = legacy default stream */
  int32_t deterministic; /* backward: bitwise-reproducible dQ (slower) */
  int32_t sm_margin;     /* forward on sm_90: SMs the persistent kernel leaves free */
  int32_t num_splits;    /* forward on sm_90: tail splits, 0 chosen, 1 none (AttentionOptions) */
  int32_t prepare_backward; /* forward: compile the backward's kernels beside it (autograd; AttentionOptions) */
} flashjit_attention_options;

/* Fills the defaults: no mask, no softcap, automatic backend, default scale and stream. */
void flashjit_attention_options_init(flashjit_attention_options* options);

/* See flashjit::Runtime::forward. lse may be NULL. */
flashjit_status flashjit_forward(const flashjit_tensor* q, const flashjit_tensor* k,
                                 const flashjit_tensor* v, const flashjit_tensor* out,
                                 const flashjit_tensor* lse,
                                 const flashjit_attention_options* options);

/* FP8 forward (sm_90): q, k, v FLASHJIT_FLOAT8_E4M3, out bfloat16, lse optional; q_descale,
 * k_descale, v_descale float32 (batch, heads_kv) or NULL (1), see AttentionOptions::q_descale.
 * cu_seqlens_q NULL: a fixed-length batch (4-D tensors, as flashjit_forward); else varlen (3-D, as
 * flashjit_forward_varlen, with cu_seqlens_k and the max lengths). */
flashjit_status flashjit_forward_fp8(const flashjit_tensor* q, const flashjit_tensor* k, const flashjit_tensor* v,
                                     const flashjit_tensor* out, const flashjit_tensor* lse,
                                     const flashjit_tensor* q_descale, const flashjit_tensor* k_descale,
                                     const flashjit_tensor* v_descale, const flashjit_tensor* cu_seqlens_q,
                                     const flashjit_tensor* cu_seqlens_k, int32_t max_seqlen_q, int32_t max_seqlen_k,
                                     const flashjit_attention_options* options);

/* See flashjit::Runtime::forward_varlen. */
flashjit_status flashjit_forward_varlen(const flashjit_tensor* q, const flashjit_tensor* k,
                                        const flashjit_tensor* v, const flashjit_tensor* out,
                                        const flashjit_tensor* lse,
                                        const flashjit_tensor* cu_seqlens_q,
                                        const flashjit_tensor* cu_seqlens_k, int32_t max_seqlen_q,
                                        int32_t max_seqlen_k,
                                        const flashjit_attention_options* options);

/* See flashjit::Runtime::forward_kvcache: q (batch, seqlen_q, heads_q, head_dim) over a contiguous
 * (batch, seqlen_cache, heads_kv, head_dim) or paged (num_pages, page_size, heads_kv, head_dim) cache.
 * block_table (int32 (batch, max_pages_per_seq): paged), cache_seqlens (int32 (batch)), k_new and
 * v_new (batch, seqlen_new, heads_kv, head_dim: appended at cache_seqlens) and lse may be NULL.
 * options->num_splits: key splits, 0 chosen. */
flashjit_status flashjit_forward_kvcache(const flashjit_tensor* q, const flashjit_tensor* k_cache,
                                         const flashjit_tensor* v_cache, const flashjit_tensor* block_table,
                                         const flashjit_tensor* cache_seqlens, const flashjit_tensor* k_new,
                                         const flashjit_tensor* v_new, const flashjit_tensor* out,
                                         const flashjit_tensor* lse, const flashjit_attention_options* options);

/* See flashjit::Runtime::check_kvcache: waits for `stream` (a CUstream, NULL = legacy) and reports
 * (FLASHJIT_ERROR_INVALID_ARGUMENT) the first device-side fault of the kvcache calls since the last check. */
flashjit_status flashjit_check_kvcache(void* stream);

/* See flashjit::Runtime::backward. lse (the forward's) is required; options must be the forward's. */
flashjit_status flashjit_backward(const flashjit_tensor* q, const flashjit_tensor* k,
                                  const flashjit_tensor* v, const flashjit_tensor* out,
                                  const flashjit_tensor* dout, const flashjit_tensor* lse,
                                  const flashjit_tensor* dq, const flashjit_tensor* dk,
                                  const flashjit_tensor* dv, const flashjit_attention_options* options);

/* See flashjit::Runtime::backward_varlen. */
flashjit_status flashjit_backward_varlen(const flashjit_tensor* q, const flashjit_tensor* k,
                                         const flashjit_tensor* v, const flashjit_tensor* out,
                                         const flashjit_tensor* dout, const flashjit_tensor* lse,
                                         const flashjit_tensor* dq, const flashjit_tensor* dk,
                                         const flashjit_tensor* dv, const flashjit_tensor* cu_seqlens_q,
                                         const flashjit_tensor* cu_seqlens_k, int32_t max_seqlen_q,
                                         int32_t max_seqlen_k, const flashjit_attention_options* options);

/* A user modifier (flashjit::AttentionModifier): mask_body is the body of
 * bool mask(int batch, int head, int q_idx, int kv_idx), score_body of
 * float score(float score, int batch, int head, int q_idx, int kv_idx), score_grad_body (for the
 * backward; NULL or "": derived from score_body) of its derivative with respect to score, same
 * parameters (any body may be NULL or "", but not both mask and score); the side tensors they read
 * are named by tensor_names, with dtypes FLASHJIT_INT32, FLASHJIT_INT64 or FLASHJIT_FLOAT32.
 * Nothing compiles here: the first call with it does. */
typedef struct flashjit_modifier flashjit_modifier;
flashjit_status flashjit_modifier_create(const char* mask_body, const char* score_body, const char* score_grad_body,
                                         int32_t num_tensors, const char* const* tensor_names,
                                         const int32_t* tensor_dtypes, flashjit_modifier** out);
void flashjit_modifier_destroy(flashjit_modifier* modifier);

/* FlexAttention's BlockMask arrays (see flashjit::BlockMask); full_* and q_* (the backward's
 * transposes) with data NULL: none. */
typedef struct flashjit_block_mask {
  flashjit_tensor kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices;
  flashjit_tensor q_num_blocks, q_indices, full_q_num_blocks, full_q_indices;
  int32_t q_block_size, kv_block_size;
} flashjit_block_mask;

/* flashjit_forward with a modifier (and its num_mod_tensors side tensors, in its order) and a block
 * mask; modifier and block_mask may each be NULL. */
flashjit_status flashjit_forward_mod(const flashjit_tensor* q, const flashjit_tensor* k, const flashjit_tensor* v,
                                     const flashjit_tensor* out, const flashjit_tensor* lse,
                                     const flashjit_modifier* modifier, const flashjit_tensor* mod_tensors,
                                     int32_t num_mod_tensors, const flashjit_block_mask* block_mask,
                                     const flashjit_attention_options* options);

/* flashjit_backward of a flashjit_forward_mod call: the same modifier, side tensors and block mask
 * (whose q_num_blocks and q_indices it needs). */
flashjit_status flashjit_backward_mod(const flashjit_tensor* q, const flashjit_tensor* k, const flashjit_tensor* v,
                                      const flashjit_tensor* out, const flashjit_tensor* dout,
                                      const flashjit_tensor* lse, const flashjit_tensor* dq, const flashjit_tensor* dk,
                                      const flashjit_tensor* dv, const flashjit_modifier* modifier,
                                      const flashjit_tensor* mod_tensors, int32_t num_mod_tensors,
                                      const flashjit_block_mask* block_mask, const flashjit_attention_options* options);

/* Where a block mask is built (see flashjit::BlockMaskBuffers); q_* with data NULL: not built. */
typedef struct flashjit_block_mask_buffers {
  flashjit_tensor kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices;
  flashjit_tensor q_num_blocks, q_indices, full_q_num_blocks, full_q_indices;
  int32_t q_block_size, kv_block_size;
} flashjit_block_mask_buffers;

/* See flashjit::Runtime::create_block_mask and block_mask_from_tiles; stream: a CUstream, NULL = legacy. */
flashjit_status flashjit_create_block_mask(const flashjit_modifier* modifier, const flashjit_tensor* mod_tensors,
                                           int32_t num_mod_tensors, int64_t batch, int64_t heads, int64_t seqlen_q,
                                           int64_t seqlen_k, const flashjit_block_mask_buffers* out, void* stream);
flashjit_status flashjit_block_mask_from_tiles(const flashjit_tensor* tile_map, int64_t seqlen_q, int64_t seqlen_k,
                                               const flashjit_block_mask_buffers* out, void* stream);

/* Ring attention's forward (flashjit/ring.hpp): this rank's shards q, out (batch, shard rows, heads_q,
 * head_dim), k, v (batch, shard rows, heads_kv, head_dim), lse (float32 (batch, heads_q, shard rows))
 * or NULL. */
typedef struct flashjit_ring_options {
  int32_t layout;       /* 0: contiguous, 1: zigzag */
  int32_t causal;
  float softmax_scale;  /* <= 0 or NaN: 1 / sqrt(head_dim) */
  float softcap;        /* 0: off */
  int32_t backend;      /* flashjit_backend */
  int32_t sm_margin;    /* SMs the attention kernels leave free (for NCCL's kernels) */
  int32_t check_shapes; /* exchange a header and refuse shards that differ between ranks */
  void* stream;         /* CUstream, NULL = legacy default stream */
  int32_t window_left;  /* a sliding window over the sequence's positions, -1: unbounded */
  int32_t window_right;
  /* Varlen shards: the packed sequences' whole lengths (num_seqlens of them), q, k, v, out then
   * (total shard rows, heads, head_dim) and lse (heads_q, total shard rows); NULL: dense shards. */
  const int64_t* seqlens;
  int32_t num_seqlens;
} flashjit_ring_options;

/* Fills the defaults: zigzag, not causal, no window, default scale, shapes checked, the legacy stream. */
void flashjit_ring_options_init(flashjit_ring_options* options);

/* NCCL (dlopened): a new 128-byte unique id, on one rank, shared with the others by the caller. */
flashjit_status flashjit_nccl_unique_id(char* id_128_bytes);

/* A ring transport: NCCL from a unique id (every rank of the ring calls it at once). */
typedef struct flashjit_ring_transport flashjit_ring_transport;
flashjit_status flashjit_ring_transport_nccl(const char* id_128_bytes, int32_t rank, int32_t world,
                                             flashjit_ring_transport** out);
void flashjit_ring_transport_destroy(flashjit_ring_transport* transport);

flashjit_status flashjit_ring_forward(flashjit_ring_transport* transport, const flashjit_tensor* q,
                                      const flashjit_tensor* k, const flashjit_tensor* v, const flashjit_tensor* out,
                                      const flashjit_tensor* lse, const flashjit_ring_options* options);

/* The same over `world` virtual ranks on one GPU (flashjit::ring::LocalRing): arrays of `world` shards
 * each (lse NULL, or entries with data NULL: none); streams: `world` CUstreams, one per rank, or NULL
 * (every rank on options->stream). Returns when every rank has queued its work. */
flashjit_status flashjit_ring_forward_local(int32_t world, const flashjit_tensor* q, const flashjit_tensor* k,
                                            const flashjit_tensor* v, const flashjit_tensor* out,
                                            const flashjit_tensor* lse, void* const* streams,
                                            const flashjit_ring_options* options);

/* Ring attention's backward (flashjit::ring::backward): out and lse (required) the forward's, dout like
 * out, dq, dk, dv like q, k, v; and the same over `world` virtual ranks on one GPU (arrays of `world`
 * shards each; streams as in flashjit_ring_forward_local). */
flashjit_status flashjit_ring_backward(flashjit_ring_transport* transport, const flashjit_tensor* q,
                                       const flashjit_tensor* k, const flashjit_tensor* v, const flashjit_tensor* out,
                                       const flashjit_tensor* dout, const flashjit_tensor* lse, const flashjit_tensor* dq,
                                       const flashjit_tensor* dk, const flashjit_tensor* dv,
                                       const flashjit_ring_options* options);
flashjit_status flashjit_ring_backward_local(int32_t world, const flashjit_tensor* q, const flashjit_tensor* k,
                                             const flashjit_tensor* v, const flashjit_tensor* out,
                                             const flashjit_tensor* dout, const flashjit_tensor* lse,
                                             const flashjit_tensor* dq, const flashjit_tensor* dk,
                                             const flashjit_tensor* dv, void* const* streams,
                                             const flashjit_ring_options* options);

/* Replaces the global runtime's user tuning database (see flashjit/tuning.hpp) with the JSON file
 * at path; the previous one stays on error. */
flashjit_status flashjit_load_tuning_db(const char* path);

/* Counters of the global runtime's kernel cache (any pointer may be NULL). */
flashjit_status flashjit_cache_stats(uint64_t* memory_hits, uint64_t* disk_hits, uint64_t* compiles);

/* The message of the last failed call on this thread ("" if none). Valid until the next call. */
const char* flashjit_last_error(void);

const char* flashjit_version(void);

#ifdef __cplusplus
}
#endif

#endif /* FLASHJIT_FLASHJIT_H */
