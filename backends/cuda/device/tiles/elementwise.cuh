// moeforge's tile library, part 'elementwise' (backends/cuda/device/tiles.cuh includes
// every part; NVRTC sees this one as "moeforge_tiles_elementwise.cuh").
// Element-wise: bf16 <-> f32, vector loads and stores, atomic adds: what
// generated epilogues and element-wise kernels call.
#pragma once
#include <cuda_bf16.h>

#include "moeforge_tiles_timeline.cuh"

namespace mf {

typedef __nv_bfloat16 bf16;

// ------------------------------------------------------------ element-wise
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(float x) { return x; }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) { return __float2bfloat16_rn(x); }

// Eight consecutive elements as fp32, in one 16-byte access (bf16) or two
// (f32): an element-wise kernel moves eight per thread, so its index
// arithmetic and its memory instructions are paid once per eight elements.
// p is aligned to the eight elements.
__device__ __forceinline__ void load8(const bf16 *p, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4 *>(p);
  const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float *p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4 *>(p)[0], b = reinterpret_cast<const float4 *>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void store8(bf16 *p, const float (&v)[8]) {
  uint4 raw;
  __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4 *>(p) = raw;
}
__device__ __forceinline__ void store8(float *p, const float (&v)[8]) {
  reinterpret_cast<float4 *>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4 *>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

__device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }
// Epilogue math runs once per output element, outside the MMA pipeline: the
// fast forms (MUFU exp2 / rcp / tanh, relative error ~2^-11) are well inside
// the bf16 the results are stored in, and IEEE division or tanhf cost a GEMM
// with short K (mbpaper: 16 k-steps) a measurable share of its time.
__device__ __forceinline__ float tanh_fast(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// sigmoid(x) = (1 + tanh(x / 2)) / 2: one special-function op instead of an
// exponential and a reciprocal (SwiGLU's epilogue computes one per element of
// a T*k x f tensor). tanh.approx's absolute error (~2^-11) stays below bf16's
// rounding of the values it feeds.
__device__ __forceinline__ float sigmoid(float x) { return fmaf(0.5f, tanh_fast(0.5f * x), 0.5f); }
__device__ __forceinline__ float silu(float x) { return x * sigmoid(x); }
__device__ __forceinline__ float relu(float x) { return x > 0.f ? x : 0.f; }
__device__ __forceinline__ float step(float x) { return x > 0.f ? 1.f : 0.f; } // relu' and max'
// GeLU, tanh form (as the reference): 0.5 x (1 + tanh(c (x + 0.044715 x^3)))
// written as h + h tanh(x (c + 0.044715 c x^2)) with h = x / 2, five FP32
// operations and a MUFU instead of nine (it runs once per element of h).
__device__ __forceinline__ float gelu(float x) {
  const float c = 0.7978845608028654f, ca = 0.7978845608028654f * 0.044715f;
  const float h = 0.5f * x;
  return fmaf(h, tanh_fast(x * fmaf(x * x, ca, c)), h);
}

// A thread's values of one row at columns col, col + 1 (v) and col + 8,
// col + 9 (w), col = 8 ni + 2 (lane & 3) (wgmma's accumulator columns), in
// 8-byte stores of four consecutive columns: even lanes keep their group-ni
// pair and take the neighbour's, odd lanes the group-ni+1 pairs; a quad then
// writes 16 consecutive columns, one whole 32-byte sector. Lanes of a quad
// share the row (and so whether it is stored), so the exchange partner is
// always active.
// Columns from n on are not stored (a row's last tile, N a multiple of 8:
// each lane's four columns lie wholly before or past n); both lanes of a
// pair still exchange.
// Add: the values are added into the row (a pair's share of its token's
// combine, GemmStep::out_add) by one vector RED a lane, not stored.
template <bool Add = false>
__device__ __forceinline__ void store2x2(bf16 *row, int col, float v0, float v1, float w0, float w1,
                                         int n = 0x7fffffff) {
  const bool odd = threadIdx.x & 1;
  const __nv_bfloat162 pv = __floats2bfloat162_rn(v0, v1), pw = __floats2bfloat162_rn(w0, w1);
  const unsigned p = *reinterpret_cast<const unsigned *>(&pv), q = *reinterpret_cast<const unsigned *>(&pw);
  const unsigned got = __shfl_xor_sync(__activemask(), odd ? p : q, 1);
  const int at = odd ? col + 6 : col;
  const unsigned lo = odd ? got : p, hi = odd ? q : got;
  if (at >= n)
    return;
  if constexpr (Add)
    asm volatile("red.global.add.noftz.v2.bf16x2 [%0], {%1, %2};" ::"l"(row + at), "r"(lo), "r"(hi) : "memory");
  else
    *reinterpret_cast<uint2 *>(row + at) = make_uint2(lo, hi);
}
// The same for an f32 row: 16-byte stores (a quad writes 64 bytes), half
// the store instructions of two-column float2 stores.
template <bool Add = false>
__device__ __forceinline__ void store2x2(float *row, int col, float v0, float v1, float w0, float w1,
                                         int n = 0x7fffffff) {
  const bool odd = threadIdx.x & 1;
  const unsigned mask = __activemask();
  const float g0 = __shfl_xor_sync(mask, odd ? v0 : w0, 1), g1 = __shfl_xor_sync(mask, odd ? v1 : w1, 1);
  const int at = odd ? col + 6 : col;
  const float4 v = odd ? make_float4(g0, g1, w0, w1) : make_float4(v0, v1, g0, g1);
  if (at >= n)
    return;
  if constexpr (Add)
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(row + at), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
  else
    *reinterpret_cast<float4 *>(row + at) = v;
}

// The sum of v over the 32 lanes of a warp, in every lane.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The sum of v over the threads of a block (whole warps, at most 32), in
// every thread; every thread of the block calls it.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
  v = warp_sum(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads(); // an earlier block_sum's readers are done with part
  if (lane == 0)
    part[warp] = v;
  __syncthreads();
  return warp_sum(lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f);
}

// The max of v over the 32 lanes of a warp, in every lane (a softmax row's).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Stores two adjacent elements (n, n+1) of a row; 4 or 8 bytes at once.
__device__ __forceinline__ void store2(bf16 *g, float a, float b) {
  *reinterpret_cast<__nv_bfloat162 *>(g) = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void store2(float *g, float a, float b) {
  *reinterpret_cast<float2 *>(g) = make_float2(a, b);
}
// A split-K slice's partial sums, added into the zeroed output (RED.ADD: the
// old value is never read back).
__device__ __forceinline__ void add2(float *g, float a, float b) {
  atomicAdd(g, a);
  atomicAdd(g + 1, b);
}
// A pair's share of its token's combine (GemmStep::out_add), added into the
// zeroed output: one 4-byte RED of a bf16 pair.
__device__ __forceinline__ void add2(bf16 *g, float a, float b) {
  atomicAdd(reinterpret_cast<__nv_bfloat162 *>(g), __floats2bfloat162_rn(a, b));
}

} // namespace mf
