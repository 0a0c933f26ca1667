// FP8 kernels (runtime/fp8_kernels.h launches them): the block rounding of
// dsl/fp8.h into e4m3 bytes and float32 scales, and the batched e4m3 GEMM
// over such operands (tiles/fp8.cuh). NVRTC input with the tile library.
//
// The e4m3 layout every kernel here shares: an operand is a row-major byte
// matrix whose rows are K_pad = ceil(K / 128) * 128 bytes apart and zero
// past K, with the contracted index along the row, so a GEMM reads it
// K-major in whole 128-deep blocks.
#include "moeforge_tiles.cuh"

#ifndef MF_FP8_GEMM_BN
#define MF_FP8_GEMM_BN 128
#endif
#ifndef MF_FP8_GEMM_STAGES
#define MF_FP8_GEMM_STAGES 4
#endif

typedef mf::Fp8WgmmaConfig<MF_FP8_GEMM_BN, MF_FP8_GEMM_STAGES> Fp8Tile;

// Rows of activations in 1 x 128 blocks: a warp per block, four values a
// lane. x: rows x K bf16, ld_x apart (row_index, if given, names the row
// of x that output row r rounds: a gathered operand). q: rows x K_pad bytes;
// scales: rows x ceil(K / 128) floats.
extern "C" __global__ void __launch_bounds__(256)
    mf_fp8_quantize_rows(const mf::bf16 *__restrict__ x, long long ld_x, const int *__restrict__ row_index, int rows,
                         int K, unsigned char *__restrict__ q, float *__restrict__ scales) {
  const int KB = (K + 127) / 128, lane = threadIdx.x & 31;
  const long long block = (long long)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (block >= (long long)rows * KB)
    return;
  const int r = (int)(block / KB), kb = (int)(block % KB), k = kb * 128 + lane * 4;
  const long long src = row_index ? row_index[r] : r;
  float v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    v[j] = k + j < K ? __bfloat162float(x[src * ld_x + k + j]) : 0.f;
  const float amax = mf::warp_amax(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
  const int e = mf::fp8_e4m3_scale_exponent(amax);
  const unsigned lo = mf::fp8_e4m3x2(ldexpf(v[0], -e), ldexpf(v[1], -e)),
                 hi = mf::fp8_e4m3x2(ldexpf(v[2], -e), ldexpf(v[3], -e));
  *reinterpret_cast<unsigned *>(q + (long long)r * (KB * 128) + k) = lo | (hi << 16);
  if (lane == 0)
    scales[(long long)r * KB + kb] = ldexpf(1.f, e);
}

// A weight W [R, C] (bf16, row-major, batch z at w + z * stride_w) in 128 x
// 128 blocks, a block of 256 threads per block of W. One grid of scales
// serves both products a weight enters (DeepSeek-V3's recipe): written in
// its own layout to q (R x C_pad bytes: the K-major operand of a product
// contracting C, G W^T) and transposed to q_t (C x R_pad bytes: of one
// contracting R, X W); either may be null. scales: ceil(R / 128) x
// ceil(C / 128) floats per batch.
extern "C" __global__ void __launch_bounds__(256)
    mf_fp8_quantize_weight(const mf::bf16 *__restrict__ w, long long stride_w, int R, int C,
                           unsigned char *__restrict__ q, unsigned char *__restrict__ q_t, float *__restrict__ scales) {
  __shared__ unsigned char s_q[128][132]; // padded rows: the transposed reads spread over the banks
  __shared__ float s_amax[8];
  const int RB = (R + 127) / 128, CB = (C + 127) / 128, z = blockIdx.z;
  const int r0 = blockIdx.y * 128, c0 = blockIdx.x * 128, tid = threadIdx.x;
  const long long R_pad = RB * 128LL, C_pad = CB * 128LL;
  w += z * stride_w;
  // 64 values a thread: row tid / 64 + 4 i, columns 2 (tid % 64) and the next.
  const int c = (tid & 63) * 2;
  float v[32][2];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int r = (tid >> 6) + 4 * i;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const bool in = r0 + r < R && c0 + c + j < C;
      v[i][j] = in ? __bfloat162float(w[(long long)(r0 + r) * C + c0 + c + j]) : 0.f;
      amax = fmaxf(amax, fabsf(v[i][j]));
    }
  }
  amax = mf::warp_amax(amax);
  if ((tid & 31) == 0)
    s_amax[tid >> 5] = amax;
  __syncthreads();
  amax = s_amax[0];
