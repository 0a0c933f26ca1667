// moeforge's device-side tile library (NVRTC sees it as "moeforge_tiles.cuh";
// embedded into the binary at build time, see backends/cuda/CMakeLists.txt).
// Generated kernels stay thin: they set up a tile (which rows, which
// expert), call a main loop, and run their own epilogue. The library speaks
// in tiles: names say the memory level (g* global, s* shared, r* registers)
// and who cooperates (the block or a warp). mma.sync (m16n8k16, ldmatrix,
// cp.async pipelines) runs on sm_80 and later; the Hopper main loops (wgmma
// fed by TMA through mbarriers, warp-specialised producers) fill the same
// accumulators for the block's output tile.
#pragma once
#include <cuda_bf16.h>

// ------------------------------------------------------------ timeline (debugging)
// Compiled with -DMF_TIMELINE (MOEFORGE_TIMELINE=1 at run time), GEMM
// kernels stamp the global timer at the phases of a tile into
// mf_timeline[block][phase] (thread 0, the first consumer thread):
//   0 entry, 1 main loop called (tile table read), 2 first stage landed,
//   3 main loop done, 4 epilogue done, 5 the SM's id, 6 the tile's rows + 1
//   (a value, not a time: tiles of an expert's last rows told apart);
// persistent blocks stamp per tile (at mf_timeline[tile]; no phase 2).
// CudaLayer::timeline() reads it back after each GEMM. Otherwise MF_STAMP
// is nothing.
#ifdef MF_TIMELINE
#define MF_TIMELINE_BLOCKS 65536
extern "C" {
__device__ unsigned long long mf_timeline[MF_TIMELINE_BLOCKS * 8]; // defined here: one NVRTC unit
}
__device__ __forceinline__ void mf_stamp(long long at, int phase) {
  if (threadIdx.x == 0 && at < MF_TIMELINE_BLOCKS) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    mf_timeline[at * 8 + phase] = t;
    if (phase == 0) {
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      mf_timeline[at * 8 + 5] = sm;
    }
  }
}
__device__ __forceinline__ void mf_note_rows(long long at, int rows) {
  if (threadIdx.x == 0 && at < MF_TIMELINE_BLOCKS)
    mf_timeline[at * 8 + 6] = (unsigned long long)(rows + 1);
}
#define MF_STAMP(phase) mf_stamp(blockIdx.x, phase)
#define MF_STAMP_AT(tile, phase) mf_stamp(tile, phase) // persistent blocks: per tile
#define MF_NOTE_ROWS(rows) mf_note_rows(blockIdx.x, rows)
#define MF_NOTE_ROWS_AT(tile, rows) mf_note_rows(tile, rows)
#else
#define MF_STAMP(phase)
#define MF_STAMP_AT(tile, phase)
#define MF_NOTE_ROWS(rows)
#define MF_NOTE_ROWS_AT(tile, rows)
#endif

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
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

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
      const bool ok = a_ok[i] && k0 + ch * 8 < K;
      cp_async_16(sA + C::a_off(row, ch), ok ? gA[i] + k0 : gA[i], ok);
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
// and .release.cluster cost the pair loop a third of its speed (NOTES v11).
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

// ------------------------------------------------------------ Hopper: wgmma
// The same tile contract as GemmConfig, computed by warpgroups with wgmma
// (sm_90a): each warpgroup owns 64 rows x BN, its A (64 x 16) and B (16 x BN)
// read straight from shared memory through matrix descriptors. Tiles are
// staged with cp.async (which can gather rows: TMA cannot) in the 128-byte
// swizzled layouts wgmma reads:
//   sA (BM, 64) K-major: row m is 128 bytes, chunk c stored at c ^ (m & 7);
//                        8-row atoms of 1024 bytes, stacked along M.
//   sB (64, BN) N-major: 64-column slabs of 64 k-rows x 128 bytes (8 KiB),
//                        chunk c of row k at c ^ (k & 7).
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned s_addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((s_addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) |
         ((unsigned long long)(sbo >> 4) << 32) | (1ull << 62); // 128-byte swizzle
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// cp.async writes through the generic proxy; wgmma reads through the async one.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// The multi-stage cp.async pipeline both plain Hopper loops share (every
// thread loads): load(slot, kt) issues k-tile kt's copies into a stage,
// mma(slot) issues the warpgroup's wgmmas over one, STAGES - 1 tiles ahead.
template <int STAGES, typename Load, typename Mma>
__device__ __forceinline__ void cp_async_pipeline(int KT, Load load, Mma mma) {
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT)
      load(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<STAGES - 2>();
    fence_proxy_async();
    __syncthreads();
    mma(kt % STAGES);
    // The group issued last iteration read the slot refilled below: wait
    // for it (this warpgroup), then for every warpgroup.
    wgmma_wait<1>();
    __syncthreads();
    const int next = kt + STAGES - 1;
    if (next < KT)
      load(next % STAGES, next);
    cp_async_commit();
  }
  wgmma_wait<0>();
  cp_async_wait<0>();
}

// d += A * B for one m64 x N x k16 step; A K-major, B N-major (TRANS_B = 1,
// B[K, N] in global memory) or K-major (TRANS_B = 0, B stored [N, K]).
// TRANS_A = 1: A M-major in shared memory (staged like an N-major B).
template <int N, int TRANS_B, int TRANS_A = 0> struct Wgmma;
// The wgmma wrappers, one per supported N and operand order, go in at the
// next line (tile_library.cpp: their operand lists are generated).
// MOEFORGE_WGMMA_INSTANCES

// ------------------------------------------------------------ Hopper: output tiles by TMA
// A bf16 output tile in tile order, for the wgmma configurations, whose
// accumulators lie alike (warpgroup w holds rows 64 w .. 64 w + 63). Plain
// stores of accumulator fragments write 8 rows x 4 bytes per warp
// instruction, and a tile's epilogue waited ~4 us for them. Instead each
// warpgroup stages its 64 rows in shared memory (the idle ring of a block
// per tile, or a persistent block's own buffer past it) as BN/64 boxes of
// 64 rows x 128 bytes swizzled as the tensor map lays them out, and one
// thread per warpgroup hands them to the copy engine. The block's shared
// memory lives until that copy has read it; the global writes complete on
// their own, under a persistent block's next main loop. W: the columns
// staged at a time, BN, or BN / 2 where a whole tile's staging does not fit
// beside a persistent block's ring (the tile then leaves in two parts, the
// second staged once the first's copy has read the buffer).
template <int BN> struct TmaStoreTile {
  // A warp's values of column groups ni and ni + 1 (8 columns each) of its
  // 16 rows, staged by one stmatrix (four 8x8 matrices, a row of 16 bytes
  // each, from the accumulator fragments as they lie: 16 instructions per
  // thread for a 128 x 256 tile, against 64 stores of a column pair). v:
  // group ni's pairs (row lane / 4: v0, v1; row + 8: v2, v3); w: group
  // ni + 1's. Lane L gives the address of row L % 8 of matrix L / 8
  // (matrices: rows 0-7 and 8-15 of group ni, then of group ni + 1): box
  // (row / 64, column / 64), 128 bytes a row, 16-byte chunk c of row r at
  // c ^ (r & 7), the tensor map's 128-byte swizzle.
  // ni counts from the staged part's first column.
  template <int W = BN>
  __device__ static __forceinline__ void out_put4(unsigned s, int warp, int lane, int ni, float v0, float v1, float v2,
                                                  float v3, float w0, float w1, float w2, float w3) {
    const int j = lane >> 3, row = (warp >> 2) * 64 + (warp & 3) * 16 + (j & 1) * 8 + (lane & 7);
    const int group = ni + (j >> 1), r = row & 63;
    const unsigned at =
        s + ((row >> 6) * (W / 64) + (group >> 3)) * (64 * 128) + r * 128 + (((group & 7) ^ (r & 7)) << 4);
    const __nv_bfloat162 a = __floats2bfloat162_rn(v0, v1), b = __floats2bfloat162_rn(v2, v3),
                         c = __floats2bfloat162_rn(w0, w1), d = __floats2bfloat162_rn(w2, w3);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(at),
                 "r"(*reinterpret_cast<const unsigned *>(&a)), "r"(*reinterpret_cast<const unsigned *>(&b)),
                 "r"(*reinterpret_cast<const unsigned *>(&c)), "r"(*reinterpret_cast<const unsigned *>(&d))
                 : "memory");
  }
  // Persistent blocks stage in a buffer past the ring (Ring::out): each
  // warpgroup's part is free again once its previous copy has read it.
  __device__ static __forceinline__ unsigned out_reuse(unsigned s) {
    const int tid = threadIdx.x;
    if ((tid & 127) == 0)
      bulk_wait_read();
    named_barrier(2 + (tid >> 7), 128);
    return s;
  }
  // After a persistent block's last tile: its copies have read their staging.
  __device__ static __forceinline__ void out_done() {
    if ((threadIdx.x & 127) == 0)
      bulk_wait_read();
  }
  // Stores warpgroup wg's boxes at rows row0 + 64 wg (if any of the tile's
  // `rows` fall there) and columns n0 ... n0 + W - 1 (those under N); wait:
  // until the copy has read the staging (else out_reuse / out_done wait).
  // batch: the map's third coordinate (an expert reduction's expert).
  template <int W = BN>
  __device__ static __forceinline__ void out_store(unsigned s, const TmaDesc *map, long long row0, int rows, int n0,
                                                   int N, bool wait, int batch = 0) {
    const int tid = threadIdx.x, wg = tid >> 7;
    fence_proxy_async();        // this thread's staged values, visible to the copy engine
    named_barrier(2 + wg, 128); // ... and every thread's of this warpgroup
    if ((tid & 127) == 0 && rows > wg * 64) {
#pragma unroll
      for (int b = 0; b < W / 64; ++b)
        if (n0 + b * 64 < N)
          tma_store_3d(map, s + (wg * (W / 64) + b) * (64 * 128), n0 + b * 64, (int)(row0 + wg * 64), batch);
      bulk_commit();
      if (wait)
        bulk_wait_read();
    }
  }
};

