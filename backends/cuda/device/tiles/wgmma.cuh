// moeforge's tile library, part 'wgmma' (backends/cuda/device/tiles.cuh includes
// every part; NVRTC sees this one as "moeforge_tiles_wgmma.cuh").
// Hopper: warpgroup MMA (wgmma) from shared-memory descriptors, output
// tiles stored by TMA, and the main loop over dense or row-gathered operands
// (WgmmaConfig).
#pragma once
#include "moeforge_tiles_cluster.cuh"
#include "moeforge_tiles_mma_sync.cuh"

namespace mf {

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
      const int bytes = chunk_bytes_bf16(a_ok[i], k0 + ch * 8, K);
      cp_async_16_part(sA + a_off(row, ch), bytes ? gA[i] + k0 : gA[i], bytes);
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

  // Issues (without waiting) warpgroup wg's wgmmas over stage `slot`. W <
  // BN: the tile's first W columns only, by the m64nW instruction into the
  // first W / 2 accumulators of each set (a column tile whose columns past
  // W lie past N: the narrow tail, GemmTiling::narrow_tail); the stage's B
  // slabs are read from the same places, the first W / 64 of them.
  template <int W = BN> __device__ static __forceinline__ void mma_stage(unsigned s0, int slot, int wg, Acc &acc) {
    static_assert(W == BN || (W >= 64 && BN % W == 0 && NB == 1), "a narrower stage has one B operand");
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
      if constexpr (W < BN) {
        Wgmma<W, BT ? 0 : 1>::mma(reinterpret_cast<float(&)[W / 2]>(acc[0]), da, b_desc(0));
      } else if constexpr (NB > 1 && NB * BN <= 256) {
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
  // the other's main loop. `rows`: as WgmmaWsConfig's TmaLoads (SKIPS_EMPTY).
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

} // namespace mf