#pragma unroll
  for (int i = 1; i < 8; ++i)
    amax = fmaxf(amax, s_amax[i]);
  const int e = mf::fp8_e4m3_scale_exponent(amax);
  if (tid == 0)
    scales[(long long)z * RB * CB + (long long)blockIdx.y * CB + blockIdx.x] = ldexpf(1.f, e);
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int r = (tid >> 6) + 4 * i;
    const unsigned short b = mf::fp8_e4m3x2(ldexpf(v[i][0], -e), ldexpf(v[i][1], -e));
    s_q[r][c] = (unsigned char)(b & 0xff);
    s_q[r][c + 1] = (unsigned char)(b >> 8);
    if (q && r0 + r < R)
      *reinterpret_cast<unsigned short *>(q + z * (R * C_pad) + (long long)(r0 + r) * C_pad + c0 + c) = b;
  }
  if (!q_t)
    return;
  __syncthreads();
  // q_t's row c0 + cc holds column cc of the block: 128 bytes, a thread's two.
#pragma unroll 4
  for (int i = 0; i < 32; ++i) {
    const int cc = (tid >> 6) + 4 * i, rr = (tid & 63) * 2;
    if (c0 + cc < C) {
      const unsigned short b = (unsigned short)(s_q[rr][cc] | (s_q[rr + 1][cc] << 8));
      *reinterpret_cast<unsigned short *>(q_t + z * (C * R_pad) + (long long)(c0 + cc) * R_pad + r0 + rr) = b;
    }
  }
}

// An e4m3 output: the product rounded in the epilogue into the operand of a
// next product (rows of ld_q bytes) and its 1 x 128 scales (scale_stride a
// row).
struct Fp8Out {
  unsigned char *q;
  float *scales;
  long long ld_q, scale_stride;
};

template <typename T> struct IsFp8Out { static constexpr bool value = false; };
template <> struct IsFp8Out<Fp8Out> { static constexpr bool value = true; };

__device__ __forceinline__ void fp8_put(float *p, float v) { *p = v; }
__device__ __forceinline__ void fp8_put(mf::bf16 *p, float v) { *p = __float2bfloat16(v); }

// A routed product's rows (runtime/routing_format.h): tile t of a block of
// 128 rows holds rows tile_row_start[t] .. + tile_rows[t] of the padded
// order, all of expert tile_expert[t]. A's row of padded row p is p itself,
// or, with a_rows (sorted_pair: the pair of each padded row), a_rows[p] /
// a_row_div (x's token row of pair r is r / k). Null tile_expert: a dense
// batch (blockIdx.z) of M rows. The same layout as Fp8RouteArg in
// runtime/fp8_kernels.cpp.
struct Fp8Route {
  const int *tile_expert, *tile_row_start, *tile_rows, *num_tiles, *a_rows;
  int a_row_div;
};

