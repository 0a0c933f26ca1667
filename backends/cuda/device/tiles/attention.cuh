// moeforge's tile library, part 'attention' (backends/cuda/device/tiles.cuh
// includes every part; NVRTC sees this one as "moeforge_tiles_attention.cuh").
// An attention row by one warp (AttentionStep, lowering/fuse_attention.h):
// the softmax over the tokens taken online, so no row of scores is stored;
// and its gradients, the probabilities made again from each row's
// log-sum-exp (FlashAttention-2's backward), so none is stored either.
#pragma once
#include "moeforge_tiles_mma_sync.cuh"

namespace mf {

// Where a row tensor keeps the step's row slot r: at r (padded tensors,
// and every tensor where the step walks its own rows), or at
// sorted_pair[r] (a pair-order tensor under a route's padded slots; -1 at
// padding slots, which have no row there).
struct AttnRows {
  const int *sorted_pair;
  __device__ __forceinline__ long long at(long long r, bool live) const {
    return sorted_pair ? (live ? (long long)sorted_pair[r] : -1LL) : r;
  }
};

// Two adjacent values as a bf16 pair (an MMA fragment register), and one
// value's bf16 bits: a 32-bit load from bf16, two rounded floats from f32.
__device__ __forceinline__ unsigned bf16_pair_at(const bf16 *p) { return *reinterpret_cast<const unsigned *>(p); }
__device__ __forceinline__ unsigned bf16_pair_at(const float *p) {
  __nv_bfloat162 h = __floats2bfloat162_rn(p[0], p[1]);
  return *reinterpret_cast<unsigned *>(&h);
}
__device__ __forceinline__ unsigned bf16_bits_at(const bf16 *p) { return *reinterpret_cast<const unsigned short *>(p); }
__device__ __forceinline__ unsigned bf16_bits_at(const float *p) {
  bf16 h = __float2bfloat16_rn(*p);
  return *reinterpret_cast<unsigned short *>(&h);
}
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned *>(&h);
}

// A warp's 16 x W accumulators in mma.sync's C layout (this thread: rows
// g and g + 8, columns 2t and 2t + 1 of each 8-wide n-tile) into rows ra
// and rb of a [*, W] tensor, times sa and sb; a row < 0 is not written.
template <int W, typename T>
__device__ __forceinline__ void store_c_rows(T *out, const float (&acc)[W / 8][4], long long ra, long long rb, float sa,
                                             float sb) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int n = 0; n < W / 8; ++n) {
    const int c = n * 8 + 2 * t;
    if (ra >= 0) {
      out[ra * W + c] = from_f32<T>(acc[n][0] * sa);
      out[ra * W + c + 1] = from_f32<T>(acc[n][1] * sa);
    }
    if (rb >= 0) {
      out[rb * W + c] = from_f32<T>(acc[n][2] * sb);
      out[rb * W + c + 1] = from_f32<T>(acc[n][3] * sb);
    }
  }
}

// out[c] = sum over u < T of softmax_u(scale * q . key[u]) * value[u][c],
// for one row: q [FK], key [T][FK], value [T][FV], out [FV]; the calling
// warp's 32 lanes each hold columns lane, lane + 32, ... of q and of the
// sum. `live` false: the row is padding, written as zeros. Tokens go U at
// a time, their dot products reduced across the warp side by side (their
// shuffles independent), then folded into the running maximum m and sum l:
// a larger maximum rescales what was summed before it by exp(m - m_new).
// Where lse is not null, lane 0 writes the row's log-sum-exp of its scaled
// scores there (0 for padding), which the gradients read.
template <int FK, int FV, typename TQ, typename TK, typename TV, typename TO>
__device__ __forceinline__ void attention_row_warp(const TQ *__restrict__ q, const TK *__restrict__ key,
                                                   const TV *__restrict__ value, TO *out, float *lse, long long T,
                                                   float scale, bool live) {
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
  if (out)
#pragma unroll
    for (int c = 0; c < QV; ++c)
      if (lane + 32 * c < FV)
        out[lane + 32 * c] = from_f32<TO>(acc[c] * inv);
  if (lse && lane == 0)
    *lse = live && l > 0.f ? m + __logf(l) : 0.f;
}

