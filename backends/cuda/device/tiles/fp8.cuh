// moeforge's tile library, part 'fp8' (backends/cuda/device/tiles.cuh includes
// every part; NVRTC sees this one as "moeforge_tiles_fp8.cuh").
// FP8 (e4m3) operands on Hopper: dsl/fp8.h's block rounding on the device,
// and a wgmma main loop over e4m3 tiles that adds each 128-deep block's
// product into the float32 accumulators times its two scales.
#pragma once
#include "moeforge_tiles_wgmma.cuh"

namespace mf {

// ------------------------------------------------------------ block rounding
// dsl/fp8.h's rule, as every other evaluator applies it: a block's scale is
// the smallest power of two 2^e with amax <= 448 * 2^e (1 for a block of
// zeros; a NaN is skipped by the maximum, an infinite amax gives 1 and the
// values saturate). Returned as its exponent: v * 2^-e is then exact, where
// dividing by a scale under float's normal range (blocks whose largest
// magnitude is under 2^-118) would not be, nor would its reciprocal fit.
constexpr float kE4m3Max = 448.f;
__device__ __forceinline__ int fp8_e4m3_scale_exponent(float amax) {
  if (!(amax > 0.f) || isinf(amax))
    return 0;
  int e = ilogbf(amax) - 8; // ilogb(448) = 8
  while (ldexpf(kE4m3Max, e) < amax)
    ++e;
  while (ldexpf(kE4m3Max, e - 1) >= amax)
    --e;
  return e;
}
// Two values to e4m3 (round to nearest even, saturating at +-448, NaN kept),
// packed as the bytes lo then hi.
__device__ __forceinline__ unsigned short fp8_e4m3x2(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
// The largest magnitude over a warp's values (NaN ignored, as fmaxf does).
__device__ __forceinline__ float warp_amax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ------------------------------------------------------------ e4m3 wgmma
// d (+)= A * B for one m64 x N x k32 step, A and B both K-major in shared
// memory (8-bit wgmma has no transposed operands): `accumulate` 0 starts d
// over. The wrappers are generated (tile_library.cpp), one per N.
template <int N> struct WgmmaE4m3;
// MOEFORGE_WGMMA_E4M3_INSTANCES

// C = A B over e4m3 operands with a float32 scale per 128-deep block of
// each: A [M, K] by rows (DeepSeek-V3's 1 x 128 blocks: one scale per row
// and block), B stored [N, K] (K-major) with one scale per 128 x 128 block.
// K runs in stages of 128, one block each: a stage's four k32 wgmmas sum
// into `part`, which is then added into the accumulators times the row's
// and the column block's scales, so the tensor cores' reduced-precision
// sums never run longer than 128 products (the promotion DeepSeek-V3 and
// DeepGEMM use). Both operands stage as 128-byte rows in the 128-byte
// swizzle (chunk c of row r at c ^ (r & 7)): the byte layout of the bf16
// loops' K-major tiles, so their descriptors serve unchanged (a k32 step of
// e4m3 is 32 bytes on, as a k16 step of bf16 is).
//
// The operands' rows are stored K_pad = ceil(K / 128) * 128 bytes apart,
// zero past K (the quantising kernels write them so), so K needs no
// bounds: a stage is always whole.
template <int BN_, int STAGES_> struct Fp8WgmmaConfig {
  static constexpr int BM = 128, BN = BN_, BK = 128, STAGES = STAGES_;
  static constexpr int WG = BM / 64, THREADS = WG * 128;
  static constexpr int A_STAGE_BYTES = BM * 128, B_STAGE_BYTES = BN * 128;
  static constexpr int STAGE_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024; // + alignment slack
  static constexpr int A_ITERS = BM * 8 / THREADS, B_ITERS = BN * 8 / THREADS;
  static_assert(BN == 64 || BN == 128, "an FP8 tile keeps two accumulator sets: at most 128 columns");
  static_assert(BN * 8 % THREADS == 0, "B's chunks spread evenly over the threads");
  static_assert(STAGES >= 2, "loads run a stage ahead of the wgmmas");

  typedef float Acc[BN / 2];
  // Where accumulator e of column group ni lies (the wgmma D fragment, as
  // for bf16: it depends on M and N only).
  __device__ static __forceinline__ int acc_row(int warp, int lane, int e) {
    return (warp >> 2) * 64 + (warp & 3) * 16 + (lane >> 2) + ((e >> 1) & 1) * 8;
  }
  __device__ static __forceinline__ int acc_col(int lane, int ni, int e) { return ni * 8 + (lane & 3) * 2 + (e & 1); }
  __device__ static __forceinline__ unsigned off(int row, int ch) { return row * 128 + ((ch ^ (row & 7)) << 4); }

  // Copies k-stage kt into `slot`: A's rows through this thread's pointers
  // (a row past the tile is zero-filled), B's rows n0 .. n0 + BN - 1 of a
  // K-major operand (zero past N).
  __device__ static __forceinline__ void load_stage(unsigned s0, int slot, int kt,
                                                    const unsigned char *const (&gA)[A_ITERS],
                                                    const bool (&a_ok)[A_ITERS], const unsigned char *gB, long long ldb,
                                                    int N, int n0) {
    const int tid = threadIdx.x, ch = tid & 7;
    const unsigned sA = s0 + slot * STAGE_BYTES, sB = sA + A_STAGE_BYTES;
    const int k0 = kt * BK + ch * 16;
#pragma unroll
    for (int i = 0; i < A_ITERS; ++i) {
      const int row = (tid + i * THREADS) >> 3;
      cp_async_16(sA + off(row, ch), a_ok[i] ? gA[i] + k0 : gA[i], a_ok[i]);
    }
#pragma unroll
    for (int i = 0; i < B_ITERS; ++i) {
      const int n = (tid + i * THREADS) >> 3;
      const bool ok = n0 + n < N;
      cp_async_16(sB + off(n, ch), ok ? gB + (long long)(n0 + n) * ldb + k0 : gB, ok);
    }
  }

  // Warpgroup wg's four k32 wgmmas over stage `slot` into part (overwritten).
  __device__ static __forceinline__ void mma_stage(unsigned s0, int slot, int wg, Acc &part) {
    const unsigned sA = s0 + slot * STAGE_BYTES + wg * (64 * 128), sB = s0 + slot * STAGE_BYTES + A_STAGE_BYTES;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < BK / 32; ++ks)
      WgmmaE4m3<BN>::mma(part, wgmma_desc(sA + ks * 32, 16, 1024), wgmma_desc(sB + ks * 32, 16, 1024), ks > 0);
    wgmma_commit();
  }

  // acc = sum over the KT stages of (A_kt B_kt) times the stage's scales,
  // which `scales` gives (RowBlockScales, RowColumnScales below): its
  // stage(kt) reads them before the stage's wait, so their latency hides
  // under it, and Stage::factor(i) is accumulator i's product of the two.
  template <typename Scales>
  __device__ static void mainloop(unsigned char *smem, int KT, const unsigned char *const (&gA)[A_ITERS],
                                  const bool (&a_ok)[A_ITERS], const unsigned char *gB, long long ldb, int N, int n0,
                                  const Scales &scales, Acc &acc) {
    const int tid = threadIdx.x, wg = tid >> 7;
    const unsigned s0 = (smem_u32(smem) + 1023u) & ~1023u; // swizzle atoms are 1024-byte aligned
#pragma unroll
    for (int i = 0; i < BN / 2; ++i)
      acc[i] = 0.f;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < KT)
        load_stage(s0, s, s, gA, a_ok, gB, ldb, N, n0);
      cp_async_commit();
    }
    Acc part;
    for (int kt = 0; kt < KT; ++kt) {
      const typename Scales::Stage st = scales.stage(kt);
      cp_async_wait<STAGES - 2>();
      fence_proxy_async();
      __syncthreads();
      mma_stage(s0, kt % STAGES, wg, part);
      wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < BN / 2; ++i)
        acc[i] += part[i] * st.factor(i);
      // Every warpgroup is done with this slot before it is refilled.
      __syncthreads();
      const int next = kt + STAGES - 1;
      if (next < KT)
        load_stage(s0, next % STAGES, next, gA, a_ok, gB, ldb, N, n0);
      cp_async_commit();
    }
    cp_async_wait<0>();
  }

  // The tile's output rounded to e4m3 as the operand of a next product (the
  // rounding in the producer's epilogue, so no pass reads the output again):
  // each row's 128 columns here are one 1 x 128 block (BN 128, the tile at a
  // multiple of 128 columns), rounded from their bf16 values (dsl/fp8.h:
  // what a stored bf16 output would hold), zero past N. Row lr of the tile
  // (lr < rows) goes to q at out_row(lr) * ld_q + n0 and its scale to
  // scales[out_row(lr) * scale_stride + n0 / 128]. The four lanes of a quad
  // hold a row's 128 columns between them (32 each): a row's maximum is
  // theirs, two shuffles.
  template <typename OutRow>
  __device__ static void store_e4m3_rows(const Acc &acc, int warp, int lane, int n0, int N, int rows, OutRow out_row,
                                         unsigned char *q, long long ld_q, float *scales, long long scale_stride) {
    static_assert(BN == 128, "a tile's row is one 1 x 128 block");
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v[BN / 4];
      float amax = 0.f;
#pragma unroll
      for (int ni = 0; ni < BN / 8; ++ni)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int col = n0 + acc_col(lane, ni, j);
          const float x = col < N ? __bfloat162float(__float2bfloat16(acc[ni * 4 + 2 * h + j])) : 0.f;
          v[ni * 2 + j] = x;
          amax = fmaxf(amax, fabsf(x));
        }
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      const int e = fp8_e4m3_scale_exponent(amax), lr = acc_row(warp, lane, 2 * h);
      if (lr >= rows)
        continue;
      const long long r = out_row(lr);
      unsigned char *row = q + r * ld_q + n0;
