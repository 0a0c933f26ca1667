// moeforge's device-side tile library: backends/cuda/device/tiles.cuh and
// its parts (device/tiles/*.cuh, one job each: element-wise helpers, copies,
// the mma.sync loop, TMA, clusters, wgmma, expert reductions, the
// warp-specialised loops), real CUDA files (formatted, compiled on their own
// in the tests) embedded into the binary at build time and handed to NVRTC
// as headers. Generated kernels include "moeforge_tiles.cuh" and stay thin:
// they set up a tile (which rows, which expert), call a main loop, and run
// their own epilogue.
#pragma once

#include <string>
#include <vector>

#include "backends/cuda/codegen/nvrtc_compiler.h"

namespace moeforge {

inline constexpr const char *kTileLibraryName = "moeforge_tiles.cuh";

// The complete device library, as NVRTC receives it: "moeforge_tiles.cuh"
// (tiles.cuh, which includes the parts) and each part as
// "moeforge_tiles_<part>.cuh", the wgmma part with its instruction wrappers
// (one per supported N and operand order) put in at its
// MOEFORGE_WGMMA_INSTANCES line.
const std::vector<cuda::NamedHeader> &tile_library_headers();

} // namespace moeforge
