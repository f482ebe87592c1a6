// runtime/launch: TMA tensor maps (CUtensorMap) for the Hopper kernels, built on the host through
// the driver and copied into the kernels' __grid_constant__ parameters.
#pragma once

#include <optional>
#include <string>

#include "common/params.cuh"
#include "flashjit/codegen/kernel_spec.hpp"
#include "problem.hpp"

namespace flashjit::detail {

// A 4-D map of a (batch, seqlen, heads, head_dim) tensor whose last dim is contiguous: dims innermost
// first (head_dim, seqlen, heads, batch), boxes of 128 bytes of head dim (64 16-bit values, 128 FP8
// ones) x box_rows rows with 128-byte swizzle (the wgmma operand layout), out-of-bounds reads as
// zeros, 256-byte L2 promotion (it serves the tiles the forward rereads). Strides are in elements.
TmaDescriptor make_attention_tma_map(const void* data, DType dtype, int head_dim, int seqlen, int heads, int batch,
                                     long long row_stride, long long head_stride, long long batch_stride,
                                     int box_rows);

// A 5-D map of a KV cache (pages, page_size, heads, head_dim), last dim contiguous, for
// kvcache_fwd's attention_tma: dims innermost first (64 values, rows, head_dim / 64 panels, heads,
// pages), so that one copy of box_rows rows lands as [panel][row][128 bytes] for every panel, 128-byte
// swizzled. No L2 promotion: the cache is streamed once (256-byte promotion held decode 5% below
// cuDNN on the H200). One copy per page rather than per panel: pages of 16 rows, a CTA alone
// streamed 49 GB/s, not 34. Strides are in elements.
TmaDescriptor make_kv_cache_tma_map(const void* data, DType dtype, int head_dim, int page_size, int heads, int pages,
                                    long long row_stride, long long head_stride, long long page_stride, int box_rows);

// A 3-D map of the backward's fp32 dQ accumulator (heads, rows, head_dim), contiguous: dims innermost
// first (head_dim, rows, heads), boxes of 32 floats (128 bytes) x box_rows rows with 128-byte swizzle,
// which sm90_bwd adds its steps' dQ through (TMA reductions; columns and rows past the extents are
// clipped). rows and heads are at least 1.
TmaDescriptor make_dq_accum_tma_map(float* accum, int head_dim, int rows, int heads, int box_rows);

// The extents the maps describe: varlen tensors are one batch entry of packed rows.
struct TmaExtents {
  int rows_q, rows_k, batches;
};
TmaExtents tma_extents(const ForwardProblem& problem);

// Why q, k or v cannot be read through TMA maps (no rows, such as seqlen_k = 0; a base address not
// 16-byte aligned; a stride of a dim longer than one that is not a multiple of 16 bytes), or
// nothing when all three can.
std::optional<std::string> tma_unusable_reason(const ForwardProblem& problem);
// The same for one (batch, seqlen, heads, head_dim) tensor named `name` (the output, say).
std::optional<std::string> tma_unusable_reason(const char* name, const void* data, long long row_stride,
                                               long long head_stride, long long batch_stride, int rows, int heads,
                                               int batches, int element_bytes = 2);
// The same for a backward problem: q, k, v and dout.
std::optional<std::string> tma_unusable_reason(const BackwardProblem& problem);

}  // namespace flashjit::detail