// BT: the B operands are stored transposed, [N, K] (a backward pass's W^T read
// in place): their tiles are staged K-major like A's.
template <int BM_, int BN_, int STAGES_, int NB_, bool BT = false> struct WgmmaConfig : TmaStoreTile<BN_> {
  static constexpr int BM = BM_, BN = BN_, BK = 64, STAGES = STAGES_, NB = NB_;
  static constexpr int WG = BM / 64, THREADS = WG * 128;
  static constexpr int A_ITERS = BM * 8 / THREADS; // A chunks per thread and stage
  static constexpr int MI = 1, NI = BN / 8;
  static constexpr int A_STAGE_BYTES = BM * 128, B_STAGE_BYTES = BK * BN * 2;
  static constexpr int STAGE_BYTES = A_STAGE_BYTES + NB * B_STAGE_BYTES;
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024; // + alignment slack
  static_assert(BM == 64 || BM == 128, "wgmma tiles are 64 or 128 rows");
  static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma tiles are 64, 128 or 256 columns");
  static_assert(NB * BN / 2 <= 128, "accumulators past 128 registers per thread");
  static_assert(STAGES >= 3, "wgmma overlaps one group in flight: at least three stages");

  typedef float Acc[NB][BN / 2];
  __device__ static __forceinline__ float get(const Acc &acc, int b, int, int ni, int e) { return acc[b][ni * 4 + e]; }
  __device__ static __forceinline__ int a_load_row(int tid, int i) { return (tid + i * THREADS) / 8; }
  __device__ static __forceinline__ int a_load_chunk(int tid, int i) { return (tid + i * THREADS) % 8; }
  __device__ static __forceinline__ int acc_row(int warp, int lane, int, int e) {
    return (warp >> 2) * 64 + (warp & 3) * 16 + (lane >> 2) + (e >> 1) * 8;
  }
  __device__ static __forceinline__ int acc_col(int, int lane, int ni, int e) {
    return ni * 8 + (lane & 3) * 2 + (e & 1);
  }
  __device__ static __forceinline__ unsigned a_off(int row, int ch) { return row * 128 + ((ch ^ (row & 7)) << 4); }
  __device__ static __forceinline__ unsigned b_off(int k, int ch) {
    return (ch >> 3) * (BK * 128) + k * 128 + (((ch & 7) ^ (k & 7)) << 4);
  }
  // BT: row n of the tile is 128 bytes of K, swizzled as A's rows are.
  __device__ static __forceinline__ unsigned bt_off(int n, int ch) { return n * 128 + ((ch ^ (n & 7)) << 4); }

  // Copies k-tile kt into stage `slot`, spread over LOADERS threads of which
  // this is thread t: A rows through their precomputed pointers, B rows of
  // each operand; chunks past K or N are zero-filled.
  template <int LOADERS>
  __device__ static __forceinline__ void load_a(unsigned sA, int kt, int t, const bf16 *const (&gA)[BM * 8 / LOADERS],
                                                const bool (&a_ok)[BM * 8 / LOADERS], int K) {
    const int k0 = kt * BK;
#pragma unroll
    for (int i = 0; i < BM * 8 / LOADERS; ++i) {
      const int row = (t + i * LOADERS) / 8, ch = (t + i * LOADERS) % 8;
      const bool ok = a_ok[i] && k0 + ch * 8 < K;
      cp_async_16(sA + a_off(row, ch), ok ? gA[i] + k0 : gA[i], ok);
    }
  }
  template <int LOADERS>
  __device__ static __forceinline__ void
  load_stage(unsigned s0, int slot, int kt, int t, const bf16 *const (&gA)[BM * 8 / LOADERS],
             const bool (&a_ok)[BM * 8 / LOADERS], const bf16 *const (&gB)[NB], int K, int N, int n0) {
    const unsigned sA = s0 + slot * STAGE_BYTES;
    const int k0 = kt * BK;
    load_a<LOADERS>(sA, kt, t, gA, a_ok, K);
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const unsigned sB = sA + A_STAGE_BYTES + b * B_STAGE_BYTES;
#pragma unroll
      for (int i = 0; i < BK * (BN / 8) / LOADERS; ++i) {
        const int c = t + i * LOADERS;
        if (BT) { // row n of B^T: 8 chunks of K
          const int n = c / 8, ch = c % 8, nn = n0 + n, kk = k0 + ch * 8;
          const bool ok = nn < N && kk < K;
          cp_async_16(sB + bt_off(n, ch), ok ? gB[b] + (long long)nn * K + kk : gB[b], ok);
        } else {
          const int k = c / (BN / 8), ch = c % (BN / 8);
          const int kk = k0 + k, n = n0 + ch * 8;
          const bool ok = kk < K && n < N;
          cp_async_16(sB + b_off(k, ch), ok ? gB[b] + (long long)kk * N + n : gB[b], ok);
        }
      }
    }
  }

  // Issues (without waiting) warpgroup wg's wgmmas over stage `slot`.
  __device__ static __forceinline__ void mma_stage(unsigned s0, int slot, int wg, Acc &acc) {
    const unsigned sA = s0 + slot * STAGE_BYTES + wg * (64 * 128);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) {
      // K-major A: the next 16 columns start 32 bytes on within the swizzled rows.
      const unsigned long long da = wgmma_desc(sA + ks * 32, 16, 1024);
      auto b_desc = [&](int b) {
        const unsigned sB = s0 + slot * STAGE_BYTES + A_STAGE_BYTES + b * B_STAGE_BYTES;
        // N-major B: 16 k-rows are two 8-row groups (2 KiB); slabs are BK * 128 bytes apart.
        // K-major B (BT): as A, the next 16 k start 32 bytes on.
        return BT ? wgmma_desc(sB + ks * 32, 16, 1024) : wgmma_desc(sB + ks * 2048, BK * 128, 1024);
      };
      if constexpr (NB > 1 && NB * BN <= 256) {
        // The B tiles lie back to back with one stride (N-major: 64-column
        // slabs BK * 128 bytes apart; K-major: 128-byte rows n), and acc's
        // sets lie in order as one wider instruction's accumulators: one
        // m64 x NB*BN wgmma reads A from shared memory once instead of NB
        // times: a sixth fewer shared-memory reads a SwiGLU tile, energy
        // that at the card's power cap is clock (mixtral's forward +1 %).
        Wgmma<NB * BN, BT ? 0 : 1>::mma(reinterpret_cast<float(&)[NB * BN / 2]>(acc), da, b_desc(0));
      } else {
#pragma unroll
        for (int b = 0; b < NB; ++b)
          Wgmma<BN, BT ? 0 : 1>::mma(acc[b], da, b_desc(b));
      }
    }
    wgmma_commit();
  }

  // ---- B by TMA. tB[b]: operand b as a 3-D tensor map {N, K, batches}
  // with 64 x 64 boxes and the 128-byte swizzle, which lays each box out
  // exactly as b_off does (64-column slabs of 64 k-rows x 128 bytes, chunk c
  // of row k at c ^ (k & 7)): the consumers' wgmmas read it unchanged. BT:
  // B^T stored [N, K], a map {K, N, batches} whose boxes of 64 rows n land
  // as bt_off lays them out. One
  // loading thread tells the stage's `full` barrier how many bytes to
  // expect, then issues the boxes; the copy engine zero-fills past K and N.
  // A comes through one of two loaders:
  //   ACopy: rows through per-thread pointers (gathered rows), cp.async over
  //          the loading threads, zero past the tile's rows;
  //   ATma:  BM consecutive rows from row0 of a 2-D tensor map {K, rows}
  //          (a padded tensor in tile order, or a dense one), one box per
  //          64 rows that hold any of the tile's `rows`, laid out as a_off
  //          does (8-row atoms of 128-byte swizzled rows). Rows past `rows`
  //          are padding: their results are never stored, and a warpgroup
  //          whose 64 rows are all padding neither reads nor loads them (an
  //          expert's last tile often holds a few rows: its A traffic halves).
  template <int LOADERS> struct ACopyBy {
    const bf16 *const (&gA)[BM * 8 / LOADERS];
    const bool (&a_ok)[BM * 8 / LOADERS];
    static constexpr bool BY_TMA = false;
    __device__ unsigned tma_bytes() const { return 0; }
    __device__ void load(unsigned sA, int kt, int t, int K, unsigned) const { load_a<LOADERS>(sA, kt, t, gA, a_ok, K); }
  };
  typedef ACopyBy<THREADS> ACopy;
  struct ATma {
    const TmaDesc *map;
    int row0, rows;
    static constexpr bool BY_TMA = true;
    __device__ int boxes() const { return min(BM / 64, (rows + 63) / 64); }
    __device__ unsigned tma_bytes() const { return boxes() * (64 * 128); }
    __device__ void load(unsigned sA, int kt, int t, int, unsigned bar) const {
      if (t == 0)
#pragma unroll
        for (int j = 0; j < BM / 64; ++j)
          if (j < boxes())
            tma_load_3d(sA + j * (64 * 128), map, kt * BK, row0 + j * 64, 0, bar);
    }
  };
  // PAIR: this block is `rank` of a 2-block cluster sharing B: it issues
  // every other box, multicast to both blocks (mainloop_tma_pair).
  template <bool PAIR = false, typename ALoad>
  __device__ static __forceinline__ void load_stage_tma(unsigned s0, unsigned full, int slot, int kt, int t,
                                                        const ALoad &a, const TmaDesc *const (&tB)[NB], int batch,
                                                        int K, int n0, unsigned rank = 0) {
    const unsigned sA = s0 + slot * STAGE_BYTES, bar = full + 8 * slot;
    if (t == 0) { // the whole stage's bytes, before any copy of it can complete
      mbar_expect_tx(bar, NB * B_STAGE_BYTES + a.tma_bytes());
      // B's boxes first: in a pair the peer's stage waits for them too,
      // and A's cp.async copies below may stall this thread's issue.
#pragma unroll
      for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int s = 0; s < BN / 64; ++s) {
          // N-major B: slab s of 64 columns x 64 k-rows; K-major B^T (BT):
          // 64 rows n x 64 k, laid out as bt_off does (A's layout).
          const unsigned dst = sA + A_STAGE_BYTES + b * B_STAGE_BYTES + s * (BK * 128);
          const int c0 = BT ? kt * BK : n0 + s * 64, c1 = BT ? n0 + s * 64 : kt * BK;
          if (!PAIR)
            tma_load_3d(dst, tB[b], c0, c1, batch, bar);
          else if (((b * (BN / 64) + s) & 1) == (int)rank)
            tma_load_3d_multicast(dst, tB[b], c0, c1, batch, bar, (unsigned short)3);
        }
    }
    a.load(sA, kt, t, K, bar);
  }
  // The plain loop with TMA: every thread loads (its share of A when A is
  // gathered) and thread 0 issues the boxes; each stage's `full` mbarrier
  // completes when every thread's copies and the boxes' bytes have landed.
  // A block barrier per k step guards the slot being refilled, as in
  // cp_async_pipeline; two blocks per SM then overlap one's epilogue with
  // the other's main loop. `rows`: see WgmmaWsConfig::mainloop_tma.
  template <typename ALoad>
  __device__ static bool mainloop_tma(unsigned char *smem, const ALoad &a, const TmaDesc *const (&tB)[NB], int batch,
                                      int K, int n0, int rows, Acc &acc) {
    const int tid = threadIdx.x, wg = tid >> 7, KT = (K + BK - 1) / BK;
    const bool active = rows > wg * 64;
    const unsigned s0 = (smem_u32(smem) + 1023u) & ~1023u, full = s0 + STAGES * STAGE_BYTES;
    if (tid == 0)
      for (int s = 0; s < STAGES; ++s)
        mbar_init(full + 8 * s, THREADS);
    __syncthreads();
    auto load = [&](int kt) {
      load_stage_tma(s0, full, kt % STAGES, kt, tid, a, tB, batch, K, n0);
      cp_async_arrive_noinc(full + 8 * (kt % STAGES));
    };
    for (int kt = 0; kt < STAGES - 1 && kt < KT; ++kt)
      load(kt);
    for (int kt = 0; kt < KT; ++kt) {
      const int slot = kt % STAGES;
      mbar_wait(full + 8 * slot, (kt / STAGES) & 1);
      fence_proxy_async(); // A may have come through cp.async (the generic proxy)
      if (active)
        mma_stage(s0, slot, wg, acc);
      wgmma_wait<1>(); // this warpgroup is done with stage kt - 1 ...
      __syncthreads(); // ... and so is every other: its slot takes stage kt + STAGES - 1
      if (kt + STAGES - 1 < KT)
        load(kt + STAGES - 1);
    }
    wgmma_wait<0>();
    return true;
  }

  // ---- the output tile by TMA (TmaStoreTile): a block per tile stages it in
  // the ring, idle once the main loop is done.
  // out_begin: every consumer has finished reading the ring (a warpgroup
  // may run a few stages behind the other); returns the staging base.
  __device__ static __forceinline__ unsigned out_begin(unsigned char *smem) {
    named_barrier(1, BM * 2);
    return (smem_u32(smem) + 1023u) & ~1023u;
  }

  // Returns true: every thread of this configuration holds accumulators.
  __device__ static bool mainloop(unsigned char *smem, const bf16 *const (&gA)[A_ITERS], const bool (&a_ok)[A_ITERS],
                                  const bf16 *const (&gB)[NB], int K, int N, int n0, Acc &acc) {
    const int tid = threadIdx.x, wg = tid >> 7;
    const unsigned s0 = (smem_u32(smem) + 1023u) & ~1023u; // swizzle atoms are 1024-byte aligned
    cp_async_pipeline<STAGES>((K + BK - 1) / BK,
                              [&](int slot, int kt) { load_stage<THREADS>(s0, slot, kt, tid, gA, a_ok, gB, K, N, n0); },
                              [&](int slot) { mma_stage(s0, slot, wg, acc); });
    return true;
  }
};

