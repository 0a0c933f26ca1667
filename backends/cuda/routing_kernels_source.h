// The CUDA source of the device routing, compiled at run time with NVRTC
// (routing_kernels.cpp passes MF_THREADS, MF_CHUNK and MF_MAX_EXPERTS with
// -D, so host and device agree on them). The format it produces is described
// in routing_host.h; route_on_host() there is its oracle.
//
// Four steps, no host synchronisation between them, every result
// deterministic (no atomics decide a position):
//   moe_topk             one warp per token: the row's softmax when asked
//                        (the router's, fused), then k rounds of a warp argmax
//   moe_chunk_histogram  per chunk of MF_CHUNK pairs, pairs per expert
//   moe_scan_offsets     one block: per expert a scan over chunks, then a scan
//                        over experts (counts, padded and unpadded offsets),
//                        then the tile table and the -1 of every padding row
//                        of sorted_pair (one launch: each was a graph node)
//   moe_stable_scatter   per chunk: each pair's rank among earlier pairs of
//                        its expert, hence pair_pos and sorted_pair
#pragma once

namespace moeforge::cuda {

inline constexpr const char kRoutingKernelsSource[] = R"moeforge(
#ifndef MF_THREADS
#error "compile with -DMF_THREADS=<threads per block>"
#endif

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kNoExpert = 0x7fffffff;
constexpr int kWarps = MF_THREADS / 32;
constexpr int kPairsPerThread = MF_CHUNK / MF_THREADS;
constexpr int kExpertsPerLane = MF_MAX_EXPERTS / 32;
static_assert(MF_THREADS % 32 == 0, "whole warps");
static_assert(MF_CHUNK % MF_THREADS == 0, "a chunk is whole rounds of the block");
static_assert(MF_MAX_EXPERTS % 32 == 0 && MF_MAX_EXPERTS <= MF_THREADS, "one thread per expert in a block");

// The top-k order: larger probability first, then the lower expert index.
// kNoExpert marks "no candidate" and loses to everything.
__device__ __forceinline__ bool beats(float p, int e, float q, int f) {
  return e != kNoExpert && (f == kNoExpert || p > q || (p == q && e < f));
}

// The row's softmax in place: p = expf(x - max) / sum of expf(x - max), the
// formula and the order of every operation of the generated pointwise softmax
// (codegen_cuda.cpp, emit_softmax_row: lane l holds columns l, l+32, ...,
// sums them in that order, then the same butterflies), so routing logits with
// softmax = 1 selects and gates bit for bit as routing stored probabilities.
__device__ __forceinline__ void row_softmax(float (&rP)[kExpertsPerLane], unsigned live) {
  float row_max = -__int_as_float(0x7f800000), row_sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kExpertsPerLane; ++j)
    if ((live >> j) & 1u)
      row_max = fmaxf(row_max, rP[j]);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1)
    row_max = fmaxf(row_max, __shfl_xor_sync(kFullMask, row_max, d));
#pragma unroll
  for (int j = 0; j < kExpertsPerLane; ++j)
    if ((live >> j) & 1u) {
      rP[j] = expf(rP[j] - row_max);
      row_sum += rP[j];
    }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1)
    row_sum += __shfl_xor_sync(kFullMask, row_sum, d);
#pragma unroll
  for (int j = 0; j < kExpertsPerLane; ++j)
    if ((live >> j) & 1u)
      rP[j] = rP[j] / row_sum;
}

// expert[t*k + s], gate[t*k + s]: the s-th largest probability of row t,
// where the probabilities are `scores`, or their row softmax when `softmax`
// is set (scores are then logits). Lane l holds experts l, l+32, l+64, ... in
// registers (loads coalesce, and the loops over them unroll, so nothing goes
// to local memory); a bit per held expert says whether it is still a
// candidate.
extern "C" __global__ void __launch_bounds__(MF_THREADS)
moe_topk(const float *__restrict__ scores,  // (T, E)
         int tokens, int experts, int k, int softmax,
         int *__restrict__ expert,          // (T*k)
         float *__restrict__ gate) {        // (T*k)
  const int lane = threadIdx.x & 31;
  const long long t = (long long)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (t >= tokens)
    return; // uniform per warp: the shuffles below see full warps
  const float *row = scores + t * experts;
  float rP[kExpertsPerLane]; // (E / 32) probabilities of this lane
  unsigned live = 0;
#pragma unroll
  for (int j = 0; j < kExpertsPerLane; ++j) {
    const int e = j * 32 + lane;
    rP[j] = e < experts ? row[e] : 0.0f;
    live |= (e < experts ? 1u : 0u) << j;
  }
  if (softmax) // uniform over the grid
    row_softmax(rP, live);
  for (int s = 0; s < k; ++s) {
    // This lane's best candidate; j ascending is expert ascending, so a
    // strict > keeps the lower expert on ties.
    float best = 0.0f;
    int best_e = kNoExpert;
#pragma unroll
    for (int j = 0; j < kExpertsPerLane; ++j)
      if (((live >> j) & 1u) && (best_e == kNoExpert || rP[j] > best)) {
        best = rP[j];
        best_e = j * 32 + lane;
      }
    // Butterfly argmax: a total order, so every lane ends with the winner.
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      const float other = __shfl_xor_sync(kFullMask, best, d);
      const int other_e = __shfl_xor_sync(kFullMask, best_e, d);
      if (beats(other, other_e, best, best_e)) {
        best = other;
        best_e = other_e;
      }
    }
    if (lane == (best_e & 31))
      live &= ~(1u << (best_e >> 5));
    if (lane == 0) {
      expert[t * k + s] = best_e;
      gate[t * k + s] = best;
    }
  }
}

