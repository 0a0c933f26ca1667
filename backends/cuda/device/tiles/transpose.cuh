// moeforge's tile library, part 'transpose' (backends/cuda/device/tiles.cuh
// includes every part; NVRTC sees this one as "moeforge_tiles_transpose.cuh").
// A block's 64 x 64 tile of a batched bf16 transpose: what a generated
// transpose kernel (a weight read as B^T by mma.sync, say) runs.
#pragma once
#include "moeforge_tiles_elementwise.cuh"

namespace mf {

// dst[b][c][r] = src[b][r][c] for BATCH matrices [R, C] (rows CS >= C apart:
// a stride8 source) into [C, RS] (RS >= R; rows R .. RS - 1 of each column
// are written as zeros: a stride8 tail),
// blockIdx.x numbering (matrix, row tile, column tile); 256 threads. The
// tile goes through shared memory at a 33-word row pitch: the load phase's
// word stores hit 32 banks, the store phase's column reads (rows eight apart)
// at most two ways. Vector (16-byte) loads where CS is a multiple of 8 and
// the 8 columns lie before C, vector stores where RS is a multiple of 8.
__device__ __forceinline__ void transpose_bf16_tile(const bf16 *__restrict__ src_all, bf16 *__restrict__ dst_all,
                                                    long long R, long long C, long long CS, long long RS,
                                                    long long BATCH) {
  __shared__ unsigned tile[64][33]; // bf16 pairs: tile[i][w] holds columns 2w, 2w + 1 of row i
  const long long tiles_r = (R + 63) / 64, tiles_c = (C + 63) / 64;
  const long long b = blockIdx.x / (tiles_r * tiles_c), t = blockIdx.x % (tiles_r * tiles_c);
  if (b >= BATCH)
    return;
  const long long r0 = (t / tiles_c) * 64, c0 = (t % tiles_c) * 64;
  const bool vec_load = CS % 8 == 0, vec_store = RS % 8 == 0;
  const unsigned short *src = reinterpret_cast<const unsigned short *>(src_all) + b * R * CS;
  unsigned short *dst = reinterpret_cast<unsigned short *>(dst_all) + b * C * RS;
  for (int v = threadIdx.x; v < 512; v += 256) {
    const int i = v >> 3, j = (v & 7) * 8;
    const long long r = r0 + i, c = c0 + j;
    uint4 q = make_uint4(0u, 0u, 0u, 0u);
    if (r < R && vec_load && c + 8 <= C) {
      q = *reinterpret_cast<const uint4 *>(src + r * CS + c);
    } else if (r < R) {
      unsigned e[8];
      for (int x = 0; x < 8; ++x)
        e[x] = c + x < C ? src[r * CS + c + x] : 0u;
      q = make_uint4(e[0] | e[1] << 16, e[2] | e[3] << 16, e[4] | e[5] << 16, e[6] | e[7] << 16);
    }
    tile[i][j / 2] = q.x;
    tile[i][j / 2 + 1] = q.y;
    tile[i][j / 2 + 2] = q.z;
    tile[i][j / 2 + 3] = q.w;
  }
  __syncthreads();
  for (int v = threadIdx.x; v < 512; v += 256) {
    const int i = v >> 3, j = (v & 7) * 8;
    const long long c = c0 + i, r = r0 + j;
    if (c >= C || r >= RS)
      continue;
    // Column i of rows j .. j + 7; rows past R hold zeros (the stride8 tail).
    unsigned e[8];
    for (int x = 0; x < 8; ++x)
      e[x] = (tile[j + x][i / 2] >> (16 * (i & 1))) & 0xffffu;
    if (vec_store) {
      *reinterpret_cast<uint4 *>(dst + c * RS + r) =
          make_uint4(e[0] | e[1] << 16, e[2] | e[3] << 16, e[4] | e[5] << 16, e[6] | e[7] << 16);
    } else {
      for (int x = 0; x < 8 && r + x < RS; ++x)
        dst[c * RS + r + x] = static_cast<unsigned short>(e[x]);
    }
  }
}

} // namespace mf
