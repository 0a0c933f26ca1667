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
// The bytes of a 16-byte chunk of 8 bf16 values starting at element k of a
// row of K to copy (cp.async zero-fills the rest of the chunk): all 16 when
// the chunk lies before K, none past it or when !ok, and the values before
// K of a chunk that K cuts (a row of a run-time length, whose tail past K
// may hold anything: the zeros meet B's zero-filled rows past K, and a NaN
// there would not). K a multiple of 8 (every constant K) takes the first
// branch, decided at compile time where K is a constant.
__device__ __forceinline__ int chunk_bytes_bf16(bool ok, int k, int K) {
  if (K % 8 == 0)
    return ok && k < K ? 16 : 0;
  const int left = K - k;
  return !ok || left <= 0 ? 0 : left >= 8 ? 16 : left * 2;
}
// cp.async of `bytes` (0..16) of a 16-byte chunk, zero-filling the rest.
__device__ __forceinline__ void cp_async_16_part(unsigned s_dst, const void *g_src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s_dst), "l"(g_src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

} // namespace mf