// chunk_counts[c, e]: pairs of chunk c (pairs c*MF_CHUNK ...) routed to e.
// Shared-memory atomics only count, so the result is order-independent.
extern "C" __global__ void __launch_bounds__(MF_THREADS)
moe_chunk_histogram(const int *__restrict__ expert, // (P)
                    int pairs, int experts,
                    int *__restrict__ chunk_counts) { // (chunks, E)
  __shared__ int sCount[MF_MAX_EXPERTS];
  for (int e = threadIdx.x; e < experts; e += MF_THREADS)
    sCount[e] = 0;
  __syncthreads();
  const long long begin = (long long)blockIdx.x * MF_CHUNK;
  for (int i = threadIdx.x; i < MF_CHUNK; i += MF_THREADS)
    if (begin + i < pairs)
      atomicAdd(&sCount[expert[begin + i]], 1);
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += MF_THREADS)
    chunk_counts[(long long)blockIdx.x * experts + e] = sCount[e];
}

// Warp 0 of moe_scan_offsets. Lane l owns experts l*kExpertsPerLane ...: sum
// them, scan the lane sums across the warp, then walk the owned experts again
// writing offsets (to global memory and to sOffsets).
__device__ void scan_experts(int experts, int block, const int *sCount, const int *sPadded, int *sOffsets,
                             int *__restrict__ offsets, int *__restrict__ offsets_unpadded,
                             int *__restrict__ num_tiles) {
  const int lane = threadIdx.x;
  int sum_p = 0, sum_u = 0;
#pragma unroll
  for (int j = 0; j < kExpertsPerLane; ++j) {
    const int e = lane * kExpertsPerLane + j;
    if (e < experts) {
      sum_p += sPadded[e];
      sum_u += sCount[e];
    }
  }
  int incl_p = sum_p, incl_u = sum_u;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int p = __shfl_up_sync(kFullMask, incl_p, d);
    const int u = __shfl_up_sync(kFullMask, incl_u, d);
    if (lane >= d) {
      incl_p += p;
      incl_u += u;
    }
  }
  int run_p = incl_p - sum_p, run_u = incl_u - sum_u;
#pragma unroll
  for (int j = 0; j < kExpertsPerLane; ++j) {
    const int e = lane * kExpertsPerLane + j;
    if (e < experts) {
      offsets[e] = run_p;
      sOffsets[e] = run_p;
      offsets_unpadded[e] = run_u;
      run_p += sPadded[e];
      run_u += sCount[e];
    }
  }
  if (lane == 31) {
    offsets[experts] = incl_p;
    sOffsets[experts] = incl_p;
    offsets_unpadded[experts] = incl_u;
    *num_tiles = incl_p / block;
  }
}