// ------------------------------------------------------------ Hopper: expert reductions in place
// C[m, n] = sum over an expert's padded rows p of A[row_a(p), m] * B[row_b(p), n]
// (a weight gradient, X^T dH over the rows routed to the expert), with both
// operands read where they are: each stage holds BK rows p of A (its BM
// columns from m0) and of B (BN columns from n0), gathered through
// sorted_pair, zero on padding rows. Both are staged MN-major (64-column
// slabs of BK rows x 128 bytes, as WgmmaConfig's B), and wgmma reads A
// transposed (trans-a), so no transposed copy of A is ever written.
// Row maps: div 0 reads row p itself (a padded tensor), div d reads row
// sorted_pair[p] / d (d = 1: pair order; d = k: the token's row).
template <int BM_, int BN_, int STAGES_> struct WgmmaRowsConfig : TmaStoreTile<BN_> {
  static constexpr int BM = BM_, BN = BN_, BK = 64, STAGES = STAGES_, NB = 1;
  static constexpr int WG = BM / 64, THREADS = WG * 128;
  static constexpr int MI = 1, NI = BN / 8;
  static constexpr int A_STAGE_BYTES = BK * BM * 2, B_STAGE_BYTES = BK * BN * 2;
  static constexpr int STAGE_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024;
  static_assert(BM == 64 || BM == 128, "wgmma tiles are 64 or 128 rows");
  static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma tiles are 64, 128 or 256 columns");
  static_assert(STAGES >= 3, "wgmma overlaps one group in flight: at least three stages");

  typedef float Acc[1][BN / 2];
  __device__ static __forceinline__ float get(const Acc &acc, int b, int, int ni, int e) { return acc[b][ni * 4 + e]; }
  __device__ static __forceinline__ int acc_row(int warp, int lane, int, int e) {
    return (warp >> 2) * 64 + (warp & 3) * 16 + (lane >> 2) + (e >> 1) * 8;
  }
  __device__ static __forceinline__ int acc_col(int, int lane, int ni, int e) {
    return ni * 8 + (lane & 3) * 2 + (e & 1);
  }
  // MN-major: chunk ch (8 columns) of k-row k, in 64-column slabs.
  __device__ static __forceinline__ unsigned mn_off(int k, int ch) {
    return (ch >> 3) * (BK * 128) + k * 128 + (((ch & 7) ^ (k & 7)) << 4);
  }

  // A stage's k-rows are split over the loading warps: warp w of the
  // LOADERS threads owns rows w * RW .. w * RW + RW - 1, and lane q < RW of
  // it looks up row q's pair once per stage (lanes past RW repeat them),
  // two k-tiles ahead, so that the lookup's latency is spent while earlier
  // stages are copied. Each copy then takes its source row from that lane by
  // a shuffle. Looking the pair up per 16-byte chunk right before its copy,
  // as this loop first did, made the loaders wait on a dependent load every
  // stage, ~500 instructions a stage per warp: the consumers waited on full
  // stages 41 % of the time (Nsight Compute, H200, fine64's d_w1).
  template <int LOADERS> struct Rows {
    static constexpr int W = LOADERS / 32, RW = BK / W;
    static_assert(LOADERS % 32 == 0 && BK % W == 0 && RW <= 32, "whole warps, whole rows per warp");
    const int *sorted_pair = nullptr;
    int p_begin = 0, K = 0, t = 0;
    int ahead[2] = {-1, -1}; // this lane's k-row's pair in the next two k-tiles (loads in flight)

    __device__ __forceinline__ int k_row(int kt) const { return kt * BK + (t >> 5) * RW + (t & 31) % RW; }
    // sorted_pair at this lane's k-row of k-tile kt, clamped into the
    // expert's segment (next() drops what lies past it); the result is
    // waited for only where a copy uses it.
    __device__ __forceinline__ int lookup(int kt) const { return sorted_pair[p_begin + max(0, min(k_row(kt), K - 1))]; }
    // Thread t of the loaders, over the expert's padded rows p_begin ..
    // p_begin + K - 1 (K > 0: an expert with no rows runs no stage); a
    // padded position fits an int, as sorted_pair's int entries index pairs.
    __device__ __forceinline__ void start(int t_, const int *sp, long long begin, int k) {
      sorted_pair = sp, p_begin = (int)begin, K = k, t = t_;
      ahead[0] = lookup(0);
      ahead[1] = lookup(1);
    }
    // This lane's pair in k-tile kt (-1 past K or on padding), called for
    // kt = 0, 1, 2, ... in turn; issues the lookup two k-tiles ahead.
    __device__ __forceinline__ int next(int kt) {
      const int r = ahead[0];
      ahead[0] = ahead[1];
      ahead[1] = lookup(kt + 2);
      return k_row(kt) < K ? r : -1;
    }
    // The source row of this lane's k-row in an operand read with row map
    // `div` (0: the padded row itself, d: row pair / d), -1 where none.
    __device__ __forceinline__ int source(int kt, int r, int div) const {
      return r < 0 ? -1 : div == 0 ? p_begin + k_row(kt) : r / div;
    }
  };
  // One operand's BK rows x COLS columns (from c0 of `cols`) into s; `row`
  // is the source row of the loader lane's k-row (Rows::source). Copy i of
  // a lane moves chunk ch = lane % C of k-row q = i * R + lane / C (R rows
  // per warp-wide copy, consecutive lanes along a row, so each copy reads
  // whole 128-byte lines). Everything but the row is fixed per lane, so a
  // copy costs a shuffle, an address and the cp.async: the producer issues
  // 24 copies a stage for a 128 x 256 tile, and with the address math redone
  // per copy (~26 instructions each) it could not keep the consumers fed
  // (Nsight Compute, H200, mixtral's d_w1: consumers waiting on full stages
  // 40 % of the time, the producer never waiting on empty ones).
  template <int COLS, int LOADERS>
  __device__ static __forceinline__ void copy_rows(unsigned s, int t, int row, const bf16 *g, int cols, int c0) {
    constexpr int RW = Rows<LOADERS>::RW, C = COLS / 8, R = 32 / C; // 16-byte chunks per row, rows per copy
    static_assert(32 % C == 0 && RW % R == 0 && RW % 8 == 0, "whole rows per copy, whole copies per warp");
    const int lane = t & 31, l = lane / C, ch = lane % C, col = c0 + ch * 8;
    const bool col_ok = col < cols;
    // In bytes, so that each copy's address is one multiply-add (row x row
    // bytes + this lane's chunk); a valid address even where zero-filled.
    const char *g_lane = reinterpret_cast<const char *>(g + (col_ok ? col : 0));
    const int row_bytes = cols * 2;
    // mn_off(k, ch) for k = k_base + i * R + l: k_base is a multiple of 8 and
    // l < R, so k & 7 = ((i * R) & 7) ^ l and the swizzle splits into this
    // lane's part and a constant per copy.
    const unsigned s_lane = s + (ch >> 3) * (BK * 128) + ((t >> 5) * RW + l) * 128;
    const unsigned x_lane = ((ch & 7) ^ (l & 7)) << 4;
#pragma unroll
    for (int i = 0; i < RW / R; ++i) {
      const int src = __shfl_sync(0xffffffffu, row, i * R + l);
      cp_async_16(s_lane + i * R * 128 + (x_lane ^ (((i * R) & 7) << 4)), g_lane + (long long)max(src, 0) * row_bytes,
                  col_ok && src >= 0);
    }
  }

  template <int LOADERS>
  __device__ static __forceinline__ void load_stage(unsigned s0, int slot, int kt, int t, Rows<LOADERS> &rows,
                                                    const bf16 *A, int a_div, int M, int m0, const bf16 *B, int b_div,
                                                    int N, int n0) {
    const unsigned sA = s0 + slot * STAGE_BYTES;
    const int r = rows.next(kt);
    copy_rows<BM, LOADERS>(sA, t, rows.source(kt, r, a_div), A, M, m0);
    copy_rows<BN, LOADERS>(sA + A_STAGE_BYTES, t, rows.source(kt, r, b_div), B, N, n0);
  }

  __device__ static __forceinline__ void mma_stage(unsigned s0, int slot, int wg, Acc &acc) {
    const unsigned sA = s0 + slot * STAGE_BYTES + wg * (BK * 128); // this warpgroup's 64 columns of A
    const unsigned sB = s0 + slot * STAGE_BYTES + A_STAGE_BYTES;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) {
      // M-/N-major: 16 k-rows are two 8-row groups (2 KiB); slabs BK * 128 bytes apart.
      const unsigned long long da = wgmma_desc(sA + ks * 2048, BK * 128, 1024);
      const unsigned long long db = wgmma_desc(sB + ks * 2048, BK * 128, 1024);
      Wgmma<BN, 1, 1>::mma(acc[0], da, db);
    }
    wgmma_commit();
  }

  // K = the expert's padded rows (a multiple of the routing block; 0 for an
  // expert without pairs: acc stays zero). Returns true (every thread holds
  // accumulators).
  __device__ static bool mainloop(unsigned char *smem, const bf16 *A, int a_div, int M, int m0, const bf16 *B,
                                  int b_div, int N, int n0, const int *sorted_pair, long long p_begin, int K,
                                  Acc &acc) {
    const int wg = threadIdx.x >> 7;
    const unsigned s0 = (smem_u32(smem) + 1023u) & ~1023u;
    Rows<THREADS> rows;
    if (K > 0)
      rows.start(threadIdx.x, sorted_pair, p_begin, K);
    cp_async_pipeline<STAGES>((K + BK - 1) / BK,
                              [&](int slot, int kt) {
                                load_stage<THREADS>(s0, slot, kt, threadIdx.x, rows, A, a_div, M, m0, B, b_div, N, n0);
                              },
                              [&](int slot) { mma_stage(s0, slot, wg, acc); });
    return true;
  }
};

// ------------------------------------------------------------ Hopper: warp-specialised wgmma
// The warp-specialised pipeline both Hopper loops share. The last warpgroup
// produces: load(slot, kt, t) issues stage kt's copies (t = its thread,
// 0..127) and each copy's completion arrives on the stage's `full` barrier;
// the CONSUMERS threads before it wait on `full`, run mma(slot) and release
// the stage on `empty` once their wgmmas have read it. Returns false in the
// producer, which must then leave the kernel.
// GENERIC: some of a stage arrives through cp.async (the generic proxy), so
// consumers fence before wgmma reads it; stages written by TMA alone need no
// fence (the mbarrier's completion makes the async proxy's writes visible).
template <int STAGES, int CONSUMERS, bool GENERIC = true, typename Load, typename Mma>
__device__ __forceinline__ bool ws_pipeline(unsigned full, int KT, Load load, Mma mma) {
  const int tid = threadIdx.x, wg = tid >> 7;
  const unsigned empty = full + 8 * STAGES;
  if (tid == 0)
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, 128);             // every producer thread
      mbar_init(empty + 8 * s, CONSUMERS / 32); // every consumer warp
    }
  __syncthreads();
  if (wg == CONSUMERS / 128) { // ---- producer
    for (int kt = 0; kt < KT; ++kt) {
      const int slot = kt % STAGES;
      if (kt >= STAGES)
        mbar_wait(empty + 8 * slot, ((kt / STAGES) - 1) & 1);
      load(slot, kt, tid & 127);
      // Arrives once this thread's copies above have landed: no waiting here,
      // so the producer runs as far ahead as the free stages allow.
      cp_async_arrive_noinc(full + 8 * slot);
    }
    return false;
  }
  for (int kt = 0; kt < KT; ++kt) { // ---- consumers
    const int slot = kt % STAGES;
    mbar_wait(full + 8 * slot, (kt / STAGES) & 1);
    if (kt == 0)
      MF_STAMP(2);
    if (GENERIC)
      fence_proxy_async(); // the stage was written by cp.async (generic proxy); wgmma reads it (async proxy)
    mma(slot);
    wgmma_wait<1>(); // the previous stage's wgmmas are done: release it
    if (kt > 0 && (tid & 31) == 0)
      mbar_arrive(empty + 8 * ((kt - 1) % STAGES));
  }
  wgmma_wait<0>();
  return true;
}