// The gradients on the CUDA cores (head dims that are no multiple of 16,
// operands that are not bf16), lanes over the columns as above. The
// query's part, one row: delta = d_z . z, then per token u, s = q . key[u]
// and dp = d_z . value[u] (two warp sums), p = exp(scale s - lse),
// ds = p (dp - delta) scale, d_q += ds key[u]. d_q and delta may be null
// (a pair-order row under a padding slot), `live` false writes zeros.
template <int FK, int FV, typename TQ, typename TK, typename TV, typename TZ, typename TD, typename TO>
__device__ __forceinline__ void attention_query_gradient_warp(const TQ *__restrict__ q, const TK *__restrict__ key,
                                                              const TV *__restrict__ value, const TZ *__restrict__ z,
                                                              const TD *__restrict__ d_z, float lse, TO *d_q,
                                                              float *delta, long long T, float scale, bool live) {
  constexpr int QK = (FK + 31) / 32, QV = (FV + 31) / 32;
  const int lane = threadIdx.x & 31;
  float qr[QK], dz[QV], acc[QK];
  float dl = 0.f;
#pragma unroll
  for (int i = 0; i < QK; ++i) {
    qr[i] = live && lane + 32 * i < FK ? to_f32(q[lane + 32 * i]) : 0.f;
    acc[i] = 0.f;
  }
#pragma unroll
  for (int c = 0; c < QV; ++c) {
    dz[c] = live && lane + 32 * c < FV ? to_f32(d_z[lane + 32 * c]) : 0.f;
    dl += live && lane + 32 * c < FV ? dz[c] * to_f32(z[lane + 32 * c]) : 0.f;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    dl += __shfl_xor_sync(0xffffffffu, dl, off);
  for (long long u = 0; live && u < T; ++u) {
    float sc = 0.f, dp = 0.f;
#pragma unroll
    for (int i = 0; i < QK; ++i)
      if (lane + 32 * i < FK)
        sc += qr[i] * to_f32(key[u * FK + lane + 32 * i]);
#pragma unroll
    for (int c = 0; c < QV; ++c)
      if (lane + 32 * c < FV)
        dp += dz[c] * to_f32(value[u * FV + lane + 32 * c]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      sc += __shfl_xor_sync(0xffffffffu, sc, off);
      dp += __shfl_xor_sync(0xffffffffu, dp, off);
    }
    const float p = __expf(sc * scale - lse), ds = p * (dp - dl) * scale;
#pragma unroll
    for (int i = 0; i < QK; ++i)
      if (lane + 32 * i < FK)
        acc[i] += ds * to_f32(key[u * FK + lane + 32 * i]);
  }
  if (d_q)
#pragma unroll
    for (int i = 0; i < QK; ++i)
      if (lane + 32 * i < FK)
        d_q[lane + 32 * i] = from_f32<TO>(acc[i]);
  if (delta && lane == 0)
    *delta = live ? dl : 0.f;
}

// The key's part on the CUDA cores, one token u a warp, over every row
// slot r: s and dp as in the query's part, then d_key[u] += ds q[r] and
// d_value[u] += p d_z[r].
template <int FK, int FV, typename TQ, typename TK, typename TV, typename TD, typename TDK, typename TDV, typename Live>
__device__ __forceinline__ void
attention_key_gradient_warp(const TQ *__restrict__ q, const TK *__restrict__ key, const TV *__restrict__ value,
                            const TD *__restrict__ d_z, const float *__restrict__ lse, const float *__restrict__ delta,
                            TDK *d_key, TDV *d_value, AttnRows q_at, AttnRows dz_at, AttnRows lse_at, AttnRows delta_at,
                            long long u, long long rows, float scale, Live live_row) {
  constexpr int QK = (FK + 31) / 32, QV = (FV + 31) / 32;
  const int lane = threadIdx.x & 31;
  float kr[QK], vr[QV], dk[QK], dv[QV];
#pragma unroll
  for (int i = 0; i < QK; ++i) {
    kr[i] = lane + 32 * i < FK ? to_f32(key[u * FK + lane + 32 * i]) : 0.f;
    dk[i] = 0.f;
  }
#pragma unroll
  for (int c = 0; c < QV; ++c) {
    vr[c] = lane + 32 * c < FV ? to_f32(value[u * FV + lane + 32 * c]) : 0.f;
    dv[c] = 0.f;
  }
  for (long long r = 0; r < rows; ++r) {
    if (!live_row(r)) // the same slot for the whole warp
      continue;
    const TQ *qr = q + q_at.at(r, true) * FK;
    const TD *dzr = d_z + dz_at.at(r, true) * FV;
    float sc = 0.f, dp = 0.f;
#pragma unroll
    for (int i = 0; i < QK; ++i)
      if (lane + 32 * i < FK)
        sc += kr[i] * to_f32(qr[lane + 32 * i]);
#pragma unroll
    for (int c = 0; c < QV; ++c)
      if (lane + 32 * c < FV)
        dp += vr[c] * to_f32(dzr[lane + 32 * c]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      sc += __shfl_xor_sync(0xffffffffu, sc, off);
      dp += __shfl_xor_sync(0xffffffffu, dp, off);
    }
    const float p = __expf(sc * scale - lse[lse_at.at(r, true)]);
    const float ds = p * (dp - delta[delta_at.at(r, true)]) * scale;
#pragma unroll
    for (int i = 0; i < QK; ++i)
      if (lane + 32 * i < FK)
        dk[i] += ds * to_f32(qr[lane + 32 * i]);
#pragma unroll
    for (int c = 0; c < QV; ++c)
      if (lane + 32 * c < FV)
        dv[c] += p * to_f32(dzr[lane + 32 * c]);
  }
#pragma unroll
  for (int i = 0; i < QK; ++i)
    if (lane + 32 * i < FK)
      d_key[u * FK + lane + 32 * i] = from_f32<TDK>(dk[i]);
#pragma unroll
  for (int c = 0; c < QV; ++c)
    if (lane + 32 * c < FV)
      d_value[u * FV + lane + 32 * c] = from_f32<TDV>(dv[c]);
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
// Row slots' tensors are found through AttnRows (q_at, out_at, lse_at);
// where lse is not null, each row's log-sum-exp of its scaled scores is
// written there too (0 for padding), for the gradients.
template <int FK, int FV, typename TO, typename Live>
__device__ __forceinline__ void attention_rows_mma(const bf16 *__restrict__ q, const bf16 *__restrict__ key,
                                                   const bf16 *__restrict__ value, TO *out, float *lse, AttnRows q_at,
                                                   AttnRows out_at, AttnRows lse_at, long long row0, long long rows,
                                                   long long T, float scale, Live live_row) {
  static_assert(FK % 16 == 0 && FV % 8 == 0, "head dims: FK a multiple of 16, FV of 8");
  constexpr int KC = FK / 16, NV = FV / 8, BT = 64, NS = BT / 8;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const long long ra = row0 + g, rb = row0 + g + 8; // this thread's two row slots
  const bool la = ra < rows && live_row(ra), lb = rb < rows && live_row(rb);
  auto pair = [](const bf16 *p) { return *reinterpret_cast<const unsigned *>(p); };
  const long long qra = q_at.at(ra, la), qrb = q_at.at(rb, lb);
  unsigned qa[KC][4]; // (16, FK): the A fragments of q, for every k-chunk
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    const int c = kc * 16 + 2 * t;
    qa[kc][0] = la ? pair(q + qra * FK + c) : 0u;
    qa[kc][1] = lb ? pair(q + qrb * FK + c) : 0u;
    qa[kc][2] = la ? pair(q + qra * FK + c + 8) : 0u;
    qa[kc][3] = lb ? pair(q + qrb * FK + c + 8) : 0u;
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
  store_c_rows<FV>(out, o, ra < rows ? out_at.at(ra, la) : -1, rb < rows ? out_at.at(rb, lb) : -1, ia, ib);
  if (lse && t == 0) {
    const long long lra = ra < rows ? lse_at.at(ra, la) : -1, lrb = rb < rows ? lse_at.at(rb, lb) : -1;
    if (lra >= 0)
      lse[lra] = la && la_sum > 0.f ? ma + __logf(la_sum) : 0.f;
    if (lrb >= 0)
      lse[lrb] = lb && lb_sum > 0.f ? mb + __logf(lb_sum) : 0.f;
  }
}

// The query's part of the gradients (AttentionStep::Part::query_gradient),
// 16 row slots a warp on the tensor cores: delta[r] = d_z[r] . z[r], then
// per block of BT tokens S = q key^T again, p = exp(scale S - lse[r]),
// dP = d_z value^T, dS = p (dP - delta[r]) scale, and d_q += dS key (dS
// from registers as the next product's A, as the forward does with p).
// q, key and value are bf16, d_z bf16 or f32 (rounded to bf16 for the
// products), FK and FV multiples of 16. Padding slots' rows are zeros
// where their tensor has them.
template <int FK, int FV, typename TZ, typename TD, typename TO, typename Live>
__device__ __forceinline__ void
attention_query_gradient_mma(const bf16 *__restrict__ q, const bf16 *__restrict__ key, const bf16 *__restrict__ value,
                             const TZ *__restrict__ z, const TD *__restrict__ d_z, const float *__restrict__ lse,
                             TO *d_q, float *delta, AttnRows q_at, AttnRows z_at, AttnRows dz_at, AttnRows lse_at,
                             AttnRows dq_at, AttnRows delta_at, long long row0, long long rows, long long T,
                             float scale, Live live_row) {
  static_assert(FK % 16 == 0 && FV % 16 == 0, "head dims: multiples of 16");
  constexpr int KC = FK / 16, VC = FV / 16, NQ = FK / 8, BT = 16, NS = BT / 8;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const long long ra = row0 + g, rb = row0 + g + 8;
  const bool la = ra < rows && live_row(ra), lb = rb < rows && live_row(rb);
  const long long qra = q_at.at(ra, la), qrb = q_at.at(rb, lb);
  const long long dra = dz_at.at(ra, la), drb = dz_at.at(rb, lb);
  const long long zra = z_at.at(ra, la), zrb = z_at.at(rb, lb);
  unsigned qa[KC][4], da[VC][4]; // A fragments of q (16, FK) and of d_z (16, FV)
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    const int c = kc * 16 + 2 * t;
    qa[kc][0] = la ? bf16_pair_at(q + qra * FK + c) : 0u;
    qa[kc][1] = lb ? bf16_pair_at(q + qrb * FK + c) : 0u;
    qa[kc][2] = la ? bf16_pair_at(q + qra * FK + c + 8) : 0u;
    qa[kc][3] = lb ? bf16_pair_at(q + qrb * FK + c + 8) : 0u;
  }
  // delta over the quad's columns: this thread's 2t, 2t + 1 (+ 8) of each
  // 16, from d_z as stored.
  float dla = 0.f, dlb = 0.f;
#pragma unroll
  for (int vc = 0; vc < VC; ++vc) {
    const int c = vc * 16 + 2 * t;
    da[vc][0] = la ? bf16_pair_at(d_z + dra * FV + c) : 0u;
    da[vc][1] = lb ? bf16_pair_at(d_z + drb * FV + c) : 0u;
    da[vc][2] = la ? bf16_pair_at(d_z + dra * FV + c + 8) : 0u;
    da[vc][3] = lb ? bf16_pair_at(d_z + drb * FV + c + 8) : 0u;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int cc = c + (e & 1) + (e >> 1) * 8;
      if (la)
        dla += to_f32(d_z[dra * FV + cc]) * to_f32(z[zra * FV + cc]);
      if (lb)
        dlb += to_f32(d_z[drb * FV + cc]) * to_f32(z[zrb * FV + cc]);
    }
  }
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    dla += __shfl_xor_sync(0xffffffffu, dla, off);
    dlb += __shfl_xor_sync(0xffffffffu, dlb, off);
  }
  const float lsa = la ? lse[lse_at.at(ra, la)] : 0.f, lsb = lb ? lse[lse_at.at(rb, lb)] : 0.f;
  float acc[NQ][4];
#pragma unroll
  for (int n = 0; n < NQ; ++n)
    acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  const unsigned short *k16 = reinterpret_cast<const unsigned short *>(key);
  for (long long u0 = 0; u0 < T && __any_sync(0xffffffffu, la || lb); u0 += BT) {
    float sc[NS][4], dp[NS][4];
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
      dp[j][0] = dp[j][1] = dp[j][2] = dp[j][3] = 0.f;
      const long long u = u0 + j * 8 + g; // B's column: token u
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
        const int c = kc * 16 + 2 * t;
        const unsigned b0 = u < T ? bf16_pair_at(key + u * FK + c) : 0u;
        const unsigned b1 = u < T ? bf16_pair_at(key + u * FK + c + 8) : 0u;
        mma_16816(sc[j], qa[kc], b0, b1);
      }
#pragma unroll
      for (int vc = 0; vc < VC; ++vc) {
        const int c = vc * 16 + 2 * t;
        const unsigned b0 = u < T ? bf16_pair_at(value + u * FV + c) : 0u;
        const unsigned b1 = u < T ? bf16_pair_at(value + u * FV + c + 8) : 0u;
        mma_16816(dp[j], da[vc], b0, b1);
      }
    }
    unsigned sa[NS / 2][4]; // dS as A fragments, 16 tokens a chunk
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      float ds[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const long long u = u0 + j * 8 + 2 * t + (e & 1);
        const bool top = e < 2, live = (top ? la : lb) && u < T;
        const float p = live ? __expf(sc[j][e] * scale - (top ? lsa : lsb)) : 0.f;
        ds[e] = p * (dp[j][e] - (top ? dla : dlb)) * scale;
      }
      sa[j / 2][(j & 1) * 2 + 0] = pack_bf16(ds[0], ds[1]);
      sa[j / 2][(j & 1) * 2 + 1] = pack_bf16(ds[2], ds[3]);
    }
    // d_q += dS key: B's rows (k) are tokens 2t, 2t + 1 (+ 8), its column
    // (n) key's column n * 8 + g.