// C = A B^T over e4m3 operands (the layout above; A: rows, B: N rows per
// batch or expert, both K_pad bytes apart) with their scales: a_scales one
// row of KB per A row, b_scales (KB, NB) or (NB, KB) per batch
// (b_scale_k_major: 1 when the K block is the grid's first index: a
// weight's q_t, whose block grid is (R / 128, C / 128) with R = K). Output
// C f32 or bf16 (OUT), ld_c apart. Dense: batch z's A, scales and C at
// a + z * stride_a, a_scales + z * M * KB and c + z * stride_c, M rows.
// Routed: A's rows as Fp8Route says, C's rows in the padded order. A
// block of 256 threads per 128 x BN tile.
template <typename OUT>
__device__ __forceinline__ void fp8_gemm(const unsigned char *__restrict__ a, long long stride_a,
                                         const float *__restrict__ a_scales, const unsigned char *__restrict__ b,
                                         long long stride_b, const float *__restrict__ b_scales, int b_scale_k_major,
                                         OUT *__restrict__ c, long long stride_c, int ld_c, int M, int N, int K,
                                         const Fp8Route &route) {
  extern __shared__ unsigned char smem[];
  const int KB = (K + 127) / 128, NB = (N + 127) / 128;
  const long long ld = KB * 128LL;
  const int n0 = blockIdx.x * Fp8Tile::BN;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // This tile: its B (batch or expert), first output row and rows.
  int batch = blockIdx.z, row0 = blockIdx.y * Fp8Tile::BM, rows = M - row0;
  if (route.tile_expert) {
    const int t = blockIdx.y;
    if (t >= *route.num_tiles)
      return;
    batch = route.tile_expert[t];
    row0 = route.tile_row_start[t];
    rows = route.tile_rows[t];
  } else {
    a += batch * stride_a;
    a_scales += (long long)batch * M * KB;
    if constexpr (!IsFp8Out<OUT>::value)
      c += batch * stride_c;
  }
  b += batch * stride_b;
  b_scales += (long long)batch * KB * NB;
  // A's row of the tile's row lr, or -1 past its rows.
  auto a_row = [&](int lr) -> long long {
    if (lr >= rows)
      return -1;
    if (!route.a_rows)
      return row0 + lr;
    const int pair = route.a_rows[row0 + lr]; // -1: a padding row
    return pair < 0 ? -1 : pair / route.a_row_div;
  };
  const unsigned char *gA[Fp8Tile::A_ITERS];
  bool a_ok[Fp8Tile::A_ITERS];
#pragma unroll
  for (int i = 0; i < Fp8Tile::A_ITERS; ++i) {
    const long long r = a_row((tid + i * Fp8Tile::THREADS) >> 3);
    a_ok[i] = r >= 0;
    gA[i] = a + (a_ok[i] ? r * ld : 0);
  }
  // This thread's two accumulator rows' scales (A's first row's where a row
  // is past the tile: its sums are never stored).
  Fp8Tile::RowBlockScales scales;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const long long r = a_row(Fp8Tile::acc_row(warp, lane, 2 * h));
    scales.rows[h] = a_scales + (r >= 0 ? r : 0) * KB;
  }
  scales.a_stride = 1;
  // A tile of BN <= 128 columns lies in one column block of 128.
  const int nb = n0 / 128;
  scales.b = b_scales + (b_scale_k_major ? nb : (long long)nb * KB);
  scales.b_stride = b_scale_k_major ? NB : 1;
  Fp8Tile::Acc acc;
  Fp8Tile::mainloop(smem, KB, gA, a_ok, b, ld, N, n0, scales, acc);
  if constexpr (IsFp8Out<OUT>::value) {
    // A dense batch's rows follow the batches before it (M each).
    const long long first = route.tile_expert ? row0 : (long long)batch * M + row0;
    Fp8Tile::store_e4m3_rows(
        acc, warp, lane, n0, N, rows, [&](int lr) { return first + lr; }, c->q, c->ld_q, c->scales, c->scale_stride);
  } else {
#pragma unroll
    for (int i = 0; i < Fp8Tile::BN / 2; ++i) {
      const int ni = i >> 2, e = i & 3;
      const int lr = Fp8Tile::acc_row(warp, lane, e), col = n0 + Fp8Tile::acc_col(lane, ni, e);
      if (lr < rows && col < N)
        fp8_put(c + (long long)(row0 + lr) * ld_c + col, acc[i]);
    }
  }
}

