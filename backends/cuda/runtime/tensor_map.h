// TMA tensor maps (CUtensorMap) for the tiles the Hopper GEMMs load with the
// copy engine. A map describes a bf16 tensor in device memory as `batches`
// row-major [rows, cols] matrices and the box one copy moves: 64 columns (128
// bytes) x 64 rows, written to shared memory with the 128-byte swizzle that
// wgmma's descriptors read (backends/cuda/codegen/tile_library.h, load_stage_tma).
#pragma once

#include <cuda.h>

#include <cstddef>
#include <string>

namespace moeforge::cuda {

// Encodes the map of the `bytes` of bf16 at `base`: a whole number of [rows,
// cols] matrices, each `matrix_stride` elements after the last (0: packed,
// rows * cols; more for a tensor stored inside a larger one, whose bytes then
// end with its last matrix). Throws UserError when the driver's constraints
// are not met (cols not a multiple of 8, a misaligned base) and CudaError
// from the driver.
CUtensorMap encode_bf16_tiles(CUdeviceptr base, size_t bytes, long long rows, long long cols, const std::string &what,
                              long long matrix_stride = 0);

} // namespace moeforge::cuda
