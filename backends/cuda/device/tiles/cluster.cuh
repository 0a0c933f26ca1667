// moeforge's tile library, part 'cluster' (backends/cuda/device/tiles.cuh includes
// every part; NVRTC sees this one as "moeforge_tiles_cluster.cuh").
// Hopper: two-block clusters (distributed shared memory, multicast TMA).
#pragma once
#include "moeforge_tiles_tma.cuh"

namespace mf {

// ------------------------------------------------------------ Hopper: 2-block clusters
// The same box multicast into the shared memory of every block in cta_mask
// (same offsets), completing bytes on each block's barrier at `bar`.
__device__ __forceinline__ void tma_load_3d_multicast(unsigned s_dst, const TmaDesc *map, int c0, int c1, int c2,
                                                      unsigned bar, unsigned short cta_mask) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
               " [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(s_dst),
               "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(cta_mask)
               : "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// Every thread of every block of the cluster arrives, then waits for all.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// Arrives on the barrier at the same offset in block `rank`'s shared memory,
// with the default release at the block's scope: what is released is a slot
// whose reads (wgmma) have completed, so no cluster-wide ordering is owed,
// and .release.cluster cost the pair loop a third of its speed.
__device__ __forceinline__ void mbar_arrive_cluster(unsigned bar, unsigned rank) {
  asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
               "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
               "r"(rank)
               : "memory");
}

// For data handed to the peer block (a tile id): the arrival releases this
// thread's earlier writes, remote ones included, at the cluster's scope, and
// the waiter acquires at that scope.
__device__ __forceinline__ void mbar_arrive_release_cluster(unsigned bar, unsigned rank) {
  asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
               "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
               "r"(rank)
               : "memory");
}
__device__ __forceinline__ void mbar_wait_cluster(unsigned bar, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
}
// A 64-bit store into block `rank`'s shared memory at the same offset.
__device__ __forceinline__ void st_cluster_s64(unsigned addr, unsigned rank, long long v) {
  asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
               "st.shared::cluster.s64 [remote], %2;\n}\n" ::"r"(addr),
               "r"(rank), "l"(v)
               : "memory");
}

} // namespace mf
