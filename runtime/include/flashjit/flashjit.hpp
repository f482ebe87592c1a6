// flashjit's C++ API: FlashAttention over framework-free tensor views, compiled just in time.
//
//   flashjit::Runtime& rt = flashjit::Runtime::global();
//   rt.forward(q, k, v, out, &lse, {.causal = true, .stream = stream});
//
// Tensors are (batch, seqlen, heads, head_dim) with any strides whose last dim is contiguous; the
// first call for a new kernel spec compiles it (or loads it from the disk cache), later calls only
// launch. Errors are flashjit::Error with a message naming the argument at fault.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "flashjit/codegen/kernel_spec.hpp"
#include "flashjit/device.hpp"
#include "flashjit/error.hpp"
#include "flashjit/kernel_cache.hpp"
#include "flashjit/tuning.hpp"

namespace flashjit {

// float8_e4m3: PyTorch's float8_e4m3fn (FP8 forward inputs).
enum class ScalarType { float16, bfloat16, float32, int32, int64, uint8, float8_e4m3 };
const char* to_string(ScalarType t);
int element_size(ScalarType t);

struct TensorView {
  void* data = nullptr;
  ScalarType dtype = ScalarType::bfloat16;
  int device = 0;  // CUDA ordinal the memory lives on
  int rank = 0;
  int64_t shape[4] = {0, 0, 0, 0};
  int64_t strides[4] = {0, 0, 0, 0};  // in elements

