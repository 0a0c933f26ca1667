// moeforge's tile library, part 'attention' (backends/cuda/device/tiles.cuh
// includes every part; NVRTC sees this one as "moeforge_tiles_attention.cuh").
// An attention row by one warp (AttentionStep, lowering/fuse_attention.h):
// the softmax over the tokens taken online, so no row of scores is stored.
#pragma once
#include "moeforge_tiles_mma_sync.cuh"

namespace mf {

// out[c] = sum over u < T of softmax_u(scale * q . key[u]) * value[u][c],
// for one row: q [FK], key [T][FK], value [T][FV], out [FV]; the calling
// warp's 32 lanes each hold columns lane, lane + 32, ... of q and of the
// sum. `live` false: the row is padding, written as zeros. Tokens go U at
// a time, their dot products reduced across the warp side by side (their
// shuffles independent), then folded into the running maximum m and sum l:
// a larger maximum rescales what was summed before it by exp(m - m_new).
template <int FK, int FV, typename TQ, typename TK, typename TV, typename TO>
__device__ __forceinline__ void attention_row_warp(const TQ *__restrict__ q, const TK *__restrict__ key,
                                                   const TV *__restrict__ value, TO *out, long long T, float scale,
                                                   bool live) {
  constexpr int QK = (FK + 31) / 32, QV = (FV + 31) / 32, U = 4;
  const int lane = threadIdx.x & 31;
  float qr[QK], acc[QV];
#pragma unroll
  for (int i = 0; i < QK; ++i)
    qr[i] = live && lane + 32 * i < FK ? to_f32(q[lane + 32 * i]) * scale : 0.f;
#pragma unroll
  for (int c = 0; c < QV; ++c)
    acc[c] = 0.f;
  float m = __int_as_float(0xff800000), l = 0.f; // -inf
  for (long long u0 = 0; live && u0 < T; u0 += U) {
    float s[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      s[j] = 0.f;
      if (u0 + j < T)
#pragma unroll
        for (int i = 0; i < QK; ++i)
          if (lane + 32 * i < FK)
            s[j] += qr[i] * to_f32(key[(u0 + j) * FK + lane + 32 * i]);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
#pragma unroll
      for (int j = 0; j < U; ++j)
        s[j] += __shfl_xor_sync(0xffffffffu, s[j], off);
    float m_new = m;
#pragma unroll
    for (int j = 0; j < U; ++j)
      if (u0 + j < T)
        m_new = fmaxf(m_new, s[j]);
    const float rescale = __expf(m - m_new); // 0 at the first tokens (m = -inf)
    l *= rescale;
#pragma unroll
    for (int c = 0; c < QV; ++c)
      acc[c] *= rescale;
#pragma unroll
    for (int j = 0; j < U; ++j) {
      if (u0 + j >= T)
        break;
      const float w = __expf(s[j] - m_new);
      l += w;
#pragma unroll
      for (int c = 0; c < QV; ++c)
        if (lane + 32 * c < FV)
          acc[c] += w * to_f32(value[(u0 + j) * FV + lane + 32 * c]);
    }
    m = m_new;
  }
  const float inv = live && l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int c = 0; c < QV; ++c)
    if (lane + 32 * c < FV)
      out[lane + 32 * c] = from_f32<TO>(acc[c] * inv);
}

// The same for 16 rows a warp on the tensor cores (mma.sync m16n8k16, bf16
// operands, f32 sums), FlashAttention-2's loop: per block of 64 tokens the
// warp makes its 16 x 64 scores S = q key^T, folds them into each row's
// running maximum and sum, and adds exp(S - max) value onto its 16 x FV
// output. q, key and value are bf16 with FK a multiple of 16 and FV of 8;
// rows `row0` .. row0 + 15 of q and out, those at or past `rows` and those
// with live_row() false (padding) written as zeros. Fragments are loaded
// straight from global memory (key and value blocks are read by every warp
// of the grid, so they come from L2 and L1): a thread's pair of adjacent
// bf16 is one 32-bit load, except value's, whose pairs lie a row apart.
// Fragment layouts (PTX, m16n8k16): g = lane / 4, t = lane % 4; A's four
// registers hold rows g, g + 8 at columns 2t, 2t + 1, then the same at
// columns + 8; B's two hold rows (k) 2t, 2t + 1 and 2t + 8, 2t + 9 of
// column (n) g; C's four floats rows g (c0, c1) and g + 8 (c2, c3) at
// columns 2t, 2t + 1. C's layout over two n-tiles is A's over one k-chunk,
// so exp(S) becomes the next product's A without leaving registers.
template <int FK, int FV, typename TO, typename Live>
__device__ __forceinline__ void attention_rows_mma(const bf16 *__restrict__ q, const bf16 *__restrict__ key,
                                                   const bf16 *__restrict__ value, TO *out, long long row0,
                                                   long long rows, long long T, float scale, Live live_row) {
  static_assert(FK % 16 == 0 && FV % 8 == 0, "head dims: FK a multiple of 16, FV of 8");
  constexpr int KC = FK / 16, NV = FV / 8, BT = 64, NS = BT / 8;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const long long ra = row0 + g, rb = row0 + g + 8; // this thread's two rows
  const bool la = ra < rows && live_row(ra), lb = rb < rows && live_row(rb);
  auto pair = [](const bf16 *p) { return *reinterpret_cast<const unsigned *>(p); };
  unsigned qa[KC][4]; // (16, FK): the A fragments of q, for every k-chunk
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    const int c = kc * 16 + 2 * t;
    qa[kc][0] = la ? pair(q + ra * FK + c) : 0u;
    qa[kc][1] = lb ? pair(q + rb * FK + c) : 0u;
    qa[kc][2] = la ? pair(q + ra * FK + c + 8) : 0u;
    qa[kc][3] = lb ? pair(q + rb * FK + c + 8) : 0u;
  }
  float o[NV][4]; // (16, FV): the output's accumulators
#pragma unroll
  for (int n = 0; n < NV; ++n)
    o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  const float neg_inf = __int_as_float(0xff800000);
  float ma = neg_inf, mb = neg_inf, la_sum = 0.f, lb_sum = 0.f; // rows g, g + 8: maximum, this thread's sum
  for (long long u0 = 0; u0 < T && (__any_sync(0xffffffffu, la || lb)); u0 += BT) {
    float sc[NS][4]; // (16, 64): the scores of this block of tokens
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
      const long long u = u0 + j * 8 + g; // B's column: token u
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
        const int c = kc * 16 + 2 * t;
        const unsigned b0 = u < T ? pair(key + u * FK + c) : 0u, b1 = u < T ? pair(key + u * FK + c + 8) : 0u;
        mma_16816(sc[j], qa[kc], b0, b1);
      }
    }
    // Scaled, past-the-end tokens at -inf; each row's block maximum over
    // its quad's four threads.
    float mxa = neg_inf, mxb = neg_inf;
