// moeforge's device-side tile library: backends/cuda/device/tiles.cuh, a real
// CUDA file (formatted, compiled on its own in the tests), embedded into the
// binary at build time and handed to NVRTC as the header
// "moeforge_tiles.cuh". Generated kernels stay thin: they set up a tile
// (which rows, which expert), call a main loop, and run their own epilogue.
#pragma once

#include <string>

namespace moeforge {

inline constexpr const char *kTileLibraryName = "moeforge_tiles.cuh";

// The complete device library, as NVRTC receives it: tiles.cuh with the
// wgmma instruction wrappers (one per supported N and operand order) put in
// at its MOEFORGE_WGMMA_INSTANCES line.
const std::string &tile_library_source();

} // namespace moeforge