  // A row-major contiguous view of `shape` (rank 1 to 4).
  static TensorView contiguous(void* data, ScalarType dtype, std::initializer_list<int64_t> shape,
                               int device = 0);
  // A (batch, seqlen, heads, head_dim) view of memory stored head-major, as (batch, heads, seqlen,
  // head_dim) contiguous: PyTorch SDPA's layout seen in flashjit's dimension order.
  static TensorView head_major(void* data, ScalarType dtype, int64_t batch, int64_t seqlen, int64_t heads,
                               int64_t head_dim, int device = 0);
  int64_t numel() const;
};

// A user modifier (flashjit/codegen/modifier.hpp: mask and score functions as CUDA C++ bodies)
// with its side tensors, one per code->tensors entry in that order: on the q's device, contiguous,
// of the declared type (int32, int64 or float32), read as flat arrays.
struct AttentionMod {
  std::shared_ptr<const AttentionModifier> code;
  std::vector<TensorView> tensors;
};

// A block mask in FlexAttention's BlockMask format (int32, on the device, the last dim
// contiguous): kv_num_blocks (B, H, q_blocks) and kv_indices (B, H, q_blocks, list capacity) list
// each query block's partly visible key blocks, whose elements the mask modifier decides;
// full_kv_num_blocks / full_kv_indices (same shapes, optional) its fully visible ones. B may be 1
// or the batch, H 1 or heads_q. q_blocks = ceil(seqlen_q / q_block_size); the kernel's query tile
// must divide q_block_size and its key tile kv_block_size (128 x 128, FlexAttention's default,
// suits every head dim). Tiles listed in neither are never loaded. The backward walks the
// transposes: q_num_blocks (B, H, kv_blocks) and q_indices (B, H, kv_blocks, capacity), and
// full_q_num_blocks / full_q_indices exactly when the full kv lists are given.
struct BlockMask {
  TensorView kv_num_blocks, kv_indices;
  const TensorView* full_kv_num_blocks = nullptr;
  const TensorView* full_kv_indices = nullptr;
  const TensorView* q_num_blocks = nullptr;  // backward only
  const TensorView* q_indices = nullptr;
  const TensorView* full_q_num_blocks = nullptr;
  const TensorView* full_q_indices = nullptr;
  int q_block_size = 128;
  int kv_block_size = 128;
};

// Where a block mask is built: FlexAttention's arrays, int32, contiguous, on one device, for a
// mask of `batch` x `heads` (each 1 to share it) over seqlen_q x seqlen_k in blocks of
// q_block_size x kv_block_size: kv_num_blocks and full_kv_num_blocks (batch, heads, q_blocks),
// kv_indices and full_kv_indices (batch, heads, q_blocks, kv_blocks); the backward's transposes
// q_num_blocks and full_q_num_blocks (batch, heads, kv_blocks), q_indices and full_q_indices
// (batch, heads, kv_blocks, q_blocks), optional (data null: not built). Lists are ascending; the
// entries past a row's count are left as they were.
struct BlockMaskBuffers {
  TensorView kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices;
  TensorView q_num_blocks, q_indices, full_q_num_blocks, full_q_indices;
  int q_block_size = 128;
  int kv_block_size = 128;
};

// A forward that continues a running result over further keys (ring attention's steps, ring.hpp;
// any attention split over key blocks): the step's rows merge into the running O and LSE in fp32 by
// the logsumexp rule, so no step rounds O to 16 bits. `o_state` holds O so far, normalised,
// float32 (batch, heads_q, seqlen_q, head_dim) laid out as `lse` is, times head_dim (strides
// lse.strides[0] * head_dim, lse.strides[1] * head_dim, head_dim, 1); lse, required, is the
// running LSE (-inf: no key yet). The first step (has_state false) starts the state; rows whose
// last step this is, q's rows [final_begin, final_begin + final_rows), write `out`, normalised, and
// their final LSE instead of the state. sm_90 (sm90_fwd).
struct ForwardContinuation {
  TensorView o_state;
  bool has_state = false;
  int64_t final_begin = 0, final_rows = 0;
};

// One step of a backward split over key blocks (ring attention's, ring.hpp): dQ, dK and dV add to
// fp32 running sums shaped like q, k and v (float32, the last dim contiguous, the others multiples
// of 4 floats; dk_state and dv_state with the same strides), zeroed by the caller before the first
// step; on the last step (final) the sums with this step's are written to dq, dk and dv instead.
// The step's out and lse are the whole forward's. sm_90 (sm90_bwd), atomic dQ.
struct BackwardContinuation {
  TensorView dq_state, dk_state, dv_state;
  bool final = false;
};

// Which kernel family serves a call. `automatic` is the dispatcher's choice; the others force a
// family (tests, benchmarks) and fail with Error(unsupported) where it cannot serve the problem.
// The forward family: automatic = sm90 on sm_90 devices when TMA can read q, k and v (16-byte
// aligned bases and strides), fa2 otherwise. The backward: sm90_bwd on sm_90 devices where TMA
// can read q, k, v and dout, at head dims 33-64, 97-128 and 225-256 (in deterministic mode 64 and
// 128 only), fa2_bwd otherwise; backend=sm90 runs sm90_bwd at every head dim (the rest awaits a
// device run before automatic dispatch takes it), in deterministic mode at 64, 96, 128 and 129-256.
enum class Backend { automatic, reference, fa2, sm90 };

struct AttentionOptions {
  std::optional<float> softmax_scale;  // default 1 / sqrt(head_dim); positive and finite
  bool causal = false;                 // bottom-right aligned when seqlen_q != seqlen_k
  int window_left = -1;                // sliding window (FlashAttention's window_size); -1 = none, as is a
                                       // side past seqlen_q + seqlen_k
  int window_right = -1;
  float softcap = 0.f;                 // > 0: scores = softcap * tanh(scores / softcap)
  Backend backend = Backend::automatic;
  // Run exactly this kernel (tuning, tests, benchmarks). It must fit the problem: a forward
  // family for forward(), a backward one (fa2_bwd, sm90_bwd) for backward(), the problem's dtype,
  // mask kind, softcap and modifier, a head dim at least the problem's, and the device's arch;
  // Error(invalid_argument) says which field does not.
  std::optional<KernelSpec> kernel;
  // backward(): accumulate dQ in a fixed order, so reruns are bitwise identical. fa2_bwd recomputes
  // the scores in a second, query-outer kernel instead of atomics (1.27-1.38x the backward's time on
  // the H200); on sm_90 at head dims 64 and 128 (no block mask) sm90_bwd adds dQ in key-tile order.
  bool deterministic = false;
  // forward(): the backward of this call follows (training under autograd). Where the forward's
  // kernel is not loaded yet, the backward's (for `deterministic` as set here) starts compiling on
  // a background thread beside it, so a cold first step waits for the longer compile, not the sum
  // of both. Only a hint: a backward that cannot run is refused by backward().
  bool prepare_backward = false;
  // forward() on sm_90 (the persistent Hopper kernel): SMs to leave free for kernels running beside
  // it, such as communication (FlashAttention-3's sm_margin). 0 to the SM count minus one.
  int sm_margin = 0;
  // forward() on sm_90: key-range splits of the persistent schedule's last work tiles, which would
  // otherwise leave most SMs idle for the last round (FlashAttention-3's num_splits, for the tail).
  // 0: chosen where it shortens the run (no mask, fixed-length batches); 1: none, so results do not
  // depend on the SM count; n > 1: the last round's tiles in n each. Fixed-length batches only.
  int num_splits = 0;
  void* stream = nullptr;              // CUstream; nullptr = the legacy default stream
  // forward() and backward() on sm_90: user mask/score functions compiled into the kernel (the
  // first call with a new modifier compiles it), and a block mask whose empty tiles are skipped
  // (the backward walks its transposed lists). A block mask replaces causal and window (write them
  // into the mask modifier and the block mask). The backward takes the forward's mod and mask.
  const AttentionMod* mod = nullptr;
  const BlockMask* block_mask = nullptr;
  // forward() on sm_90: continue a running result (ForwardContinuation above).
  const ForwardContinuation* continuation = nullptr;
  // backward() on sm_90: add to running gradients (BackwardContinuation above).
  const BackwardContinuation* backward_continuation = nullptr;
  // forward() of float8_e4m3 q, k and v (sm_90, sm90_fwd; out bfloat16): dequantisation factors,
  // float32 (batch, heads_kv) on q's device, any strides (0 shares one factor), as FlashAttention-3's
  // q_descale, k_descale and v_descale: the scores are (q k^T) q_descale k_descale (then the softmax
  // scale) and out is (P v) v_descale. Null: 1.
  const TensorView* q_descale = nullptr;
  const TensorView* k_descale = nullptr;
  const TensorView* v_descale = nullptr;
};

// A packed variable-length batch: sequence b of q occupies rows [cu_seqlens_q[b], cu_seqlens_q[b+1]).
struct VarlenBatch {
  TensorView cu_seqlens_q;  // int32 (batch + 1), on the device, non-decreasing, starting at 0
  TensorView cu_seqlens_k;
  int max_seqlen_q = 0;
  int max_seqlen_k = 0;
  // Read cu_seqlens back (a small copy and a wait on the stream) and refuse a batch whose offsets
  // decrease, overrun the tensors or exceed max_seqlen, since the kernels would silently skip
  // rows. Callers that build cu_seqlens themselves may turn it off.
  bool check_cu_seqlens = true;
  // Optional (data null: none), int32 (batch) on the device: sequence b uses only the first
  // seqused[b] of its rows, [cu_seqlens[b], cu_seqlens[b] + seqused[b]) (FlashAttention-3's seqused_q/k:
  // a cache's filled part, or rows picked out of each sequence). max_seqlen bounds the used lengths.
  // Read by sm90_fwd and sm90_bwd (sm_90); dispatch refuses the other families with them.
  TensorView seqused_q, seqused_k;
};

// A KV cache as flash-attn's flash_attn_with_kvcache takes it. Contiguous: k_cache/v_cache (batch,
// seqlen_cache, heads_kv, head_dim), any strides with the last dim contiguous. Paged: (num_pages,
// page_size, heads_kv, head_dim) with block_table, int32 (batch, max_pages_per_seq) page ids, any
// page_size from 1. cache_seqlens (int32 (batch), on the device) holds each sequence's cached
// tokens; without it every sequence fills the cache. k_new/v_new (batch, seqlen_new, heads_kv,
// head_dim), when given, are written into the cache at cache_seqlens (which then is required)
// inside the call, and attention covers the cached and new tokens (bottom-right aligned, as
// causal and window are for every call). Nothing is read back to the host: faults only the device
// can see (a page id outside the cache, a length past its end) are reported by check_kvcache.
struct KvCache {
  TensorView k_cache, v_cache;
  const TensorView* block_table = nullptr;
  const TensorView* cache_seqlens = nullptr;
  const TensorView* k_new = nullptr;
  const TensorView* v_new = nullptr;
};

class Runtime {
 public:
  explicit Runtime(CacheConfig cache = CacheConfig::from_environment());
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // The process-wide runtime configured from FLASHJIT_* variables (what the C API uses).
  static Runtime& global();