#pragma unroll
    for (int kc = 0; kc < NS / 2; ++kc) {
      const long long u = u0 + kc * 16 + 2 * t;
#pragma unroll
      for (int n = 0; n < NQ; ++n) {
        const long long col = n * 8 + g;
        auto at = [&](long long uu) { return uu < T ? (unsigned)k16[uu * FK + col] : 0u; };
        mma_16816(acc[n], sa[kc], at(u) | (at(u + 1) << 16), at(u + 8) | (at(u + 9) << 16));
      }
    }
  }
  store_c_rows<FK>(d_q, acc, ra < rows ? dq_at.at(ra, la) : -1, rb < rows ? dq_at.at(rb, lb) : -1, la ? 1.f : 0.f,
                   lb ? 1.f : 0.f);
  if (t == 0) {
    const long long xa = ra < rows ? delta_at.at(ra, la) : -1, xb = rb < rows ? delta_at.at(rb, lb) : -1;
    if (xa >= 0)
      delta[xa] = la ? dla : 0.f;
    if (xb >= 0)
      delta[xb] = lb ? dlb : 0.f;
  }
}

// The key's and value's part (AttentionStep::Part::key_gradient), 16
// tokens a warp on the tensor cores, over every row slot in blocks of 16:
// S^T = key q^T, p^T = exp(scale S^T - lse[r]); with KEYS, dP^T = value
// d_z^T, dS^T = p^T (dP^T - delta[r]) scale and d_key += dS^T q; with
// VALUES, d_value += p^T d_z. A launch may take the two apart (two blocks
// per tokens, S made in each) where both sets of accumulators would not fit
// the registers (a head dim of 128: 64 floats each a thread). d_key and
// d_value [T, F] are written whole (no atomics: a token's rows belong to
// one warp). The same operand types as the query's part.
template <int FK, int FV, bool KEYS, bool VALUES, typename TD, typename TK, typename TV, typename Live>
__device__ __forceinline__ void
attention_key_gradient_mma(const bf16 *__restrict__ q, const bf16 *__restrict__ key, const bf16 *__restrict__ value,
                           const TD *__restrict__ d_z, const float *__restrict__ lse, const float *__restrict__ delta,
                           TK *d_key, TV *d_value, AttnRows q_at, AttnRows dz_at, AttnRows lse_at, AttnRows delta_at,
                           long long u_first, long long rows, long long T, float scale, Live live_row) {
  static_assert(FK % 16 == 0 && FV % 16 == 0, "head dims: multiples of 16");
  constexpr int KC = FK / 16, VC = FV / 16, NQ = KEYS ? FK / 8 : 1, NV = VALUES ? FV / 8 : 1, BR = 16, NS = BR / 8;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const long long ua = u_first + g, ub = u_first + g + 8; // this thread's two tokens
  const bool va = ua < T, vb = ub < T;
  unsigned ka[KC][4], vfa[KEYS ? VC : 1][4]; // A fragments of key (16, FK) and value (16, FV)
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    const int c = kc * 16 + 2 * t;
    ka[kc][0] = va ? bf16_pair_at(key + ua * FK + c) : 0u;
    ka[kc][1] = vb ? bf16_pair_at(key + ub * FK + c) : 0u;
    ka[kc][2] = va ? bf16_pair_at(key + ua * FK + c + 8) : 0u;
    ka[kc][3] = vb ? bf16_pair_at(key + ub * FK + c + 8) : 0u;
  }
  if constexpr (KEYS)