// One block. Thread e scans expert e's counts over chunks (chunk_base[c, e]
// = e's pairs in chunks before c); warp 0 then scans the experts; then the
// whole block writes the tile table and the padding rows of sorted_pair
// (-1; moe_stable_scatter writes every real row).
extern "C" __global__ void __launch_bounds__(MF_THREADS)
moe_scan_offsets(const int *__restrict__ chunk_counts, // (chunks, E)
                 int chunks, int experts, int block, int max_tiles, int max_padded_rows,
                 int *__restrict__ chunk_base,        // (chunks, E)
                 int *__restrict__ counts,            // (E)
                 int *__restrict__ offsets,           // (E+1), padded
                 int *__restrict__ offsets_unpadded,  // (E+1)
                 int *__restrict__ num_tiles,         // (1)
                 int *__restrict__ tile_expert,       // (max_tiles)
                 int *__restrict__ tile_row_start,    // (max_tiles)
                 int *__restrict__ tile_rows,         // (max_tiles)
                 int *__restrict__ sorted_pair) {     // (max_padded_rows)
  __shared__ int sCount[MF_MAX_EXPERTS];
  __shared__ int sPadded[MF_MAX_EXPERTS];
  __shared__ int sOffsets[MF_MAX_EXPERTS + 1];
  for (int e = threadIdx.x; e < experts; e += MF_THREADS) {
    int running = 0;
#pragma unroll 8
    for (int c = 0; c < chunks; ++c) {
      const int n = chunk_counts[(long long)c * experts + e];
      chunk_base[(long long)c * experts + e] = running;
      running += n;
    }
    counts[e] = running;
    sCount[e] = running;
    sPadded[e] = (running + block - 1) / block * block;
  }
  __syncthreads();
  if (threadIdx.x < 32)
    scan_experts(experts, block, sCount, sPadded, sOffsets, offsets, offsets_unpadded, num_tiles);
  __syncthreads();
  // Tile i covers padded rows [i*block, (i+1)*block). Its expert is the
  // largest e with offsets[e] <= i*block: empty experts have empty segments,
  // so the largest such e is the one whose segment holds the row.
  for (int i = threadIdx.x; i < max_tiles; i += MF_THREADS) {
    const long long row = (long long)i * block;
    if (row >= sOffsets[experts]) {
      tile_expert[i] = -1;
      tile_row_start[i] = -1;
      tile_rows[i] = 0;
      continue;
    }
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (sOffsets[mid] <= row)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int rows_left = sCount[lo] - (int)(row - sOffsets[lo]);
    tile_expert[i] = lo;
    tile_row_start[i] = (int)row;
    tile_rows[i] = rows_left < block ? rows_left : block;
  }
  // Padding rows: each expert's segment past its pairs (a warp per expert),
  // then everything past the last segment.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int e = warp; e < experts; e += kWarps)
    for (int r = sOffsets[e] + sCount[e] + lane; r < sOffsets[e + 1]; r += 32)
      sorted_pair[r] = -1;
  for (int r = sOffsets[experts] + threadIdx.x; r < max_padded_rows; r += MF_THREADS)
    sorted_pair[r] = -1;
}

// pair_pos[r] = offsets[e] + (pairs r' < r with expert e), e = expert[r];
// sorted_pair[pair_pos[r]] = r. The block walks its chunk in rounds of
// MF_THREADS consecutive pairs. In a round, a pair's rank among earlier pairs
// of its expert is: earlier rounds and chunks (sRunning) + earlier warps of
// this round (sWarpCount) + earlier lanes of its warp (match_any + popc).
extern "C" __global__ void __launch_bounds__(MF_THREADS)
moe_stable_scatter(const int *__restrict__ expert,     // (P)
                   int pairs, int experts,
                   const int *__restrict__ chunk_base, // (chunks, E)
                   const int *__restrict__ offsets,    // (E+1)
                   int *__restrict__ pair_pos,         // (P)
                   int *__restrict__ sorted_pair) {    // (max_padded_rows), -1 filled before
  __shared__ int sRunning[MF_MAX_EXPERTS];            // next free row of each expert
  __shared__ int sWarpCount[kWarps][MF_MAX_EXPERTS];  // this round's pairs per (warp, expert)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const unsigned lower_lanes = (1u << lane) - 1u;
  for (int e = threadIdx.x; e < experts; e += MF_THREADS) {
    sRunning[e] = offsets[e] + chunk_base[(long long)blockIdx.x * experts + e];
#pragma unroll
    for (int w = 0; w < kWarps; ++w)
      sWarpCount[w][e] = 0;
  }
  __syncthreads();
  const long long begin = (long long)blockIdx.x * MF_CHUNK;
  for (int round = 0; round < kPairsPerThread; ++round) {
    const long long first = begin + (long long)round * MF_THREADS;
    if (first >= pairs)
      break; // uniform over the block
    const long long r = first + threadIdx.x;
    const int e = r < pairs ? expert[r] : -1; // -1: no pair, its own group
    const unsigned peers = __match_any_sync(kFullMask, e);
    const int rank = __popc(peers & lower_lanes);
    if (e >= 0 && rank == 0) // the group's lowest lane speaks for it
      sWarpCount[warp][e] = __popc(peers);
    __syncthreads();
    if (e >= 0) {
      int pos = sRunning[e] + rank;
      for (int w = 0; w < warp; ++w)
        pos += sWarpCount[w][e];
      pair_pos[r] = pos;
      sorted_pair[pos] = (int)r;
    }
    __syncthreads();
    for (int x = threadIdx.x; x < experts; x += MF_THREADS) {
      int round_total = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        round_total += sWarpCount[w][x];
        sWarpCount[w][x] = 0;
      }
      sRunning[x] += round_total;
    }
    __syncthreads();
  }
}

)moeforge";

} // namespace moeforge::cuda