  // out = softmax(scale * q k^T + mask) v, per head.
  //   q, out: (batch, seqlen_q, heads_q, head_dim)   k, v: (batch, seqlen_k, heads_kv, head_dim)
  //   lse:    optional float32 (batch, heads_q, seqlen_q), natural-log logsumexp of each row
  // fp16 or bf16, or float8_e4m3 q, k and v with a bfloat16 out (FP8, sm_90: see q_descale in the
  // options); heads_q a multiple of heads_kv; head_dim a multiple of 8 up to 256. Empty tensors
  // may have no memory (data null); no keys gives out 0 and LSE +inf. Batches and head counts over
  // a grid's 65535 run as several launches, one after another on the stream.
  void forward(const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView& out, const TensorView* lse, const AttentionOptions& options = {});

  // Variable-length: q, out (total_q, heads_q, head_dim); k, v (total_k, heads_kv, head_dim);
  // lse optional float32 (heads_q, total_q).
  void forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const TensorView* lse, const VarlenBatch& batch,
                      const AttentionOptions& options = {});

  // Gradients of forward(): given dout = dL/dout, writes dq, dk, dv (shaped and laid out like q, k,
  // v, same dtype). lse is the forward's (required); options must be the forward's (scale, causal,
  // window, softcap), plus `deterministic`. GQA: each K/V head's gradient sums its query heads.
  void backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                const TensorView& dout, const TensorView* lse, const TensorView& dq, const TensorView& dk,
                const TensorView& dv, const AttentionOptions& options = {});

  // Variable-length backward, tensors packed as in forward_varlen.
  void backward_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& dout, const TensorView* lse, const TensorView& dq,
                       const TensorView& dk, const TensorView& dv, const VarlenBatch& batch,
                       const AttentionOptions& options = {});

  // Attention of q (batch, seqlen_q, heads_q, head_dim) over a KV cache (decode: seqlen_q 1 to 16;
  // longer for chunked prefill), split over keys across CTAs (options.num_splits: 0 chosen from
  // the SM count, batch, heads and the cache's capacity; n forces n) and merged in a fixed order.
  // out like q; lse optional float32 (batch, heads_q, seqlen_q). Capturable in a CUDA graph: no
  // host synchronisation, scratch memory from the stream-ordered pool.
  void forward_kvcache(const TensorView& q, const KvCache& cache, const TensorView& out, const TensorView* lse,
                       const AttentionOptions& options = {});

  // Waits for `stream`'s work, then throws Error(invalid_argument) naming the first fault that a
  // forward_kvcache call since the last check found on the device (a page id outside [0,
  // num_pages), a cache_seqlens entry past the cache), and clears it. The rows of a faulty
  // sequence were written as NaN and nothing outside the cache was read.
  void check_kvcache(void* stream = nullptr);

  // Builds a block mask from `mod`'s mask function on the GPU (a generated kernel evaluates it on
  // every element of each tile: empty, partly or fully visible) into `out`; a modifier without a
  // mask function makes every tile fully visible. batch and heads are the mask's (1: shared).
  void create_block_mask(const AttentionMod& mod, int64_t batch, int64_t heads, int64_t seqlen_q, int64_t seqlen_k,
                         const BlockMaskBuffers& out, void* stream = nullptr);
  // The same from a tile map: uint8 (batch, heads, q_blocks, kv_blocks) of 0 (empty), 1 (partly
  // visible: the mask modifier decides) or 2 (fully visible), on the device.
  void block_mask_from_tiles(const TensorView& tile_map, int64_t seqlen_q, int64_t seqlen_k,
                             const BlockMaskBuffers& out, void* stream = nullptr);

  KernelCache& kernel_cache();

  // The tuning databases dispatch consults (flashjit/tuning.hpp). The user database starts as
  // FLASHJIT_TUNING_DB's; load_tuning_db replaces it (Error names the file and what is wrong).
  TuningSources& tuning();
  void load_tuning_db(const std::string& path);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashjit
