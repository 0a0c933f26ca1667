// moeforge's tile library, part 'wgmma_ws' (backends/cuda/device/tiles.cuh includes
// every part; NVRTC sees this one as "moeforge_tiles_wgmma_ws.cuh").
// Hopper: the warp-specialised pipeline (a producer warpgroup loads, the
// consumers compute), its tile ring, and the warp-specialised forms of the
// two main loops (WgmmaWsConfig, WgmmaRowsWsConfig) with persistent walks.
#pragma once
#include "moeforge_tiles_wgmma_rows.cuh"

namespace mf {

// ------------------------------------------------------------ Hopper: warp-specialised wgmma
// One stage's wgmmas of a wgmma configuration (WgmmaConfig,
// WgmmaRowsConfig): the whole tile, or (the narrow tail: `cols`, the tile's
// columns before N, half of BN or fewer) its first BN / 2 or BN / 4 columns
// by the narrower instruction that covers them (the plan's narrow_width).
// The choice is made per tile, around whole groups, never between the
// wgmmas of one (which would serialise every wgmma of the kernel).
template <typename Cfg>
__device__ __forceinline__ void mma_stage_cols(unsigned s0, int slot, int wg, int cols, typename Cfg::Acc &acc) {
  constexpr int BN = Cfg::BN;
  if constexpr (Cfg::NB == 1 && BN >= 128) {
    if constexpr (BN / 4 >= 64) {
      if (cols <= BN / 4) {
        Cfg::template mma_stage<BN / 4>(s0, slot, wg, acc);
        return;
      }
    }
    if (cols <= BN / 2) {
      Cfg::template mma_stage<BN / 2>(s0, slot, wg, acc);
      return;
    }
  }
  Cfg::mma_stage(s0, slot, wg, acc);
}

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
  // apart and the same GEMM read a third more from DRAM. The
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
  // One item's tile: as tile() over TmaLoads, with B multicast when `share`.
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

  // ---- what a stage loads: one type per way the operands come, which
  // either walk below takes (a block per tile: mainloop; persistent: tile).
  // Each says how many k-tiles the tile has, loads stage kt into `slot` from
  // producer thread t, whether A comes by TMA (else the consumers fence the
  // generic proxy's cp.async copies), and whether a warpgroup whose 64 rows
  // are all past the tile's `rows` skips its wgmmas (an expert's last,
  // partly filled tile: the other warpgroup then has the tensor cores).
  // A and B through per-thread pointers, by cp.async (rows unknown here).
  struct CopyLoads {
    const bf16 *const (&gA)[A_ITERS];
    const bool (&a_ok)[A_ITERS];
    const bf16 *const (&gB)[NB];
    int K, N, n0;
    static constexpr bool BY_TMA = false, SKIPS_EMPTY = false;
    __device__ int k_tiles() const { return (K + BK - 1) / BK; }
    __device__ void load(unsigned s0, unsigned, int slot, int kt, int t) const {
      Base::template load_stage<128>(s0, slot, kt, t, gA, a_ok, gB, K, N, n0);
    }
  };
  // B by TMA, A by `a` (ACopy or ATma; load_stage_tma).
  template <typename ALoad> struct TmaLoads {
    const ALoad &a;
    const TmaDesc *const (&tB)[NB];
    int batch, K, n0;
    static constexpr bool BY_TMA = ALoad::BY_TMA, SKIPS_EMPTY = true;
    __device__ int k_tiles() const { return (K + BK - 1) / BK; }
    __device__ void load(unsigned s0, unsigned full, int slot, int kt, int t) const {
      Base::load_stage_tma(s0, full, slot, kt, t, a, tB, batch, K, n0);
    }
  };
  // A chained product (GemmStep::chained): acc = A B + A2 B2, the first
  // product's k-tiles, then the second's, as one run of stages, so the
  // consumers see one main loop and one epilogue.
  template <typename ALoad> struct ChainLoads {
    const ALoad &a;
    const TmaDesc *const (&tB)[NB];
    const ALoad &a2;
    const TmaDesc *const (&tB2)[NB];
    int batch, K, K2, n0;
    static constexpr bool BY_TMA = ALoad::BY_TMA, SKIPS_EMPTY = true;
    __device__ int k_tiles() const { return (K + BK - 1) / BK + (K2 + BK - 1) / BK; }
    __device__ void load(unsigned s0, unsigned full, int slot, int kt, int t) const {
      const int KT1 = (K + BK - 1) / BK;
      if (kt < KT1)
        Base::load_stage_tma(s0, full, slot, kt, t, a, tB, batch, K, n0);
      else
        Base::load_stage_tma(s0, full, slot, kt - KT1, t, a2, tB2, batch, K2, n0);
    }
  };
  template <typename ALoad>
  __device__ static TmaLoads<ALoad> tma_loads(const ALoad &a, const TmaDesc *const (&tB)[NB], int batch, int K,
                                              int n0) {
    return {a, tB, batch, K, n0};
  }
  template <typename ALoad>
  __device__ static ChainLoads<ALoad> chain_loads(const ALoad &a, const TmaDesc *const (&tB)[NB], const ALoad &a2,
                                                  const TmaDesc *const (&tB2)[NB], int batch, int K, int K2, int n0) {
    return {a, tB, a2, tB2, batch, K, K2, n0};
  }

  // ---- the walks. A block per tile: the producer warpgroup loads the
  // tile's stages and returns false (it must then leave the kernel); the
  // consumers accumulate into acc and return true. cols: the tile's columns
  // before N where the narrow tail is on (BN / 2 or fewer: its wgmmas are
  // narrower, and acc's sets past them stay as they were).
  template <typename Loads>
  __device__ static bool mainloop(unsigned char *smem, const Loads &l, int rows, Acc &acc, int cols = BN) {
    const int wg = threadIdx.x >> 7;
    const bool active = !Loads::SKIPS_EMPTY || rows > wg * 64;
    const unsigned s0 = (smem_u32(smem) + 1023u) & ~1023u, full = s0 + STAGES * STAGE_BYTES;
    return ws_pipeline<STAGES, CONSUMERS, !Loads::BY_TMA>(
        full, l.k_tiles(), [&](int slot, int kt, int t) { l.load(s0, full, slot, kt, t); },
        [&](int slot) {
          if (active)
            mma_stage_cols<Base>(s0, slot, wg, cols, acc);
        });
  }
  // Persistent blocks: one output tile on the ring; the producer issues its
  // loads and returns false (go on to the next tile), the consumers
  // accumulate it and return true.
  template <typename Loads> __device__ static bool tile(Ring &r, const Loads &l, int rows, Acc &acc, int cols = BN) {
    const int wg = threadIdx.x >> 7;
    const bool active = !Loads::SKIPS_EMPTY || rows > wg * 64;
    return Tiles::ring_stages(
        r, l.k_tiles(), [&](int slot, int kt, int t) { l.load(r.s0, r.full, slot, kt, t); },
        [&](int slot) {
          if (active)
            mma_stage_cols<Base>(r.s0, slot, wg, cols, acc);
        });
  }

  typedef typename Base::template ACopyBy<128> ACopy; // the producer warpgroup loads
  typedef typename Base::ATma ATma;