extern "C" __global__ void __launch_bounds__(Fp8Tile::THREADS, 1)
    mf_fp8_gemm_f32(const unsigned char *a, long long stride_a, const float *a_scales, const unsigned char *b,
                    long long stride_b, const float *b_scales, int b_scale_k_major, float *c, long long stride_c,
                    int ld_c, int M, int N, int K, Fp8Route route) {
  fp8_gemm<float>(a, stride_a, a_scales, b, stride_b, b_scales, b_scale_k_major, c, stride_c, ld_c, M, N, K, route);
}
extern "C" __global__ void __launch_bounds__(Fp8Tile::THREADS, 1)
    mf_fp8_gemm_bf16(const unsigned char *a, long long stride_a, const float *a_scales, const unsigned char *b,
                     long long stride_b, const float *b_scales, int b_scale_k_major, mf::bf16 *c, long long stride_c,
                     int ld_c, int M, int N, int K, Fp8Route route) {
  fp8_gemm<mf::bf16>(a, stride_a, a_scales, b, stride_b, b_scales, b_scale_k_major, c, stride_c, ld_c, M, N, K, route);
}
// The product rounded to e4m3 in the epilogue (Fp8Out: rows of ld_q bytes,
// a batch's rows after the batches before it), as the operand of a next
// product: the output stored as that product's operand directly. The
// 128-column tile only (Fp8WgmmaConfig::store_e4m3_rows).
#if MF_FP8_GEMM_BN == 128
extern "C" __global__ void __launch_bounds__(Fp8Tile::THREADS, 1)
    mf_fp8_gemm_e4m3(const unsigned char *a, long long stride_a, const float *a_scales, const unsigned char *b,
                     long long stride_b, const float *b_scales, int b_scale_k_major, Fp8Out out, int M, int N, int K,
                     Fp8Route route) {
  fp8_gemm<Fp8Out>(a, stride_a, a_scales, b, stride_b, b_scales, b_scale_k_major, &out, 0, 0, M, N, K, route);
}
#endif

// A weight gradient's operands: the rows of a routed tensor in the padded
// order (gather: x's row a_rows[p] / a_row_div, a gathered operand; else
// row p of x; either way zero where a_rows[p] < 0, a padding row), rounded in blocks of 128 rows (a routing tile, 128
// of one expert's pairs: dsl/fp8.h's blocks of a weight gradient) by one column, stored transposed, the pairs along the
// row: q_t, C rows of ld_q = 128 * max_tiles bytes; scales [max_tiles][C]. A block of 256 threads per routing tile and
// 128 columns; tiles past *num_tiles are left as they are (no expert's K reaches them).
extern "C" __global__ void __launch_bounds__(256)
    mf_fp8_quantize_tiles_t(const mf::bf16 *__restrict__ x, long long ld_x, const int *__restrict__ a_rows, int gather,
                            int a_row_div, const int *__restrict__ num_tiles, long long ld_q, int C,
                            unsigned char *__restrict__ q_t, float *__restrict__ scales) {
  __shared__ __align__(16) unsigned char s_q[128][144]; // [column][row]; 16-byte rows for the stores
  __shared__ float s_amax[2][128];
  const int t = blockIdx.y;
  if (t >= *num_tiles)
    return;
  const int tid = threadIdx.x, cc = tid & 127, half = tid >> 7, c0 = blockIdx.x * 128, col = c0 + cc;
  // This thread: column cc, rows 64 half .. 64 half + 63 of the tile.
  float v[64];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    const long long p = (long long)t * 128 + half * 64 + i;
    const int pair = a_rows[p];
    const long long src = pair < 0 ? -1 : gather ? pair / a_row_div : p;
    v[i] = src >= 0 && col < C ? __bfloat162float(x[src * ld_x + col]) : 0.f;
    amax = fmaxf(amax, fabsf(v[i]));
  }
  s_amax[half][cc] = amax;
  __syncthreads();
  const int e = mf::fp8_e4m3_scale_exponent(fmaxf(s_amax[0][cc], s_amax[1][cc]));
  if (half == 0 && col < C)
    scales[(long long)t * C + col] = ldexpf(1.f, e);
