// moeforge's tile library, part 'mma_sync' (backends/cuda/device/tiles.cuh includes
// every part; NVRTC sees this one as "moeforge_tiles_mma_sync.cuh").
// The sm_80 main loop: warp-level mma.sync over ldmatrix fragments, fed by a
// cp.async pipeline (GemmConfig).
#pragma once
#include "moeforge_tiles_copies.cuh"

namespace mf {

// ------------------------------------------------------------ warp MMA
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned s_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s_addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned s_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s_addr));
}
// c += a * b for one m16n8k16 fragment, fp32 accumulate.
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ------------------------------------------------------------ GEMM tile
// A block computes a BM x BN tile of C = A[rows, K] * B[K, N] for NB
// B operands at once (SwiGLU's gate and up projections share the A tile).
// Shared memory per stage: sA (BM, BK) then NB x sB (BK, BN), all bf16,
// 16-byte chunks XOR-swizzled so ldmatrix reads are bank-conflict free.
template <int BM_, int BN_, int BK_, int STAGES_, int WM_, int WN_, int NB_> struct GemmConfig {
  static constexpr int BM = BM_, BN = BN_, BK = BK_, STAGES = STAGES_, WM = WM_, WN = WN_, NB = NB_;
  static constexpr int THREADS = WM * WN * 32;
  static constexpr int CPR_A = BK / 8, CPR_B = BN / 8; // 16-byte chunks per smem row
  static constexpr int A_ITERS = BM * CPR_A / THREADS, B_ITERS = BK * CPR_B / THREADS;
  static constexpr int WTM = BM / WM, WTN = BN / WN; // one warp's share of the tile
  static constexpr int MI = WTM / 16, NI = WTN / 8;  // mma fragments per warp
  static constexpr int A_STAGE_BYTES = BM * BK * 2, B_STAGE_BYTES = BK * BN * 2;
  static constexpr int STAGE_BYTES = A_STAGE_BYTES + NB * B_STAGE_BYTES;
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES;
  static_assert(BK == 32 || BK == 64, "tile_k must be 32 or 64");
  static_assert(BN % 64 == 0, "tile_n must be a multiple of 64");
  static_assert(WTM % 16 == 0 && WTN % 16 == 0, "a warp's tile must be a multiple of 16 x 16");
  static_assert(BM * CPR_A % THREADS == 0 && BK * CPR_B % THREADS == 0, "tile loads must divide among threads");
  static_assert(STAGES >= 2, "at least two stages");

  // Swizzled byte offset of 16-byte chunk `ch` of row `row`.
  __device__ static __forceinline__ unsigned a_off(int row, int ch) {
    const int sw = CPR_A == 4 ? (ch ^ ((row >> 1) & 3)) : (ch ^ (row & 7));
    return row * (BK * 2) + sw * 16;
  }
  __device__ static __forceinline__ unsigned b_off(int row, int ch) { return row * (BN * 2) + ((ch ^ (row & 7)) * 16); }
  // The tile row and 16-byte chunk this thread copies in its i-th A load.
  __device__ static __forceinline__ int a_load_row(int tid, int i) { return (tid + i * THREADS) / CPR_A; }
  __device__ static __forceinline__ int a_load_chunk(int tid, int i) { return (tid + i * THREADS) % CPR_A; }
  // This thread's accumulators: NB operands x MI x NI fragments x 4.
  typedef float Acc[NB][MI][NI][4];
  __device__ static __forceinline__ float get(const Acc &acc, int b, int mi, int ni, int e) {
    return acc[b][mi][ni][e];
  }
  // Tile-local row / column of accumulator element (mi, ni, e) of this lane.
  __device__ static __forceinline__ int acc_row(int warp, int lane, int mi, int e) {
    return (warp / WN) * WTM + mi * 16 + (lane >> 2) + (e >> 1) * 8;
  }
  __device__ static __forceinline__ int acc_col(int warp, int lane, int ni, int e) {
    return (warp % WN) * WTN + ni * 8 + (lane & 3) * 2 + (e & 1);
  }
  __device__ static bool mainloop(unsigned char *smem, const bf16 *const (&gA)[A_ITERS], const bool (&a_ok)[A_ITERS],
                                  const bf16 *const (&gB)[NB], int K, int N, int n0, Acc &acc);
};

