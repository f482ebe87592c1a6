#include "tma.hpp"

#include <cstdint>
#include <cstring>

#include <fmt/format.h>

#include "driver.hpp"

namespace flashjit::detail {

static_assert(sizeof(TmaDescriptor) == sizeof(CUtensorMap), "TmaDescriptor mirrors CUtensorMap");

TmaDescriptor make_attention_tma_map(const void* data, DType dtype, int head_dim, int seqlen, int heads, int batch,
                                     long long row_stride, long long head_stride, long long batch_stride,
                                     int box_rows) {
  const cuuint64_t kElementBytes = element_bytes(dtype);
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(seqlen), cuuint64_t(heads), cuuint64_t(batch)};
  // Strides of dims 1..3 in bytes; a dim of extent 1 may have any stride, but TMA wants multiples of
  // 16 below 2^40, so those get a harmless one.
  auto stride_bytes = [&](long long elements, int extent) {
    const cuuint64_t bytes = cuuint64_t(elements) * kElementBytes;
    return extent > 1 && bytes > 0 ? bytes : cuuint64_t(16);
  };
  const cuuint64_t strides[3] = {stride_bytes(row_stride, seqlen), stride_bytes(head_stride, heads),
                                 stride_bytes(batch_stride, batch)};
  const cuuint32_t box[4] = {cuuint32_t(128 / kElementBytes), cuuint32_t(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = dtype == DType::bf16   ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                   : dtype == DType::fp16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                          : CU_TENSOR_MAP_DATA_TYPE_UINT8;
  CUtensorMap map;
  FLASHJIT_CU(cuTensorMapEncodeTiled, &map, type, 4,
              const_cast<void*>(data), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
              CU_TENSOR_MAP_SWIZZLE_128B,
              CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TmaDescriptor descriptor;
  std::memcpy(&descriptor, &map, sizeof map);
  return descriptor;
}

TmaDescriptor make_dq_accum_tma_map(float* accum, int head_dim, int rows, int heads, int box_rows) {
  const cuuint64_t dims[3] = {cuuint64_t(head_dim), cuuint64_t(rows), cuuint64_t(heads)};
  const cuuint64_t row_bytes = cuuint64_t(head_dim) * sizeof(float);
  const cuuint64_t strides[2] = {row_bytes, row_bytes * dims[1]};
  const cuuint32_t box[3] = {32, cuuint32_t(box_rows), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  CUtensorMap map;
  FLASHJIT_CU(cuTensorMapEncodeTiled, &map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, accum, dims, strides, box,
              element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
              CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TmaDescriptor descriptor;
  std::memcpy(&descriptor, &map, sizeof map);
  return descriptor;
}

TmaDescriptor make_kv_cache_tma_map(const void* data, DType dtype, int head_dim, int page_size, int heads, int pages,
                                    long long row_stride, long long head_stride, long long page_stride, int box_rows) {
  constexpr cuuint64_t kElementBytes = 2;
  const int panels = head_dim / 64;
  const cuuint64_t dims[5] = {64, cuuint64_t(page_size), cuuint64_t(panels), cuuint64_t(heads), cuuint64_t(pages)};
  auto stride_bytes = [&](long long elements, int extent) {  // as make_attention_tma_map's
    const cuuint64_t bytes = cuuint64_t(elements) * kElementBytes;
    return extent > 1 && bytes > 0 ? bytes : cuuint64_t(16);
  };
  const cuuint64_t strides[4] = {stride_bytes(row_stride, page_size), stride_bytes(64, panels),
                                 stride_bytes(head_stride, heads), stride_bytes(page_stride, pages)};
  const cuuint32_t box[5] = {64, cuuint32_t(box_rows), cuuint32_t(panels), 1, 1};
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  CUtensorMap map;
  FLASHJIT_CU(cuTensorMapEncodeTiled, &map,
              dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 5,
              const_cast<void*>(data), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TmaDescriptor descriptor;
  std::memcpy(&descriptor, &map, sizeof map);
  return descriptor;
}

TmaExtents tma_extents(const ForwardProblem& problem) {
  const AttentionFwdParams& a = problem.params;
  if (problem.is_varlen) return {problem.total_q, problem.total_k, 1};
  return {a.seqlen_q, a.seqlen_k, a.batch};
}

namespace {

struct TmaOperand {
  const char* name;
  const void* data;
  long long row_stride, head_stride, batch_stride;
  int rows, heads, batches;
  int element_bytes;
};

std::optional<std::string> unusable_reason(const TmaOperand& t) {
  if (t.rows == 0) return fmt::format("{}: no rows (a TMA map needs every extent positive)", t.name);
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0)
    return fmt::format("{}: data pointer {} is not 16-byte aligned (TMA needs it)", t.name, t.data);
  const std::pair<long long, int> strides[] = {{t.row_stride, t.rows}, {t.head_stride, t.heads},
                                               {t.batch_stride, t.batches}};
  for (const auto& [stride, extent] : strides)
    if (extent > 1 && (stride * t.element_bytes % 16 != 0 || stride * t.element_bytes >= (1ll << 40)))
      return fmt::format("{}: a stride of {} elements is not a multiple of 16 bytes below 2^40 (TMA needs it)",
                         t.name, stride);
  return std::nullopt;
}

}  // namespace

std::optional<std::string> tma_unusable_reason(const char* name, const void* data, long long row_stride,
                                               long long head_stride, long long batch_stride, int rows, int heads,
                                               int batches, int element_bytes) {
  return unusable_reason({name, data, row_stride, head_stride, batch_stride, rows, heads, batches, element_bytes});
}

std::optional<std::string> tma_unusable_reason(const ForwardProblem& problem) {
  const AttentionFwdParams& a = problem.params;
  const auto [rows_q, rows_k, batches] = tma_extents(problem);
  const int bytes = element_bytes(problem.dtype);
  const TmaOperand operands[] = {
      {"q", a.q, a.q_row_stride, a.q_head_stride, a.q_batch_stride, rows_q, a.num_heads_q, batches, bytes},
      {"k", a.k, a.k_row_stride, a.k_head_stride, a.k_batch_stride, rows_k, a.num_heads_kv, batches, bytes},
      {"v", a.v, a.v_row_stride, a.v_head_stride, a.v_batch_stride, rows_k, a.num_heads_kv, batches, bytes}};
  for (const TmaOperand& t : operands)
    if (auto reason = unusable_reason(t)) return reason;
  return std::nullopt;
}

std::optional<std::string> tma_unusable_reason(const BackwardProblem& problem) {
  if (auto reason = tma_unusable_reason(problem.forward)) return reason;
  const AttentionBwdParams& b = problem.params;
  const auto [rows_q, rows_k, batches] = tma_extents(problem.forward);
  return unusable_reason({"dout", b.d_o, b.do_row_stride, b.do_head_stride, b.do_batch_stride, rows_q,
                          b.fwd.num_heads_q, batches, 2});
}

}  // namespace flashjit::detail
