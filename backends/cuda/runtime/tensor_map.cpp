#include "backends/cuda/runtime/tensor_map.h"

#include "backends/cuda/runtime/driver.h"
#include "dsl/error.h"

namespace moeforge::cuda {

CUtensorMap encode_bf16_tiles(CUdeviceptr base, size_t bytes, long long rows, long long cols, const std::string &what,
                              long long matrix_stride) {
  // The driver wants 16-byte aligned addresses and row strides, at most 2^32
  // elements a dimension.
  user_check(rows > 0 && cols > 0 && cols % 8 == 0) << "TMA tiles of '" << what << "': a [" << rows << ", " << cols
                                                    << "] matrix needs rows of a multiple of 8 elements (16 bytes): "
                                                       "pad the columns or drop tma(...) from the schedule";
  user_check(base % 16 == 0) << "TMA tiles of '" << what << "': the tensor's address is not 16-byte aligned";
  const size_t matrix = static_cast<size_t>(rows) * static_cast<size_t>(cols) * 2;
  const size_t apart = matrix_stride > 0 ? static_cast<size_t>(matrix_stride) * 2 : matrix; // bytes
  internal_check(apart >= matrix && apart % 16 == 0 && bytes >= matrix && (bytes - matrix) % apart == 0)
      << "TMA tiles of '" << what << "': " << bytes << " bytes are not whole [" << rows << ", " << cols
      << "] bf16 matrices " << apart << " bytes apart";
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              (bytes - matrix) / apart + 1};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols) * 2, apart}; // bytes, dims 1 and 2
  const cuuint32_t box[3] = {64, 64, 1}, element_strides[3] = {1, 1, 1};
  CUtensorMap map;
  MOEFORGE_CU(cuTensorMapEncodeTiled, &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, reinterpret_cast<void *>(base), dims,
              strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return map;
}

} // namespace moeforge::cuda
