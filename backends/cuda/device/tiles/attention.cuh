// moeforge's tile library, part 'attention' (backends/cuda/device/tiles.cuh
// includes every part; NVRTC sees this one as "moeforge_tiles_attention.cuh").
// An attention row by one warp (AttentionStep, lowering/fuse_attention.h):
// the softmax over the tokens taken online, so no row of scores is stored.
#pragma once
#include "moeforge_tiles_elementwise.cuh"

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

} // namespace mf