// Persistent blocks of a warp-specialised loop (STAGES stages of
// STAGE_BYTES, CONSUMERS consumer threads and one producer warpgroup):
// their ring of stages, tile ids and the per-tile stage protocol, shared by
// WgmmaWsConfig and WgmmaRowsWsConfig.
template <int STAGES, int STAGE_BYTES, int CONSUMERS> struct TileRing {
  static constexpr int THREADS = CONSUMERS + 128;
  // One ring of stages for every tile a block runs.
  // Producer and consumers walk the same tiles with the same K, so their
  // stage counters (`it`) agree; the consumers release a tile's last stage
  // before its epilogue, so the producer fills the ring with the next tile's
  // data while the epilogue stores this one.
  //
  // Blocks take tiles in order from a counter (next_tile): the tiles in
  // flight then stay a window of consecutive ids, as when the hardware hands
  // out one block per tile, so an expert's weights are read from DRAM about
  // once. With a fixed stride (tile blockIdx.x + i * gridDim.x) blocks drift
  // apart and the same GEMM read a third more from DRAM (NOTES v14). The
  // producer's thread 0 draws the next id and publishes it in a 2-slot ring
  // (tile_full: it has written the slot; tile_empty: every warp has read it).
  struct Ring {
    unsigned s0, full, empty, tile_full, tile_empty, tile_ids, out;
    int it, fetches;
  };
  // Shared memory past the stages: out_bytes of output staging (out_reuse;
  // 1024-aligned, as the stages are), STAGES x (full, empty), then 2 x
  // (tile_full, tile_empty) and 2 tile ids, 48 bytes (the codegen's count).
  // blocks: whose warps release the stages and read the ids (1, or 2 for
  // a cluster's pair, pair_ring). Thread 0 initialises the barriers.
  __device__ static Ring ring_layout(unsigned char *smem, unsigned out_bytes, int blocks) {
    const unsigned s0 = (smem_u32(smem) + 1023u) & ~1023u, out = s0 + STAGES * STAGE_BYTES, bars = out + out_bytes;
    Ring r{s0, bars, bars + 8 * STAGES, bars + 16 * STAGES, bars + 16 * STAGES + 16, bars + 16 * STAGES + 32, out,
           0,  0};
    if (threadIdx.x == 0) {
      for (int s = 0; s < STAGES; ++s) {
        mbar_init(r.full + 8 * s, 128);                      // this block's producer threads
        mbar_init(r.empty + 8 * s, blocks * CONSUMERS / 32); // the consumer warps
      }
      for (int s = 0; s < 2; ++s) {
        mbar_init(r.tile_full + 8 * s, 1);
        mbar_init(r.tile_empty + 8 * s, blocks * THREADS / 32); // every warp (pairs: rank 0's)
      }
    }
    return r;
  }
  __device__ static Ring ring(unsigned char *smem, unsigned out_bytes = 0) {
    const Ring r = ring_layout(smem, out_bytes, 1);
    __syncthreads();
    return r;
  }
  // The id of this block's next tile (every thread calls it once per tile,
  // in the same order); counter[0]: ids drawn beyond the first gridDim.x.
  __device__ static long long next_tile(Ring &r, int *counter) {
    const int slot = r.fetches & 1, round = r.fetches >> 1;
    const int tid = threadIdx.x;
    ++r.fetches;
    if (tid == CONSUMERS) { // the producer's first thread draws
      if (round > 0)
        mbar_wait(r.tile_empty + 8 * slot, (round - 1) & 1);
      const long long id = (long long)gridDim.x + atomicAdd(counter, 1);
      asm volatile("st.shared.s64 [%0], %1;\n" ::"r"(r.tile_ids + 8 * slot), "l"(id) : "memory");
      mbar_arrive(r.tile_full + 8 * slot); // releases the store
    }
    mbar_wait(r.tile_full + 8 * slot, round & 1);
    long long id;
    asm volatile("ld.shared.s64 %0, [%1];\n" : "=l"(id) : "r"(r.tile_ids + 8 * slot) : "memory");
    __syncwarp();
    if ((tid & 31) == 0)
      mbar_arrive(r.tile_empty + 8 * slot);
    return id;
  }
  // After the loop over tiles: the last block to finish zeroes the counter
  // (counter[1] counts finished blocks) for the next launch, which the
  // stream orders after this one; no block draws again by then.
  __device__ static void tiles_done(int *counter) {
    if (threadIdx.x != CONSUMERS)
      return;
    __threadfence(); // this block's draws are done before it counts itself finished
    if (atomicAdd(counter + 1, 1) == (int)gridDim.x - 1) {
      counter[0] = 0;
      counter[1] = 0;
    }
  }
  // One tile's stages on the ring: the producer warpgroup issues KT stages
  // (load(slot, kt, t)) and returns false; the consumers run mma(slot) on
  // each, releasing every stage once their wgmmas have read it, and return
  // true with the tile's accumulators done.
  template <typename Load, typename Mma> __device__ static bool ring_stages(Ring &r, int KT, Load load, Mma mma) {
    const int tid = threadIdx.x;
    if (tid >= CONSUMERS) {
      for (int kt = 0; kt < KT; ++kt, ++r.it) {
        const int slot = r.it % STAGES;
        if (r.it >= STAGES)
          mbar_wait(r.empty + 8 * slot, ((r.it / STAGES) - 1) & 1);
        load(slot, kt, tid & 127);
        cp_async_arrive_noinc(r.full + 8 * slot);
      }
      return false;
    }
    for (int kt = 0; kt < KT; ++kt, ++r.it) {
      const int slot = r.it % STAGES;
      mbar_wait(r.full + 8 * slot, (r.it / STAGES) & 1);
      fence_proxy_async();
      mma(slot);
      wgmma_wait<1>();
      if (kt > 0 && (tid & 31) == 0)
        mbar_arrive(r.empty + 8 * ((r.it - 1) % STAGES));
    }
    wgmma_wait<0>();
    if (KT > 0 && (tid & 31) == 0)
      mbar_arrive(r.empty + 8 * ((r.it - 1) % STAGES)); // the tile's last stage
    return true;
  }
};