#pragma unroll
    for (int j = 0; j < NS; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const long long u = u0 + j * 8 + 2 * t + (e & 1);
        sc[j][e] = u < T ? sc[j][e] * scale : neg_inf;
        if (e < 2)
          mxa = fmaxf(mxa, sc[j][e]);
        else
          mxb = fmaxf(mxb, sc[j][e]);
      }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
      mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, off));
      mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, off));
    }
    const float na = fmaxf(ma, mxa), nb = fmaxf(mb, mxb);
    const float ra_scale = __expf(ma - na), rb_scale = __expf(mb - nb); // 0 at the first block
    ma = na;
    mb = nb;
    la_sum *= ra_scale;
    lb_sum *= rb_scale;
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      o[n][0] *= ra_scale;
      o[n][1] *= ra_scale;
      o[n][2] *= rb_scale;
      o[n][3] *= rb_scale;
    }
    // exp(S - max) as bf16 A fragments, 16 tokens (two n-tiles) a chunk.
    unsigned pa[NS / 2][4];
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      const float p0 = __expf(sc[j][0] - na), p1 = __expf(sc[j][1] - na);
      const float p2 = __expf(sc[j][2] - nb), p3 = __expf(sc[j][3] - nb);
      la_sum += p0 + p1;
      lb_sum += p2 + p3;
      __nv_bfloat162 top = __floats2bfloat162_rn(p0, p1), bottom = __floats2bfloat162_rn(p2, p3);
      pa[j / 2][(j & 1) * 2 + 0] = *reinterpret_cast<unsigned *>(&top);
      pa[j / 2][(j & 1) * 2 + 1] = *reinterpret_cast<unsigned *>(&bottom);
    }
    // o += exp(S - max) value: B's rows (k) are tokens 2t, 2t + 1 (+ 8) of
    // the chunk, its column (n) the value column n * 8 + g.
#pragma unroll
    for (int kc = 0; kc < NS / 2; ++kc) {
      const long long u = u0 + kc * 16 + 2 * t;
      const unsigned short *v = reinterpret_cast<const unsigned short *>(value);
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const long long col = n * 8 + g;
        auto at = [&](long long uu) { return uu < T ? (unsigned)v[uu * FV + col] : 0u; };
        const unsigned b0 = at(u) | (at(u + 1) << 16), b1 = at(u + 8) | (at(u + 9) << 16);
        mma_16816(o[n], pa[kc], b0, b1);
      }
    }
  }
  // Each row's sum over its quad, then the rows out (zeros for padding).
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    la_sum += __shfl_xor_sync(0xffffffffu, la_sum, off);
    lb_sum += __shfl_xor_sync(0xffffffffu, lb_sum, off);
  }
  const float ia = la && la_sum > 0.f ? 1.f / la_sum : 0.f, ib = lb && lb_sum > 0.f ? 1.f / lb_sum : 0.f;
#pragma unroll
  for (int n = 0; n < NV; ++n) {
    const int c = n * 8 + 2 * t;
    if (ra < rows) {
      out[ra * FV + c] = from_f32<TO>(o[n][0] * ia);
      out[ra * FV + c + 1] = from_f32<TO>(o[n][1] * ia);
    }
    if (rb < rows) {
      out[rb * FV + c] = from_f32<TO>(o[n][2] * ib);
      out[rb * FV + c + 1] = from_f32<TO>(o[n][3] * ib);
    }
  }
}

} // namespace mf
