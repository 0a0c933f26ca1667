// moeforge's tile library, part 'wgmma_rows' (backends/cuda/device/tiles.cuh includes
// every part; NVRTC sees this one as "moeforge_tiles_wgmma_rows.cuh").
// Hopper: expert reductions read in place (WgmmaRowsConfig): both operands
// are rows of routed tensors, reduced over an expert's padded rows.
#pragma once
#include "moeforge_tiles_wgmma.cuh"

namespace mf {

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
// NB = 2: two reductions over the same A and rows (SwiGLU's dW1 and dW3,
// X^T dH1 and X^T dH3), each B's BN columns side by side in a stage, so
// one m64n(2 BN) wgmma computes both and A is loaded once for both; its
// accumulators are acc[b] (the wgmma's first BN / 2 registers per thread
// are B 0's columns). With BN = 128, f = 1408 takes 11 such tiles where
// two single-B reductions of 256 columns took 2 x 6, the last half empty.
template <int BM_, int BN_, int STAGES_, int NB_ = 1> struct WgmmaRowsConfig : TmaStoreTile<BN_> {
  static constexpr int BM = BM_, BN = BN_, BK = 64, STAGES = STAGES_, NB = NB_;
  static constexpr int WG = BM / 64, THREADS = WG * 128;
  static constexpr int MI = 1, NI = BN / 8;
  static constexpr int A_STAGE_BYTES = BK * BM * 2, B_STAGE_BYTES = NB * BK * BN * 2; // every B's columns
  static constexpr int STAGE_BYTES = A_STAGE_BYTES + B_STAGE_BYTES;
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024;
  static_assert(BM == 64 || BM == 128, "wgmma tiles are 64 or 128 rows");
  static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma tiles are 64, 128 or 256 columns");
  static_assert(NB == 1 || (NB == 2 && BN <= 128), "two B operands: one wgmma of at most 256 columns");
  static_assert(STAGES >= 3, "wgmma overlaps one group in flight: at least three stages");

  typedef float Acc[NB][BN / 2];
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
    static_assert(NB == 1, "two B operands come by TMA (WgmmaRowsWsConfig::load_tma_rows)");
    const unsigned sA = s0 + slot * STAGE_BYTES;
    const int r = rows.next(kt);
    copy_rows<BM, LOADERS>(sA, t, rows.source(kt, r, a_div), A, M, m0);
    copy_rows<BN, LOADERS>(sA + A_STAGE_BYTES, t, rows.source(kt, r, b_div), B, N, n0);
  }

  // W < BN: the tile's first W columns only (the narrow tail, as
  // WgmmaConfig::mma_stage).
  template <int W = BN> __device__ static __forceinline__ void mma_stage(unsigned s0, int slot, int wg, Acc &acc) {
    static_assert(W == BN || (W >= 64 && BN % W == 0 && NB == 1), "a stage is the whole tile or its first W columns");
    const unsigned sA = s0 + slot * STAGE_BYTES + wg * (BK * 128); // this warpgroup's 64 columns of A
    const unsigned sB = s0 + slot * STAGE_BYTES + A_STAGE_BYTES;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) {
      // M-/N-major: 16 k-rows are two 8-row groups (2 KiB); slabs BK * 128 bytes apart.
      const unsigned long long da = wgmma_desc(sA + ks * 2048, BK * 128, 1024);
      const unsigned long long db = wgmma_desc(sB + ks * 2048, BK * 128, 1024);
      Wgmma<NB * W, 1, 1>::mma(reinterpret_cast<float(&)[NB * W / 2]>(acc[0]), da, db);
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

} // namespace mf