// WgmmaConfig's tile with one more warpgroup that only loads: the consumer
// warpgroups (threads 0 .. BM*2-1, as in WgmmaConfig) never wait on a block
// barrier, only on their stage's `full` mbarrier, and release the stage on
// its `empty` mbarrier once their wgmmas have read it. The producer gathers
// rows with cp.async (what TMA cannot do); each copy's completion arrives on
// the stage's `full` barrier, and consumers fence for the async proxy before
// their wgmmas read it. (setmaxnreg was
// tried to move registers from the producer to the consumers: ptxas still
// compiled the kernel under the 168-register entry cap and spilled, so the
// roles share the cap, which SwiGLU's 128 accumulators fit without spills.)
template <int BM_, int BN_, int STAGES_, int NB_, bool BT = false>
struct WgmmaWsConfig : WgmmaConfig<BM_, BN_, STAGES_, NB_, BT>,
                       TileRing<STAGES_, WgmmaConfig<BM_, BN_, STAGES_, NB_, BT>::STAGE_BYTES,
                                WgmmaConfig<BM_, BN_, STAGES_, NB_, BT>::WG * 128> {
  typedef WgmmaConfig<BM_, BN_, STAGES_, NB_, BT> Base;
  typedef TileRing<STAGES_, Base::STAGE_BYTES, Base::WG * 128> Tiles;
  using Base::A_STAGE_BYTES;
  using Base::B_STAGE_BYTES;
  using Base::BK;
  using Base::BM;
  using Base::BN;
  using Base::NB;
  using Base::STAGE_BYTES;
  using Base::STAGES;
  using typename Base::Acc;
  using typename Tiles::Ring;
  static constexpr int CONSUMERS = Base::WG * 128, THREADS = CONSUMERS + 128;
  static constexpr int A_ITERS = BM * 8 / 128;                      // A chunks per producer thread and stage
  static constexpr int SMEM_BYTES = Base::SMEM_BYTES + 16 * STAGES; // + the mbarriers
  // Every thread computes the producer's row pointers (by its lane in the
  // warpgroup), so the pointers stay valid whoever holds them.
  __device__ static __forceinline__ int a_load_row(int tid, int i) { return ((tid & 127) + i * 128) / 8; }
  __device__ static __forceinline__ int a_load_chunk(int tid, int i) { return ((tid & 127) + i * 128) % 8; }

  // ---- persistent 2-block clusters: the pair walks items (row tiles 2m and
  // 2m + 1 of a column tile) as one, sharing B through multicast when both
  // tiles are one expert's (`share`), each loading its own B otherwise. The
  // two blocks' rings stay in step (every item has the same K), and every
  // consumer warp releases each slot in both blocks whatever the item, so a
  // producer refills a slot only when both blocks are done with it: an item
  // that shares may follow one that did not. Rank 0's producer draws the
  // item ids and hands each to both blocks (pair_next); rank 1's warps
  // acknowledge on rank 0's barrier. pair_done ends with a cluster barrier,
  // so no remote release or id can reach a block that has left.
  // Shared memory: as ring(), each block's output staging past its own ring.
  __device__ static Ring pair_ring(unsigned char *smem, unsigned out_bytes = 0) {
    const Ring r = Tiles::ring_layout(smem, out_bytes, 2);
    if (threadIdx.x == 0)
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    cluster_sync(); // the peer's copies, releases and ids may reach these barriers from now on
    return r;
  }
  // The pair's next item (every thread of both blocks calls it once per item,
  // in the same order); counter[0]: ids drawn beyond the first gridDim.x / 2.
  __device__ static long long pair_next(Ring &r, int *counter) {
    const int slot = r.fetches & 1, round = r.fetches >> 1;
    const int tid = threadIdx.x;
    const unsigned rank = cluster_rank();
    ++r.fetches;
    if (rank == 0 && tid == CONSUMERS) { // rank 0's producer draws for both
      if (round > 0)
        mbar_wait_cluster(r.tile_empty + 8 * slot, (round - 1) & 1);
      const long long id = (long long)(gridDim.x / 2) + atomicAdd(counter, 1);
      asm volatile("st.shared.s64 [%0], %1;\n" ::"r"(r.tile_ids + 8 * slot), "l"(id) : "memory");
      st_cluster_s64(r.tile_ids + 8 * slot, 1, id);
      mbar_arrive(r.tile_full + 8 * slot);
      mbar_arrive_release_cluster(r.tile_full + 8 * slot, 1);
    }
    mbar_wait_cluster(r.tile_full + 8 * slot, round & 1);
    long long id;
    asm volatile("ld.shared.s64 %0, [%1];\n" : "=l"(id) : "r"(r.tile_ids + 8 * slot) : "memory");
    __syncwarp();
    // The id is read: rank 0 may reuse the slot. At the block's scope, as
    // the stage releases: a cluster-scope release would first wait for this
    // warp's epilogue stores to land (~1 us between items, measured).
    if ((tid & 31) == 0) {
      if (rank == 0)
        mbar_arrive(r.tile_empty + 8 * slot);
      else
        mbar_arrive_cluster(r.tile_empty + 8 * slot, 0);
    }
    return id;
  }
  __device__ static void pair_done(int *counter) {
    Tiles::tiles_done(counter);
    cluster_sync();
  }
  // One item's tile: as tile_tma, with B multicast when `share`.
  template <typename ALoad>
  __device__ static bool pair_tile_tma(Ring &r, const ALoad &a, const TmaDesc *const (&tB)[NB], int batch, int K,
                                       int n0, int rows, bool share, Acc &acc) {
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, KT = (K + BK - 1) / BK;
    const unsigned rank = cluster_rank(), peer = rank ^ 1u;
    if (wg == Base::WG) { // ---- producer
      const int t = tid & 127;
      for (int kt = 0; kt < KT; ++kt, ++r.it) {
        const int slot = r.it % STAGES;
        if (r.it >= STAGES)
          mbar_wait(r.empty + 8 * slot, ((r.it / STAGES) - 1) & 1);
        if (share)
          Base::template load_stage_tma<true>(r.s0, r.full, slot, kt, t, a, tB, batch, K, n0, rank);
        else
          Base::load_stage_tma(r.s0, r.full, slot, kt, t, a, tB, batch, K, n0);
        cp_async_arrive_noinc(r.full + 8 * slot);
      }
      return false;
    }
    const bool active = rows > wg * 64;
    auto release = [&](int it) { // slot of stage `it` in both blocks
      const unsigned bar = r.empty + 8 * (it % STAGES);
      if (lane == 0)
        mbar_arrive(bar);
      else if (lane == 1)
        mbar_arrive_cluster(bar, peer);
    };
    for (int kt = 0; kt < KT; ++kt, ++r.it) { // ---- consumers
      const int slot = r.it % STAGES;
      mbar_wait(r.full + 8 * slot, (r.it / STAGES) & 1);
      if (!ALoad::BY_TMA)
        fence_proxy_async(); // A came through cp.async
      if (active)
        Base::mma_stage(r.s0, slot, wg, acc);
      wgmma_wait<1>();
      if (kt > 0)
        release(r.it - 1);
    }
    wgmma_wait<0>();
    if (KT > 0)
      release(r.it - 1); // the item's last stage
    return true;
  }

  // One output tile: the producer issues its loads and returns false (go on
  // to the next tile); the consumers accumulate it into acc and return true.
  __device__ static bool tile(Ring &r, const bf16 *const (&gA)[A_ITERS], const bool (&a_ok)[A_ITERS],
                              const bf16 *const (&gB)[NB], int K, int N, int n0, Acc &acc) {
    return ring_tile(r, K, acc, [&](int slot, int kt, int t) {
      Base::template load_stage<128>(r.s0, slot, kt, t, gA, a_ok, gB, K, N, n0);
    });
  }
  // The same with B by TMA and A by `a` (ACopy or ATma; load_stage_tma);
  // `rows`: the tile's valid rows (mainloop_tma).
  template <typename ALoad>
  __device__ static bool tile_tma(Ring &r, const ALoad &a, const TmaDesc *const (&tB)[NB], int batch, int K, int n0,
                                  int rows, Acc &acc) {
    return ring_tile(
        r, K, acc,
        [&](int slot, int kt, int t) { Base::load_stage_tma(r.s0, r.full, slot, kt, t, a, tB, batch, K, n0); },
        rows > (threadIdx.x >> 7) * 64);
  }
  // ---- a chained product (GemmStep::chained): acc = A B + A2 B2, the
  // first product's k-tiles, then the second's, as one run of stages, so
  // the consumers see one main loop and one epilogue.
  template <typename ALoad>
  __device__ static __forceinline__ void
  load_chained(unsigned s0, unsigned full, int slot, int kt, int t, const ALoad &a, const TmaDesc *const (&tB)[NB],
               const ALoad &a2, const TmaDesc *const (&tB2)[NB], int batch, int K, int K2, int n0) {
    const int KT1 = (K + BK - 1) / BK;
    if (kt < KT1)
      Base::load_stage_tma(s0, full, slot, kt, t, a, tB, batch, K, n0);
    else
      Base::load_stage_tma(s0, full, slot, kt - KT1, t, a2, tB2, batch, K2, n0);
  }
  template <typename ALoad>
  __device__ static bool tile_tma_chain(Ring &r, const ALoad &a, const TmaDesc *const (&tB)[NB], const ALoad &a2,
                                        const TmaDesc *const (&tB2)[NB], int batch, int K, int K2, int n0, int rows,
                                        Acc &acc) {
    const int KT = (K + BK - 1) / BK + (K2 + BK - 1) / BK;
    return ring_tile(
        r, KT * BK, acc,
        [&](int slot, int kt, int t) { load_chained(r.s0, r.full, slot, kt, t, a, tB, a2, tB2, batch, K, K2, n0); },
        rows > (threadIdx.x >> 7) * 64);
  }
  template <typename ALoad>
  __device__ static bool mainloop_tma_chain(unsigned char *smem, const ALoad &a, const TmaDesc *const (&tB)[NB],
                                            const ALoad &a2, const TmaDesc *const (&tB2)[NB], int batch, int K, int K2,
                                            int n0, int rows, Acc &acc) {
    const int wg = threadIdx.x >> 7;
    const bool active = rows > wg * 64;
    const unsigned s0 = (smem_u32(smem) + 1023u) & ~1023u, full = s0 + STAGES * STAGE_BYTES;
    return ws_pipeline<STAGES, CONSUMERS, !ALoad::BY_TMA>(
        full, (K + BK - 1) / BK + (K2 + BK - 1) / BK,
        [&](int slot, int kt, int t) { load_chained(s0, full, slot, kt, t, a, tB, a2, tB2, batch, K, K2, n0); },
        [&](int slot) {
          if (active)
            Base::mma_stage(s0, slot, wg, acc);
        });
  }
  template <typename Load> __device__ static bool ring_tile(Ring &r, int K, Acc &acc, Load load, bool active = true) {
    const int wg = threadIdx.x >> 7;
    return Tiles::ring_stages(r, (K + BK - 1) / BK, load, [&](int slot) {
      if (active)
        Base::mma_stage(r.s0, slot, wg, acc);
    });
  }

  // Returns false in the producer warpgroup, which must then leave the kernel.
  __device__ static bool mainloop(unsigned char *smem, const bf16 *const (&gA)[A_ITERS], const bool (&a_ok)[A_ITERS],
                                  const bf16 *const (&gB)[NB], int K, int N, int n0, Acc &acc) {
    const int wg = threadIdx.x >> 7;
    const unsigned s0 = (smem_u32(smem) + 1023u) & ~1023u;
    return ws_pipeline<STAGES, CONSUMERS>(
        s0 + STAGES * STAGE_BYTES, (K + BK - 1) / BK,
        [&](int slot, int kt, int t) { Base::template load_stage<128>(s0, slot, kt, t, gA, a_ok, gB, K, N, n0); },
        [&](int slot) { Base::mma_stage(s0, slot, wg, acc); });
  }

  typedef typename Base::template ACopyBy<128> ACopy; // the producer warpgroup loads
  typedef typename Base::ATma ATma;
  // A warpgroup whose 64 rows are all past the tile's `rows` (an expert's
  // last, partly filled tile) skips its wgmmas but keeps the stage protocol:
  // the other warpgroup then has the tensor cores to itself.
  template <typename ALoad>
  __device__ static bool mainloop_tma(unsigned char *smem, const ALoad &a, const TmaDesc *const (&tB)[NB], int batch,
                                      int K, int n0, int rows, Acc &acc) {
    const int wg = threadIdx.x >> 7;
    const bool active = rows > wg * 64;
    const unsigned s0 = (smem_u32(smem) + 1023u) & ~1023u, full = s0 + STAGES * STAGE_BYTES;
    return ws_pipeline<STAGES, CONSUMERS, !ALoad::BY_TMA>(
        full, (K + BK - 1) / BK,
        [&](int slot, int kt, int t) { Base::load_stage_tma(s0, full, slot, kt, t, a, tB, batch, K, n0); },
        [&](int slot) {
          if (active)
            Base::mma_stage(s0, slot, wg, acc);
        });
  }

  // ---- two blocks of a cluster on row tiles of one expert (same B tiles).
  // Each block loads its own A and half of every stage's B boxes, multicast
  // into both blocks; each block's `full` barrier expects the whole stage.
  // A slot is refilled only when the consumers of both blocks have released
  // it (each consumer warp arrives on its own block's `empty` barrier from
  // lane 0 and on the peer's from lane 1). share = false: the blocks run
  // mainloop_tma independently (a partner tile of another expert, or none).
  // Lifetimes without a closing cluster barrier: a block touches the peer's
  // shared memory only through its multicast boxes, which the peer's
  // consumers wait for, and through releases of slots the peer's producer
  // will refill, which that producer waits for; so every remote access lands
  // before the peer can finish, and the releases of the last STAGES slots,
  // which nobody waits for, are not made.
  template <typename ALoad>
  __device__ static bool mainloop_tma_pair(unsigned char *smem, const ALoad &a, const TmaDesc *const (&tB)[NB],
                                           int batch, int K, int n0, int rows, bool share, Acc &acc) {
    if (!share)
      return mainloop_tma(smem, a, tB, batch, K, n0, rows, acc);
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, KT = (K + BK - 1) / BK;
    const unsigned rank = cluster_rank(), peer = rank ^ 1u;
    const unsigned s0 = (smem_u32(smem) + 1023u) & ~1023u, full = s0 + STAGES * STAGE_BYTES, empty = full + 8 * STAGES;
    if (tid == 0) {
      for (int s = 0; s < STAGES; ++s) {
        mbar_init(full + 8 * s, 128);                 // this block's producer threads
        mbar_init(empty + 8 * s, 2 * CONSUMERS / 32); // the consumer warps of both blocks
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    cluster_sync();       // the peer's copies and releases may reach these barriers from now on
    if (wg == Base::WG) { // ---- producer
      const int t = tid & 127;
      for (int kt = 0; kt < KT; ++kt) {
        const int slot = kt % STAGES;
        if (kt >= STAGES)
          mbar_wait(empty + 8 * slot, ((kt / STAGES) - 1) & 1);
        Base::template load_stage_tma<true>(s0, full, slot, kt, t, a, tB, batch, K, n0, rank);
        cp_async_arrive_noinc(full + 8 * slot);
      }
      return false;
    }
    const bool active = rows > wg * 64;
    for (int kt = 0; kt < KT; ++kt) { // ---- consumers
      const int slot = kt % STAGES;
      mbar_wait(full + 8 * slot, (kt / STAGES) & 1);
      if (kt == 0)
        MF_STAMP(2);
      if (!ALoad::BY_TMA)
        fence_proxy_async(); // A came through cp.async
      if (active)
        Base::mma_stage(s0, slot, wg, acc);
      wgmma_wait<1>();
      if (kt > 0 && kt - 1 + STAGES < KT) { // stage kt - 1's slot will be refilled: release it
        const unsigned prev = empty + 8 * ((kt - 1) % STAGES);
        if (lane == 0)
          mbar_arrive(prev);
        else if (lane == 1)
          mbar_arrive_cluster(prev, peer);
      }
    }
    wgmma_wait<0>();
    return true;
  }
};

// WgmmaRowsConfig with a producer warpgroup (ws_pipeline): the consumers
// never wait on a block barrier, and the row lookups through sorted_pair are
// off their path.
template <int BM_, int BN_, int STAGES_>
struct WgmmaRowsWsConfig
    : WgmmaRowsConfig<BM_, BN_, STAGES_>,
      TileRing<STAGES_, WgmmaRowsConfig<BM_, BN_, STAGES_>::STAGE_BYTES, WgmmaRowsConfig<BM_, BN_, STAGES_>::WG * 128> {
  typedef WgmmaRowsConfig<BM_, BN_, STAGES_> Base;
  typedef TileRing<STAGES_, Base::STAGE_BYTES, Base::WG * 128> Tiles;
  using typename Base::Acc;
  using typename Tiles::Ring;
  static constexpr int STAGES = STAGES_, CONSUMERS = Base::WG * 128, THREADS = CONSUMERS + 128;
  static constexpr int SMEM_BYTES = Base::SMEM_BYTES + 16 * STAGES; // + the mbarriers

  // Returns false in the producer warpgroup, which must then leave the kernel.
  __device__ static bool mainloop(unsigned char *smem, const bf16 *A, int a_div, int M, int m0, const bf16 *B,
                                  int b_div, int N, int n0, const int *sorted_pair, long long p_begin, int K,
                                  Acc &acc) {
    const int wg = threadIdx.x >> 7;
    const unsigned s0 = (smem_u32(smem) + 1023u) & ~1023u;
    typename Base::template Rows<128> rows;
    return ws_pipeline<STAGES, CONSUMERS>(
        s0 + STAGES * Base::STAGE_BYTES, (K + Base::BK - 1) / Base::BK,
        [&](int slot, int kt, int t) {
          if (kt == 0) // the producer's first stage: its first two lookups
            rows.start(t, sorted_pair, p_begin, K);
          Base::template load_stage<128>(s0, slot, kt, t, rows, A, a_div, M, m0, B, b_div, N, n0);
        },
        [&](int slot) { Base::mma_stage(s0, slot, wg, acc); });
  }
  // The same with either operand by TMA where it is a padded tensor whose
  // padding rows hold zeros (padded_elementwise), so that a stage's BK rows
  // p_begin + kt * BK .. are consecutive: BM / 64 (A) or BN / 64 (B) boxes
  // of 64 columns x 64 rows under the 128-byte swizzle (mn_off's slabs).
  // An operand not by TMA comes row by row through cp.async (gathered
  // through sorted_pair where its rows are the tokens'), zero on padding
  // rows and past K. A by TMA needs each expert's segment to be whole boxes
  // (the plan checks the block), since nothing else zeroes the next
  // segment's rows a box would run into; B by TMA may run past the segment,
  // where A's rows are zero. Every byte a TMA box moves needs no producer
  // instruction: the cp.async issue rate is what bounded this loop (two
  // thirds of a 128 x 256 stage is B).
  template <bool A_TMA, bool B_TMA>
  __device__ static bool mainloop_tma_rows(unsigned char *smem, const bf16 *A, const TmaDesc *tA, int a_div, int M,
                                           int m0, const bf16 *B, const TmaDesc *tB, int b_div, int N, int n0,
                                           const int *sorted_pair, long long p_begin, int K, Acc &acc) {
    const int wg = threadIdx.x >> 7;
    const unsigned s0 = (smem_u32(smem) + 1023u) & ~1023u, full = s0 + STAGES * Base::STAGE_BYTES;
    typename Base::template Rows<128> rows;
    return ws_pipeline<STAGES, CONSUMERS>(
        full, (K + Base::BK - 1) / Base::BK,
        [&](int slot, int kt, int t) {
          load_tma_rows<A_TMA, B_TMA>(s0, full, slot, kt, t, rows, A, tA, a_div, M, m0, B, tB, b_div, N, n0,
                                      sorted_pair, p_begin, K);
        },
        [&](int slot) { Base::mma_stage(s0, slot, wg, acc); });
  }
  // One output tile of a persistent block (codegen: persistent expert
  // reductions): the producer issues its stages on the ring and returns
  // false (on to its next tile, whose first stages then load while the
  // consumers store this one); the consumers return true with acc done.
  // Expert reductions are short in K (an expert's rows: 32 k-tiles for
  // mixtral), so a block per tile spent a tenth of each tile filling its
  // pipeline and storing its output with the tensor cores idle.
  template <bool A_TMA, bool B_TMA>
  __device__ static bool tile_tma_rows(Ring &r, const bf16 *A, const TmaDesc *tA, int a_div, int M, int m0,
                                       const bf16 *B, const TmaDesc *tB, int b_div, int N, int n0,
                                       const int *sorted_pair, long long p_begin, int K, Acc &acc) {
    const int wg = threadIdx.x >> 7;
    typename Base::template Rows<128> rows;
    return Tiles::ring_stages(
        r, (K + Base::BK - 1) / Base::BK,
        [&](int slot, int kt, int t) {
          load_tma_rows<A_TMA, B_TMA>(r.s0, r.full, slot, kt, t, rows, A, tA, a_div, M, m0, B, tB, b_div, N, n0,
                                      sorted_pair, p_begin, K);
        },
        [&](int slot) { Base::mma_stage(r.s0, slot, wg, acc); });
  }
  // Stage kt of the loops above into `slot`: the TMA operands' boxes from
  // thread t 0, the others' rows through cp.async from every producer
  // thread.
  template <bool A_TMA, bool B_TMA>
  __device__ static __forceinline__ void
  load_tma_rows(unsigned s0, unsigned full, int slot, int kt, int t, typename Base::template Rows<128> &rows,
                const bf16 *A, const TmaDesc *tA, int a_div, int M, int m0, const bf16 *B, const TmaDesc *tB, int b_div,
                int N, int n0, const int *sorted_pair, long long p_begin, int K) {
    constexpr bool ALL_TMA = A_TMA && B_TMA;
    if (kt == 0 && !ALL_TMA)
      rows.start(t, sorted_pair, p_begin, K);
    const unsigned sA = s0 + slot * Base::STAGE_BYTES, sB = sA + Base::A_STAGE_BYTES, bar = full + 8 * slot;
    const int k_row = (int)p_begin + kt * Base::BK;
    if ((A_TMA || B_TMA) && t == 0) { // the stage's TMA bytes, before this thread's own arrival can complete it
      mbar_expect_tx(bar, (B_TMA ? Base::B_STAGE_BYTES : 0) + (A_TMA ? Base::A_STAGE_BYTES : 0));
      if (B_TMA)
#pragma unroll
        for (int s = 0; s < Base::BN / 64; ++s)
          tma_load_3d(sB + s * (Base::BK * 128), tB, n0 + s * 64, k_row, 0, bar);
      if (A_TMA)
#pragma unroll
        for (int s = 0; s < Base::BM / 64; ++s)
          tma_load_3d(sA + s * (Base::BK * 128), tA, m0 + s * 64, k_row, 0, bar);
    }
    if (!ALL_TMA) {
      const int r = rows.next(kt);
      if (!A_TMA)
        Base::template copy_rows<Base::BM, 128>(sA, t, rows.source(kt, r, a_div), A, M, m0);
      if (!B_TMA)
        Base::template copy_rows<Base::BN, 128>(sB, t, rows.source(kt, r, b_div), B, N, n0);
    }
  }
};

} // namespace mf
