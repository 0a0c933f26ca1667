// moeforge's tile library, part 'timeline' (backends/cuda/device/tiles.cuh includes
// every part; NVRTC sees this one as "moeforge_tiles_timeline.cuh").
// Timeline stamps of a debugging build (MOEFORGE_TIMELINE=1): each GEMM tile's phases
// on the global timer, which CudaLayer::timeline() reads back.
#pragma once
#include <cuda_bf16.h>

// ------------------------------------------------------------ timeline (debugging)
// Compiled with -DMF_TIMELINE (MOEFORGE_TIMELINE=1 at run time), GEMM
// kernels stamp the global timer at the phases of a tile into
// mf_timeline[block][phase] (thread 0, the first consumer thread):
//   0 entry, 1 main loop called (tile table read), 2 first stage landed,
//   3 main loop done, 4 epilogue done, 5 the SM's id, 6 the tile's rows + 1
//   (a value, not a time: tiles of an expert's last rows told apart);
// persistent blocks stamp per tile (at mf_timeline[tile]; no phase 2).
// CudaLayer::timeline() reads it back after each GEMM. Otherwise MF_STAMP
// is nothing.
#ifdef MF_TIMELINE
#define MF_TIMELINE_BLOCKS 65536
extern "C" {
__device__ unsigned long long mf_timeline[MF_TIMELINE_BLOCKS * 8]; // defined here: one NVRTC unit
}
__device__ __forceinline__ void mf_stamp(long long at, int phase) {
  if (threadIdx.x == 0 && at < MF_TIMELINE_BLOCKS) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    mf_timeline[at * 8 + phase] = t;
    if (phase == 0) {
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      mf_timeline[at * 8 + 5] = sm;
    }
  }
}
__device__ __forceinline__ void mf_note_rows(long long at, int rows) {
  if (threadIdx.x == 0 && at < MF_TIMELINE_BLOCKS)
    mf_timeline[at * 8 + 6] = (unsigned long long)(rows + 1);
}
#define MF_STAMP(phase) mf_stamp(blockIdx.x, phase)
#define MF_STAMP_AT(tile, phase) mf_stamp(tile, phase) // persistent blocks: per tile
#define MF_NOTE_ROWS(rows) mf_note_rows(blockIdx.x, rows)
#define MF_NOTE_ROWS_AT(tile, rows) mf_note_rows(tile, rows)
#else
#define MF_STAMP(phase)
#define MF_STAMP_AT(tile, phase)
#define MF_NOTE_ROWS(rows)
#define MF_NOTE_ROWS_AT(tile, rows)
#endif
