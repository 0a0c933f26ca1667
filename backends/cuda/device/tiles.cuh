// moeforge's device-side tile library (NVRTC sees it as "moeforge_tiles.cuh";
// embedded into the binary at build time, see backends/cuda/CMakeLists.txt).
// Generated kernels stay thin: they set up a tile (which rows, which
// expert), call a main loop, and run their own epilogue. The library speaks
// in tiles: names say the memory level (g* global, s* shared, r* registers)
// and who cooperates (the block or a warp). mma.sync (m16n8k16, ldmatrix,
// cp.async pipelines) runs on sm_80 and later; the Hopper main loops (wgmma
// fed by TMA through mbarriers, warp-specialised producers) fill the same
// accumulators for the block's output tile.
//
// The library in parts, each one job (tiles/*.cuh); each part includes the
// parts it builds on.
#pragma once
#include "moeforge_tiles_attention.cuh"
#include "moeforge_tiles_cluster.cuh"
#include "moeforge_tiles_copies.cuh"
#include "moeforge_tiles_elementwise.cuh"
#include "moeforge_tiles_fp8.cuh"
#include "moeforge_tiles_grid_dependency.cuh"
#include "moeforge_tiles_mma_sync.cuh"
#include "moeforge_tiles_timeline.cuh"
#include "moeforge_tiles_tma.cuh"
#include "moeforge_tiles_transpose.cuh"
#include "moeforge_tiles_wgmma.cuh"
#include "moeforge_tiles_wgmma_rows.cuh"
#include "moeforge_tiles_wgmma_ws.cuh"
