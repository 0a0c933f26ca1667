// moeforge's tile library, part 'copies' (backends/cuda/device/tiles.cuh includes
// every part; NVRTC sees this one as "moeforge_tiles_copies.cuh").
// Where a block's tile is (grouped rasterisation) and cp.async copies from
// global to shared memory.
#pragma once
#include "moeforge_tiles_elementwise.cuh"

namespace mf {

// ------------------------------------------------------------ block order
// Grouped rasterisation of a 1-D grid over num_m x num_n output tiles: blocks
// run `group` row tiles at a time across every column tile, so one wave of
// blocks reads a few row tiles of A and a band of B that both stay in L2,
// instead of streaming all of A once per column tile.
__device__ __forceinline__ void raster_mn(int pid, int num_m, int num_n, int group, int &m, int &n) {
  const int per_group = group * num_n;
  const int first_m = (pid / per_group) * group;
  const int rows = min(num_m - first_m, group);
  m = first_m + (pid % per_group) % rows;
  n = (pid % per_group) / rows;
}
__device__ __forceinline__ void raster(int pid, int num_n, int group, int &m, int &n) {
  raster_mn(pid, gridDim.x / num_n, num_n, group, m, n);
}

// ------------------------------------------------------------ async copies
__device__ __forceinline__ unsigned smem_u32(const void *p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared, zero-filled when !pred (src must still be a valid
// address: callers pass the tensor's base then).
__device__ __forceinline__ void cp_async_16(unsigned s_dst, const void *g_src, bool pred) {
  const int bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s_dst), "l"(g_src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

} // namespace mf