// The multi-stage mma.sync main loop. gA[i]: where this thread's i-th A chunk row
// starts for k = 0 (already offset by its chunk), valid in a_ok[i]; gB[b]:
// operand b's [K, N] matrix (already offset to the expert). K and N are
// multiples of 8; tails are zero-filled so no tile size needs to divide them.
template <int BM_, int BN_, int BK_, int STAGES_, int WM_, int WN_, int NB_>
__device__ __forceinline__ bool
GemmConfig<BM_, BN_, BK_, STAGES_, WM_, WN_, NB_>::mainloop(unsigned char *smem, const bf16 *const (&gA)[A_ITERS],
                                                            const bool (&a_ok)[A_ITERS], const bf16 *const (&gB)[NB],
                                                            int K, int N, int n0, Acc &acc) {
  typedef GemmConfig C;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / C::WN, wn = warp % C::WN;
  const unsigned s0 = smem_u32(smem);
  const int KT = (K + C::BK - 1) / C::BK;

  auto load_stage = [&](int slot, int kt) {
    const unsigned sA = s0 + slot * C::STAGE_BYTES;
    const int k0 = kt * C::BK;
#pragma unroll
    for (int i = 0; i < C::A_ITERS; ++i) {
      const int row = C::a_load_row(tid, i), ch = C::a_load_chunk(tid, i);
      const int bytes = chunk_bytes_bf16(a_ok[i], k0 + ch * 8, K);
      cp_async_16_part(sA + C::a_off(row, ch), bytes ? gA[i] + k0 : gA[i], bytes);
    }
#pragma unroll
    for (int b = 0; b < C::NB; ++b) {
      const unsigned sB = sA + C::A_STAGE_BYTES + b * C::B_STAGE_BYTES;
#pragma unroll
      for (int i = 0; i < C::B_ITERS; ++i) {
        const int c = tid + i * C::THREADS, row = c / C::CPR_B, ch = c % C::CPR_B;
        const int k = k0 + row, n = n0 + ch * 8;
        const bool ok = k < K && n < N;
        cp_async_16(sB + C::b_off(row, ch), ok ? gB[b] + (long long)k * N + n : gB[b], ok);
      }
    }
  };

  auto compute_stage = [&](int slot) {
    const unsigned sA = s0 + slot * C::STAGE_BYTES;
#pragma unroll
    for (int ks = 0; ks < C::BK / 16; ++ks) {
      unsigned rA[C::MI][4];
#pragma unroll
      for (int mi = 0; mi < C::MI; ++mi) {
        const int row = wm * C::WTM + mi * 16 + (lane & 15), ch = ks * 2 + (lane >> 4);
        ldmatrix_x4(rA[mi], sA + C::a_off(row, ch));
      }
#pragma unroll
      for (int b = 0; b < C::NB; ++b) {
        const unsigned sB = sA + C::A_STAGE_BYTES + b * C::B_STAGE_BYTES;
        unsigned rB[C::NI][2];
#pragma unroll
        for (int nj = 0; nj < C::NI / 2; ++nj) {
          const int krow = ks * 16 + (lane & 15), ch = (wn * C::WTN + nj * 16) / 8 + (lane >> 4);
          unsigned r[4];
          ldmatrix_x4_trans(r, sB + C::b_off(krow, ch));
          rB[2 * nj][0] = r[0];
          rB[2 * nj][1] = r[1];
          rB[2 * nj + 1][0] = r[2];
          rB[2 * nj + 1][1] = r[3];
        }
#pragma unroll
        for (int mi = 0; mi < C::MI; ++mi)
#pragma unroll
          for (int ni = 0; ni < C::NI; ++ni)
            mma_16816(acc[b][mi][ni], rA[mi], rB[ni][0], rB[ni][1]);
      }
    }
  };

#pragma unroll
  for (int s = 0; s < C::STAGES - 1; ++s) {
    if (s < KT)
      load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<C::STAGES - 2>();
    __syncthreads();
    // Refill the slot computed in the previous iteration: every thread has
    // passed the barrier above, so no warp still reads it.
    const int next = kt + C::STAGES - 1;
    if (next < KT)
      load_stage(next % C::STAGES, next);
    cp_async_commit();
    compute_stage(kt % C::STAGES);
  }
  cp_async_wait<0>();
  return true;
}

} // namespace mf