  // ---- two blocks of a cluster on row tiles of one expert (same B tiles).
  // Each block loads its own A and half of every stage's B boxes, multicast
  // into both blocks; each block's `full` barrier expects the whole stage.
  // A slot is refilled only when the consumers of both blocks have released
  // it (each consumer warp arrives on its own block's `empty` barrier from
  // lane 0 and on the peer's from lane 1). share = false: the blocks run
  // mainloop over TmaLoads independently (a partner tile of another expert, or none).
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
      return mainloop(smem, tma_loads(a, tB, batch, K, n0), rows, acc);
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
template <int BM_, int BN_, int STAGES_, int NB_ = 1>
struct WgmmaRowsWsConfig : WgmmaRowsConfig<BM_, BN_, STAGES_, NB_>,
                           TileRing<STAGES_, WgmmaRowsConfig<BM_, BN_, STAGES_, NB_>::STAGE_BYTES,
                                    WgmmaRowsConfig<BM_, BN_, STAGES_, NB_>::WG * 128> {
  typedef WgmmaRowsConfig<BM_, BN_, STAGES_, NB_> Base;
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
  // thirds of a 128 x 256 stage is B). A B by TMA stored sorted (without
  // the padding: lowering/sorted_rows.h) has its rows b_shift before the
  // padded ones; its boxes run past the expert's rows where A's are zero.
  // (B_SHIFTED: b_shift is read; otherwise it is not even captured, so the
  // loops without it keep their registers: the persistent dW2 spilled when
  // every loop carried it.) A_MASKED: A and B both stored sorted, p_begin
  // the expert's unpadded first row and K its pairs, so the last k-tile's
  // boxes run into the next expert's rows in both; the consumers zero A's
  // there (zero_a_rows) before their wgmmas read the stage. tB2: the
  // second B's map (NB = 2; both B by TMA, alike in rows and layout).
  template <bool A_TMA, bool B_TMA, bool B_SHIFTED = false, bool A_MASKED = false>
  __device__ static bool mainloop(unsigned char *smem, const bf16 *A, const TmaDesc *tA, int a_div, int M, int m0,
                                  const bf16 *B, const TmaDesc *tB, int b_div, int N, int n0, const int *sorted_pair,
                                  long long p_begin, int K, Acc &acc, int cols = Base::BN, int b_shift = 0,
                                  const TmaDesc *tB2 = nullptr) {
    static_assert(!A_MASKED || (A_TMA && B_TMA && !B_SHIFTED), "a masked A: both operands sorted, by TMA");
    const int wg = threadIdx.x >> 7, KT = (K + Base::BK - 1) / Base::BK;
    const unsigned s0 = (smem_u32(smem) + 1023u) & ~1023u, full = s0 + STAGES * Base::STAGE_BYTES;
    typename Base::template Rows<128> rows;
    int seen = 0; // the consumers' stages of this tile so far
    return ws_pipeline<STAGES, CONSUMERS>(
        full, KT,
        [&](int slot, int kt, int t) {
          int shift = 0;
          if constexpr (B_SHIFTED)
            shift = b_shift;
          const TmaDesc *second = nullptr; // captured only by the two-B loops
          if constexpr (Base::NB == 2)
            second = tB2;
          load_tma_rows<A_TMA, B_TMA>(s0, full, slot, kt, t, rows, A, tA, a_div, M, m0, B, tB, b_div, N, n0,
                                      sorted_pair, p_begin, K, shift, second);
        },
        [&](int slot) {
          if constexpr (A_MASKED)
            if (++seen == KT && K % Base::BK != 0)
              zero_a_rows(s0, slot, wg, K % Base::BK);
          mma_stage_cols<Base>(s0, slot, wg, cols, acc);
        });
  }
  // One output tile of a persistent block (codegen: persistent expert
  // reductions): the producer issues its stages on the ring and returns
  // false (on to its next tile, whose first stages then load while the
  // consumers store this one); the consumers return true with acc done.
  // Expert reductions are short in K (an expert's rows: 32 k-tiles for
  // mixtral), so a block per tile spent a tenth of each tile filling its
  // pipeline and storing its output with the tensor cores idle.
  template <bool A_TMA, bool B_TMA, bool B_SHIFTED = false, bool A_MASKED = false>
  __device__ static bool tile(Ring &r, const bf16 *A, const TmaDesc *tA, int a_div, int M, int m0, const bf16 *B,
                              const TmaDesc *tB, int b_div, int N, int n0, const int *sorted_pair, long long p_begin,
                              int K, Acc &acc, int cols = Base::BN, int b_shift = 0, const TmaDesc *tB2 = nullptr) {
    static_assert(!A_MASKED || (A_TMA && B_TMA && !B_SHIFTED), "a masked A: both operands sorted, by TMA");
    const int wg = threadIdx.x >> 7, KT = (K + Base::BK - 1) / Base::BK;
    typename Base::template Rows<128> rows;
    int seen = 0; // the consumers' stages of this tile so far
    return Tiles::ring_stages(
        r, KT,
        [&](int slot, int kt, int t) {
          int shift = 0;
          if constexpr (B_SHIFTED)
            shift = b_shift;
          const TmaDesc *second = nullptr; // captured only by the two-B loops
          if constexpr (Base::NB == 2)
            second = tB2;
          load_tma_rows<A_TMA, B_TMA>(r.s0, r.full, slot, kt, t, rows, A, tA, a_div, M, m0, B, tB, b_div, N, n0,
                                      sorted_pair, p_begin, K, shift, second);
        },
        [&](int slot) {
          if constexpr (A_MASKED)
            if (++seen == KT && K % Base::BK != 0)
              zero_a_rows(r.s0, slot, wg, K % Base::BK);
          mma_stage_cols<Base>(r.s0, slot, wg, cols, acc);
        });
  }
  // Zeroes k-rows from .. BK - 1 of warpgroup wg's 64 columns of A in stage
  // `slot` (a masked A's last k-tile), whole 128-byte rows, which the
  // swizzle only permutes within, then makes every thread's stores visible
  // to the warpgroup's wgmmas (the async proxy). No wgmma in flight reads
  // this stage, and the producer refills it only once it is released.
  __device__ static __forceinline__ void zero_a_rows(unsigned s0, int slot, int wg, int from) {
    const unsigned sA = s0 + slot * Base::STAGE_BYTES + wg * (Base::BK * 128); // (BK, 64) MN-major
    for (int i = from * 8 + (threadIdx.x & 127); i < Base::BK * 8; i += 128)
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(sA + i * 16), "r"(0) : "memory");
    fence_proxy_async();
    named_barrier(2 + wg, 128);
  }
  // Stage kt of the loops above into `slot`: the TMA operands' boxes from
  // thread t 0, the others' rows through cp.async from every producer
  // thread.
  template <bool A_TMA, bool B_TMA>
  __device__ static __forceinline__ void
  load_tma_rows(unsigned s0, unsigned full, int slot, int kt, int t, typename Base::template Rows<128> &rows,
                const bf16 *A, const TmaDesc *tA, int a_div, int M, int m0, const bf16 *B, const TmaDesc *tB, int b_div,
                int N, int n0, const int *sorted_pair, long long p_begin, int K, int b_shift, const TmaDesc *tB2) {
    constexpr bool ALL_TMA = A_TMA && B_TMA;
    static_assert(Base::NB == 1 || B_TMA, "two B operands come by TMA");
    if (kt == 0 && !ALL_TMA)
      rows.start(t, sorted_pair, p_begin, K);
    const unsigned sA = s0 + slot * Base::STAGE_BYTES, sB = sA + Base::A_STAGE_BYTES, bar = full + 8 * slot;
    const int k_row = (int)p_begin + kt * Base::BK;
    if ((A_TMA || B_TMA) && t == 0) { // the stage's TMA bytes, before this thread's own arrival can complete it
      mbar_expect_tx(bar, (B_TMA ? Base::B_STAGE_BYTES : 0) + (A_TMA ? Base::A_STAGE_BYTES : 0));
      if (B_TMA)
#pragma unroll
        for (int s = 0; s < Base::BN / 64; ++s) {
          tma_load_3d(sB + s * (Base::BK * 128), tB, n0 + s * 64, k_row - b_shift, 0, bar);
          if constexpr (Base::NB == 2) // the second B's slabs after the first's, as one wgmma reads them
            tma_load_3d(sB + (Base::BN / 64 + s) * (Base::BK * 128), tB2, n0 + s * 64, k_row - b_shift, 0, bar);
        }
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
