// moeforge's tile library, part 'tma' (backends/cuda/device/tiles.cuh includes
// every part; NVRTC sees this one as "moeforge_tiles_tma.cuh").
// Hopper (sm_90a): mbarriers and the bulk tensor copy engine (TMA).
#pragma once
#include "moeforge_tiles_copies.cuh"

namespace mf {

// ------------------------------------------------------------ Hopper: mbarriers and TMA
// mbarriers: a phase completes when `count` arrivals have been made.
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` when all of this thread's earlier cp.async copies complete
// (without adding to the expected count: the barrier was initialised for it).
__device__ __forceinline__ void cp_async_arrive_noinc(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// try_wait with a suspend-time hint: a waiting warp may sleep until the
// phase completes (or the hint's 10 ms pass) instead of retrying after the
// system's short default, leaving issue slots to the warps that work (the
// consumers' retries had issued a third as many instructions as the
// producer filling their stages; no step time moved either way on an H200).
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\nselp.u32 %0, 1, 0, "
                 "p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity), "r"(10000000u)
                 : "memory");
}

// Adds `bytes` to the transaction count the barrier's current phase waits
// for (TMA copies complete them), without arriving.
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// ------------------------------------------------------------ TMA
// A tensor map (CUtensorMap, 128 bytes) encoded on the host by
// cuTensorMapEncodeTiled and passed as a __grid_constant__ kernel argument.
struct __align__(64) TmaDesc {
  unsigned long long bits[16];
};
// One box of a 3-D tensor (coordinates innermost first) into shared memory at
// s_dst; its bytes complete on `bar`. Out-of-range elements read as zero.
__device__ __forceinline__ void tma_load_3d(unsigned s_dst, const TmaDesc *map, int c0, int c1, int c2, unsigned bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(s_dst),
               "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
               : "memory");
}

// The reverse: a box of shared memory (laid out as the map's swizzle says)
// to the tensor at {c0, c1, c2}; the copy engine drops what falls outside
// the tensor. Completion is tracked per thread in bulk groups.
__device__ __forceinline__ void tma_store_3d(const TmaDesc *map, unsigned s_src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
                   reinterpret_cast<unsigned long long>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(s_src)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// This thread's bulk copies have read their shared memory (which may then be
// reused or freed); their global writes may still be on their way.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// A barrier among the first `threads` threads of the block (id 1..15; 0 is
// __syncthreads'), for a subset such as the consumer warpgroups.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

} // namespace mf