#pragma unroll
      for (int ni = 0; ni < BN / 8; ++ni)
        *reinterpret_cast<unsigned short *>(row + acc_col(lane, ni, 0)) =
            fp8_e4m3x2(ldexpf(v[ni * 2], -e), ldexpf(v[ni * 2 + 1], -e));
      if ((lane & 3) == 0)
        scales[r * scale_stride + n0 / 128] = ldexpf(1.f, e);
    }
  }

  // A scale per row of A and 128-deep block (its 1 x 128 blocks), one per
  // block of B's columns (a weight's 128 x 128 blocks): rows[h] points at
  // this thread's accumulator rows' scales (rows[0] for e < 2, rows[1] for
  // e >= 2; a row past the tile may point at any valid scale: its sums are
  // never stored), a_stride apart per block; b at the column block's scale
  // of block 0, b_stride apart.
  struct RowBlockScales {
    const float *rows[2];
    long long a_stride;
    const float *b;
    long long b_stride;
    struct Stage {
      float lo, hi;
      __device__ float factor(int i) const { return (i & 2) ? hi : lo; }
    };
    __device__ Stage stage(int kt) const {
      const float sb = b[kt * b_stride];
      return {rows[0][kt * a_stride] * sb, rows[1][kt * a_stride] * sb};
    }
  };

  // A scale per row of A and per column of B in each 128-deep block (both
  // operands by rows along K: a weight gradient's, whose K is an expert's
  // pairs): rows as above; cols at this thread's first accumulator column's
  // scale of block 0 (columns lane % 4 * 2 + 8 ni and the next, clamped
  // below `last`, the columns before N), b_stride apart per block.
  struct RowColumnScales {
    const float *rows[2];
    long long a_stride;
    const float *cols;
    int cols_left; // columns of the tile at and after this thread's first, before N
    long long b_stride;
    struct Stage {
      float lo, hi;
      float col[BN / 4];
      __device__ float factor(int i) const { return ((i & 2) ? hi : lo) * col[(i >> 2) * 2 + (i & 1)]; }
    };
    __device__ Stage stage(int kt) const {
      Stage st;
      st.lo = rows[0][kt * a_stride];
      st.hi = rows[1][kt * a_stride];
      const float *c = cols + kt * b_stride;
#pragma unroll
      for (int ni = 0; ni < BN / 8; ++ni)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          st.col[ni * 2 + j] = c[min(ni * 8 + j, cols_left - 1)];
      return st;
    }
  };
};

} // namespace mf
