#include "tma.hpp"

#include <cstring>

#include "driver.hpp"

namespace flashjit::detail {

static_assert(sizeof(TmaDescriptor) == sizeof(CUtensorMap), "TmaDescriptor mirrors CUtensorMap");

TmaDescriptor make_attention_tma_map(const void* data, DType dtype, int head_dim, int seqlen, int heads, int batch,
                                     long long row_stride, long long head_stride, long long batch_stride,
                                     int box_rows) {
  constexpr cuuint64_t kElementBytes = 2;
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(seqlen), cuuint64_t(heads), cuuint64_t(batch)};
  // Strides of dims 1..3 in bytes; a dim of extent 1 may have any stride, but TMA wants multiples of
  // 16 below 2^40, so those get a harmless one.
  auto stride_bytes = [&](long long elements, int extent) {
    const cuuint64_t bytes = cuuint64_t(elements) * kElementBytes;
    return extent > 1 && bytes > 0 ? bytes : cuuint64_t(16);
  };
  const cuuint64_t strides[3] = {stride_bytes(row_stride, seqlen), stride_bytes(head_stride, heads),
                                 stride_bytes(batch_stride, batch)};
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  CUtensorMap map;
  FLASHJIT_CU(cuTensorMapEncodeTiled, &map,
              dtype == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
              const_cast<void*>(data), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TmaDescriptor descriptor;
  std::memcpy(&descriptor, &map, sizeof map);
  return descriptor;
}

}  // namespace flashjit::detail