#pragma unroll
  for (int i = 0; i < 64; i += 2)
    *reinterpret_cast<unsigned short *>(&s_q[cc][half * 64 + i]) =
        mf::fp8_e4m3x2(ldexpf(v[i], -e), ldexpf(v[i + 1], -e));
  __syncthreads();
  // Row c0 + r of q_t: this tile's 128 bytes of column r, eight 16-byte chunks.
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int idx = tid + j * 256, r = idx >> 3, ch = idx & 7;
    if (c0 + r < C)
      *reinterpret_cast<uint4 *>(q_t + (long long)(c0 + r) * ld_q + (long long)t * 128 + ch * 16) =
          *reinterpret_cast<const uint4 *>(&s_q[r][ch * 16]);
  }
}

// A weight gradient by expert: c[e] (M x N, f32 or bf16, dense, batch e at
// c + e * M * N) = the sum over expert e's padded rows of a_t's and b_t's
// columns' products (mf_fp8_quantize_tiles_t's operands: M and N rows of
// ld_q bytes, scales [tiles][M] and [tiles][N]). offsets: the routing's
// padded offsets (E + 1), multiples of 128: an expert's tiles are its
// 128-deep blocks. An expert without pairs gets zeros.
template <typename OUT>
__device__ __forceinline__ void
fp8_gemm_expert_k(const unsigned char *__restrict__ a_t, const float *__restrict__ a_scales,
                  const unsigned char *__restrict__ b_t, const float *__restrict__ b_scales,
                  const int *__restrict__ offsets, long long ld_q, OUT *__restrict__ c, int M, int N) {
  extern __shared__ unsigned char smem[];
  const int e = blockIdx.z, m0 = blockIdx.y * Fp8Tile::BM, n0 = blockIdx.x * Fp8Tile::BN;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int p0 = offsets[e], KT = (offsets[e + 1] - p0) / 128, t0 = p0 / 128;
  const unsigned char *gA[Fp8Tile::A_ITERS];
  bool a_ok[Fp8Tile::A_ITERS];
#pragma unroll
  for (int i = 0; i < Fp8Tile::A_ITERS; ++i) {
    const int row = m0 + ((tid + i * Fp8Tile::THREADS) >> 3);
    a_ok[i] = row < M;
    gA[i] = a_t + (a_ok[i] ? (long long)row * ld_q + p0 : 0);
  }
  Fp8Tile::RowColumnScales scales;
#pragma unroll
  for (int h = 0; h < 2; ++h)
    scales.rows[h] = a_scales + (long long)t0 * M + min(m0 + Fp8Tile::acc_row(warp, lane, 2 * h), M - 1);
  scales.a_stride = M;
  const int first = n0 + Fp8Tile::acc_col(lane, 0, 0);
  scales.cols = b_scales + (long long)t0 * N + min(first, N - 1);
  scales.cols_left = max(N - first, 1);
  scales.b_stride = N;
  Fp8Tile::Acc acc;
  Fp8Tile::mainloop(smem, KT, gA, a_ok, b_t + p0, ld_q, N, n0, scales, acc);
  c += (long long)e * M * N;
#pragma unroll
  for (int i = 0; i < Fp8Tile::BN / 2; ++i) {
    const int ni = i >> 2, el = i & 3;
    const int row = m0 + Fp8Tile::acc_row(warp, lane, el), col = n0 + Fp8Tile::acc_col(lane, ni, el);
    if (row < M && col < N)
      fp8_put(c + (long long)row * N + col, acc[i]);
  }
}

extern "C" __global__ void __launch_bounds__(Fp8Tile::THREADS, 1)
    mf_fp8_gemm_expert_k_f32(const unsigned char *a_t, const float *a_scales, const unsigned char *b_t,
                             const float *b_scales, const int *offsets, long long ld_q, float *c, int M, int N) {
  fp8_gemm_expert_k<float>(a_t, a_scales, b_t, b_scales, offsets, ld_q, c, M, N);
}
extern "C" __global__ void __launch_bounds__(Fp8Tile::THREADS, 1)
    mf_fp8_gemm_expert_k_bf16(const unsigned char *a_t, const float *a_scales, const unsigned char *b_t,
                              const float *b_scales, const int *offsets, long long ld_q, mf::bf16 *c, int M, int N) {
  fp8_gemm_expert_k<mf::bf16>(a_t, a_scales, b_t, b_scales, offsets, ld_q, c, M, N);
}