#pragma unroll
    for (int vc = 0; vc < VC; ++vc) {
      const int c = vc * 16 + 2 * t;
      vfa[vc][0] = va ? bf16_pair_at(value + ua * FV + c) : 0u;
      vfa[vc][1] = vb ? bf16_pair_at(value + ub * FV + c) : 0u;
      vfa[vc][2] = va ? bf16_pair_at(value + ua * FV + c + 8) : 0u;
      vfa[vc][3] = vb ? bf16_pair_at(value + ub * FV + c + 8) : 0u;
    }
  float dk[NQ][4], dv[NV][4];
#pragma unroll
  for (int n = 0; n < NQ; ++n)
    dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.f;
#pragma unroll
  for (int n = 0; n < NV; ++n)
    dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.f;
  for (long long r0 = 0; r0 < rows && __any_sync(0xffffffffu, va || vb); r0 += BR) {
    // B's column of slot r0 + 8 j + g: S^T's (and dP^T's) n.
    float st[NS][4], dpt[NS][4];
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      st[j][0] = st[j][1] = st[j][2] = st[j][3] = 0.f;
      dpt[j][0] = dpt[j][1] = dpt[j][2] = dpt[j][3] = 0.f;
      const long long r = r0 + j * 8 + g;
      const bool live = r < rows && live_row(r);
      const long long qr = q_at.at(r, live);
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) {
        const int c = kc * 16 + 2 * t;
        mma_16816(st[j], ka[kc], live ? bf16_pair_at(q + qr * FK + c) : 0u,
                  live ? bf16_pair_at(q + qr * FK + c + 8) : 0u);
      }
      if constexpr (KEYS) {
        const long long dr = dz_at.at(r, live);
#pragma unroll
        for (int vc = 0; vc < VC; ++vc) {
          const int c = vc * 16 + 2 * t;
          mma_16816(dpt[j], vfa[vc], live ? bf16_pair_at(d_z + dr * FV + c) : 0u,
                    live ? bf16_pair_at(d_z + dr * FV + c + 8) : 0u);
        }
      }
    }
    // The slots r0 + 2t + i (i: 0, 1, 8, 9) this thread holds as C's
    // columns and reads as B's rows: their liveness, rows, lse, delta.
    bool lv[4];
    int qrow[4], drow[4]; // rows of tensors under 2^31 rows: half the registers of 64-bit ones
    float ls[4], dl[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const long long r = r0 + 2 * t + (i & 1) + (i >> 1) * 8;
      lv[i] = r < rows && live_row(r);
      qrow[i] = (int)q_at.at(r, lv[i]);
      drow[i] = (int)dz_at.at(r, lv[i]);
      ls[i] = lv[i] ? lse[lse_at.at(r, true)] : 0.f;
      dl[i] = KEYS && lv[i] ? delta[delta_at.at(r, true)] : 0.f;
    }
    unsigned pa[4], sa[4]; // p^T and dS^T as one k-chunk's A fragments (16 tokens x 16 slots)
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      float p[4], ds[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = (e & 1) + j * 2; // the slot: 2t + (e & 1) + 8 j
        const bool live = lv[i] && (e < 2 ? va : vb);
        p[e] = live ? __expf(st[j][e] * scale - ls[i]) : 0.f;
        ds[e] = p[e] * (dpt[j][e] - dl[i]) * scale;
      }
      pa[j * 2 + 0] = pack_bf16(p[0], p[1]);
      pa[j * 2 + 1] = pack_bf16(p[2], p[3]);
      sa[j * 2 + 0] = pack_bf16(ds[0], ds[1]);
      sa[j * 2 + 1] = pack_bf16(ds[2], ds[3]);
    }
    // d_value += p^T d_z, d_key += dS^T q: B's rows (k) are the slots
    // 2t, 2t + 1 (+ 8), its column (n) the column n * 8 + g.
    if constexpr (VALUES)
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const long long col = n * 8 + g;
        auto at = [&](int i) { return lv[i] ? bf16_bits_at(d_z + (long long)drow[i] * FV + col) : 0u; };
        mma_16816(dv[n], pa, at(0) | (at(1) << 16), at(2) | (at(3) << 16));
      }
    if constexpr (KEYS)
#pragma unroll
      for (int n = 0; n < NQ; ++n) {
        const long long col = n * 8 + g;
        auto at = [&](int i) { return lv[i] ? bf16_bits_at(q + (long long)qrow[i] * FK + col) : 0u; };
        mma_16816(dk[n], sa, at(0) | (at(1) << 16), at(2) | (at(3) << 16));
      }
  }
  if constexpr (KEYS)
    store_c_rows<FK>(d_key, dk, va ? ua : -1, vb ? ub : -1, 1.f, 1.f);
  if constexpr (VALUES)
    store_c_rows<FV>(d_value, dv, va ? ua : -1, vb ? ub : -1, 1.f, 1.f);
}

} // namespace mf
