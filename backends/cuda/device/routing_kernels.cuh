// The device routing, compiled at run time with NVRTC: embedded into the
// binary at build time (backends/cuda/CMakeLists.txt); routing_kernels.cpp
// passes MF_THREADS, MF_TOPK_THREADS, MF_MAX_EXPERTS, MF_CAPACITY_THREADS and
// MF_ONE_BLOCK_PAIRS with -D, so host and device agree on them, and appends
// the top-k and one-block kernels' instantiations.
// Every kernel starts with mf::wait_for_previous_grid() (the source starts
// with tiles/grid_dependency.cuh): the runtime launches them early.
// The format it produces is described in routing_host.h; route_on_host()
// there is its oracle.
//
// The P = T*k pairs are cut into chunks of `chunk` pairs (a launch argument,
// routing_chunk_pairs() on the host: about a block per SM); no host
// synchronisation between the launches, every result deterministic (no
// atomics decide a position):
//   moe_topk_e*          top-k of the tokens with a pair in its block's
//                        chunk: the row's softmax when asked (the router's,
//                        fused), k rounds of an argmax over a group of
//                        lanes; then, when fused (routing_fuses_counts),
//                        the chunk's pairs per expert (chunk_counts). One
//                        kernel per bound on E (32, 64, 128, 256): lanes per
//                        token and probabilities per lane are compile-time.
//   moe_chunk_histogram  chunk_counts, when the top-k did not count (its
//                        blocks then cover fewer pairs than a chunk) or the
//                        caller supplies the experts
//   moe_scan_scatter     a block per chunk: sums the whole chunk_counts
//                        table (the expert offsets, and its chunk's base per
//                        expert), places its chunk's pairs (pair_pos,
//                        sorted_pair), and writes its share of the tile table
//                        and of the -1 padding rows; block 0 writes counts
//                        and offsets
//   moe_capacity_keep    with a fixed expert capacity, before the counting:
//                        a block per expert keeps its pairs of highest
//                        priority (placed[r] = e or -1), and the counting
//                        and placing read `placed`
//   moe_one_block_e*     a few tokens (decoding): the top-k and the placing
//                        in one block, the counts and experts kept in shared
//                        memory between them
// So a routing is two launches (three when not fused, one for a few
// tokens), from given experts two.
//
// Latency at decoding sizes. For a handful of pairs these kernels' time is
// one warp's chain of dependent steps while the block's other warps wait at
// its barriers (Nsight Compute, the one-block kernel at one token of 128
// experts on an H100: 25 k cycles for 9.7 k warp instructions, 69 % of the
// warps' cycles at a barrier, each issue of the working warp ~2 cycles of
// fixed-latency waits, 1.4 of instruction fetch, 1.1 of shared memory). So
// what shortens them is fewer dependent steps in that chain: the scans over
// the experts by a thread per expert (block-wide scans) rather than a lane
// per eight, and a division by a run-time value (some twenty instructions)
// made once per expert rather than wherever a tile count is needed.
#ifndef MF_THREADS
#error "compile with -DMF_THREADS=<threads per block>"
#endif
#ifndef MF_TOPK_THREADS
#error "compile with -DMF_TOPK_THREADS=<threads per top-k block>"
#endif
#ifndef MF_ONE_BLOCK_PAIRS
#error "compile with -DMF_ONE_BLOCK_PAIRS=<the most pairs moe_one_block_e* routes>"
#endif

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kNoExpert = 0x7fffffff;
constexpr int kWarps = MF_THREADS / 32;
// The top-k and scatter grids are about a block per SM (a chunk each; the
// top-k's are larger when it does not count), so ptxas may spend registers
// on keeping loads in flight rather than on fitting more blocks: their
// launch bounds ask for at least 1 block per SM, not the default.
constexpr int kMinBlocksPerSm = 1;
static_assert(MF_THREADS % 32 == 0, "whole warps");
static_assert(MF_TOPK_THREADS % 32 == 0, "whole warps");
static_assert(MF_MAX_EXPERTS % 32 == 0 && MF_MAX_EXPERTS <= MF_THREADS, "one thread per expert in a block");
static_assert(MF_TOPK_THREADS >= MF_THREADS, "moe_one_block_e*'s placing runs on its first MF_THREADS threads");

// The pairs [begin, end) of this block's chunk (empty for the one block of
// moe_scan_scatter when there are no pairs).
struct Chunk {
  int begin, end;
};
__device__ __forceinline__ Chunk this_chunk(int pairs, int chunk) {
  const int begin = blockIdx.x * chunk; // < pairs: a block per chunk
  return {begin, begin + min(chunk, pairs - begin)};
}

// Rows of chunk_counts (chunks, count_stride) hold E counts, then zeros up
// to 32 times a power of two, so that each warp of moe_scan_scatter reads its
// slice of a row (count_stride / kWarps experts) as a power of two of int4s.
__device__ __forceinline__ int count_stride(int experts) {
  int stride = 32;
  while (stride < experts)
    stride *= 2;
  return stride;
}

// Shared per-expert counters of a chunk: zeroed, counted into with shared
// atomics (they only count, so the result is order-independent), stored as
// row blockIdx.x of chunk_counts.
template <int kThreads> __device__ __forceinline__ void zero_counts(int *sCount, int experts) {
  for (int e = threadIdx.x; e < count_stride(experts); e += kThreads)
    sCount[e] = 0;
  __syncthreads();
}
template <int kThreads>
__device__ __forceinline__ void store_counts(const int *sCount, int experts, int *__restrict__ chunk_counts) {
  __syncthreads();
  const int stride = count_stride(experts);
  for (int e = threadIdx.x; e < stride; e += kThreads)
    chunk_counts[(long long)blockIdx.x * stride + e] = sCount[e];
}

// The top-k order: larger probability first, then the lower expert index.
// kNoExpert marks "no candidate" and loses to everything.
__device__ __forceinline__ bool beats(float p, int e, float q, int f) {
  return e != kNoExpert && (f == kNoExpert || p > q || (p == q && e < f));
}

// A token's row as a group of kGroup lanes holds it. The generated pointwise
// softmax (emit_pointwise.cpp, emit_softmax_row) spreads a row over a warp:
// lane l holds columns l, l+32, ..., sums them in that order, then adds
// across lanes with butterflies over d = 16, 8, 4, 2, 1. Here lane q of a
// group plays that warp's lanes l = q + kGroup*i (i < kVirt): the butterflies
// over d >= kGroup pair lanes this lane plays (additions in registers), the
// others pair lanes of the group (shuffles). Every addition has the operands
// of the generated softmax's, so the probabilities are bit for bit its own.
// Slot s = j*kVirt + i holds column q + kGroup*i + 32*j; slots ascending are
// columns ascending. The code is branch-free per slot (slots past the row
// hold -inf, whose exponential adds an exact 0), so the slots' arithmetic
// interleaves.
template <int kGroup, int kCols> struct Row {
  static constexpr int kVirt = 32 / kGroup;
  static constexpr int kSlots = kVirt * kCols;
  static_assert(32 % kGroup == 0 && kSlots <= 32, "a bit of `live` per slot");

  float p[kSlots];      // the scores; with the softmax, its numerators expf(x - max)
  float row_sum = 1.0f; // with the softmax, its denominator
  unsigned live = 0;    // bit s: slot s is a column of the row, still a candidate

  __device__ static int column(int q, int s) { return q + kGroup * (s % kVirt) + 32 * (s / kVirt); }
  __device__ static int slot(int column) { return (column >> 5) * kVirt + (column & 31) / kGroup; }
  __device__ bool has(int s) const { return (live >> s) & 1u; }

  __device__ void load(const float *__restrict__ row, int experts, int q, bool valid) {
    live = 0;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const bool in_row = valid && column(q, s) < experts;
      p[s] = in_row ? row[column(q, s)] : -__int_as_float(0x7f800000);
      live |= (in_row ? 1u : 0u) << s;
    }
  }

  // The lowest column of the group whose value (the score, or with the
  // softmax its numerator, NaN exactly where the probability is) is NaN or
  // infinite, known to every lane of the group; kNoExpert when none. The
  // shuffles run only in a warp that holds one (rare).
  __device__ int first_non_finite(int q) const {
    int bad = kNoExpert;
#pragma unroll
    for (int s = kSlots - 1; s >= 0; --s) // descending, so the lowest column is left
      bad = has(s) && !isfinite(p[s]) ? column(q, s) : bad;
    if (__any_sync(kFullMask, bad != kNoExpert))
#pragma unroll
      for (int d = kGroup / 2; d > 0; d >>= 1)
        bad = min(bad, __shfl_xor_sync(kFullMask, bad, d));
    return bad;
  }

  // A row holding a NaN or an infinity (first_non_finite) has no order: a
  // NaN compares false with everything, so each lane of the group would
  // keep its own candidate through the argmax's butterflies, and a lane
  // holding fewer columns than k would find none in a later round (an
  // expert id out of range). Such a row's scores become minus their column:
  // experts 0, 1, ... in order, every choice in range (its gates are NaN).
  __device__ void order_by_column(int q) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s)
      p[s] = has(s) ? -static_cast<float>(column(q, s)) : p[s];
  }

  // The numerators and the denominator of p = expf(x - max) / sum of
  // expf(x - max), with the order of every operation of the generated softmax
  // (see above). The division waits for take_best: only the chosen
  // probabilities need it.
  __device__ void softmax() {
    float row_max = -__int_as_float(0x7f800000);
#pragma unroll
    for (int s = 0; s < kSlots; ++s)
      row_max = fmaxf(row_max, p[s]);
#pragma unroll
    for (int d = kGroup / 2; d > 0; d >>= 1)
      row_max = fmaxf(row_max, __shfl_xor_sync(kFullMask, row_max, d));
    float sum[kVirt]; // per played lane, its columns in order
#pragma unroll
    for (int i = 0; i < kVirt; ++i)
      sum[i] = 0.0f;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      p[s] = expf(p[s] - row_max);
      sum[s % kVirt] += p[s];
    }
    // Butterflies d = 16 .. kGroup: played lane i meets i + d / kGroup.
#pragma unroll
    for (int step = kVirt / 2; step > 0; step >>= 1)
#pragma unroll
      for (int i = 0; i < step; ++i)
        sum[i] += sum[i + step];
    row_sum = sum[0];
#pragma unroll
    for (int d = kGroup / 2; d > 0; d >>= 1)
      row_sum += __shfl_xor_sync(kFullMask, row_sum, d);
  }

  // The group's candidate of largest p (the lowest column on ties), known to
  // every lane of the group; kNoExpert when the row has none. `below` gets
  // this lane's largest p among its candidates in columns below its own best
  // (-inf if none): with the lane's best, it bounds the p of every
  // candidate of the lane other than the group's best.
  __device__ int best_numerator(int q, float &best, float &below) const {
    const float kMinusInf = -__int_as_float(0x7f800000);
    best = below = kMinusInf;
    int best_e = kNoExpert;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) { // columns ascending: strict > keeps the lower on ties
      const bool better = has(s) && (best_e == kNoExpert || p[s] > best);
      below = better ? best : below;
      best = better ? p[s] : best;
      best_e = better ? column(q, s) : best_e;
    }
    const float lane_best = best;
    const int lane_best_e = best_e;
    // Butterfly argmax: a total order, so every lane ends with the winner.
#pragma unroll
    for (int d = kGroup / 2; d > 0; d >>= 1) {
      const float other = __shfl_xor_sync(kFullMask, best, d);
      const int other_e = __shfl_xor_sync(kFullMask, best_e, d);
      if (beats(other, other_e, best, best_e)) {
        best = other;
        best_e = other_e;
      }
    }
    below = lane_best_e == best_e ? below : lane_best;
    return best_e;
  }

  // Division rounds, so a smaller numerator than `best` can give the same
  // probability `prob`, and a lower column with it wins the tie. Such
  // numerators are >= lower: probabilities are monotone in the numerator,
  // and equal ones have numerators within a relative 2^-22 (2^-140 absolute
  // where the probability is subnormal, as row_sum <= E <= 256).
  __device__ static float tie_bound(float best) { return best * 0.99999f - 0x1p-126f; }
  __device__ unsigned may_tie(int q, int best_e, float lower) const {
    unsigned maybe = 0;
#pragma unroll
    for (int s = 0; s < kSlots; ++s)
      maybe |= (has(s) && column(q, s) < best_e && p[s] >= lower ? 1u : 0u) << s;
    return maybe;
  }

  // p[s] for a slot known at run time only: a select per slot, as indexing
  // the array with it would put the array in local memory.
  __device__ float at(int slot) const {
    float v = 0.0f;
#pragma unroll
    for (int s = 0; s < kSlots; ++s)
      v = s == slot ? p[s] : v;
    return v;
  }

  // The lowest column of the group among the slots of `maybe` (slots below
  // best_e that may tie) whose probability is `prob`. A loop over the set
  // bits, with one division per slot tried: unrolled over every slot, the
  // compiler would compute all the divisions before knowing which it needs.
  __device__ int lower_tie(int q, unsigned maybe, float prob) const {
    int tie = kNoExpert;
    for (; maybe != 0; maybe &= maybe - 1) { // slots ascending: columns ascending
      const int s = __ffs(maybe) - 1;
      if (at(s) / row_sum == prob) {
        tie = column(q, s);
        break;
      }
    }
#pragma unroll
    for (int d = kGroup / 2; d > 0; d >>= 1)
      tie = min(tie, __shfl_xor_sync(kFullMask, tie, d));
    return tie;
  }

  // The group's next choice: the largest probability (p, or p / row_sum with
  // the softmax), the lower column on ties, known to every lane of the group;
  // it stops being a candidate. kNoExpert when the row has none.
  __device__ int take_best(int q, bool softmax, float &prob) {
    float best, below;
    int best_e = best_numerator(q, best, below);
    prob = best;
    if (softmax) {
      prob = best / row_sum;
      const float lower = tie_bound(best);
      // Rare: only when a lane of the warp may hold a tie.
      if (__any_sync(kFullMask, best_e != kNoExpert && below >= lower))
        best_e = min(best_e, lower_tie(q, may_tie(q, best_e, lower), prob));
    }
    if (best_e != kNoExpert && q == best_e % kGroup)
      live &= ~(1u << slot(best_e));
    return best_e;
  }
};

// A routing score that is NaN or infinite chooses no expert by any order
// (a NaN compares false with everything). The top-k kernels still choose k
// experts in range for such a token, write NaN gates for it (so an output
// weighted by them shows it), and report it: the lowest key
// route_tag | token << 8 | expert to *first_bad (all ones when none), and a
// flag in host memory the caller maps (`seen`), which the host reads without
// waiting for the stream (backends/cuda/runtime/routing_score_check.h).
// Both pointers null: no report.
__device__ __forceinline__ void report_non_finite(unsigned long long *first_bad, unsigned *seen,
                                                  unsigned long long route_tag, long long token, int expert) {
  if (first_bad == nullptr)
    return;
  atomicMin(first_bad, route_tag | (static_cast<unsigned long long>(token) << 8) | static_cast<unsigned>(expert));
  __threadfence_system(); // the key before the flag, as the host reads them
  *reinterpret_cast<volatile unsigned *>(seen) = 1u;
}

// Routes token t (of the tokens below end_token; lanes past it hold no
// columns and write nothing) from its row, held by this lane's group: the
// softmax when asked, the report of a score that is not finite, k rounds of
// the argmax. Lane 0 of the group writes the pairs of chunk c: expert[r],
// gate[r] (divided by the chosen ones' sum when `renormalize`), a count per
// expert into sCount and the expert into sExpert[r - c.begin] when those
// (shared) arrays are given. With sGate (shared) the gates are kept there
// too, so that the division by their sum reads them back from shared memory
// rather than from global memory, a round trip per chosen expert.
template <int kGroup, int kCols>
__device__ __forceinline__ void route_row(Row<kGroup, kCols> &row, int t, int end_token, int k, int softmax,
                                          int renormalize, Chunk c, int *__restrict__ expert, float *__restrict__ gate,
                                          int *sCount, int *sExpert, float *sGate, unsigned long long *first_bad,
                                          unsigned *seen, unsigned long long route_tag) {
  const int q = threadIdx.x % kGroup;
  if (softmax) // uniform over the grid
    row.softmax();
  const int bad = row.first_non_finite(q);
  if (bad != kNoExpert && q == 0 && t < end_token)
    report_non_finite(first_bad, seen, route_tag, t, bad);
  if (bad != kNoExpert) // uniform over the group
    row.order_by_column(q);
  // The chosen probabilities' sum from 0 in slot order, the order of the
  // generated route_sum step this replaces, so the division matches it.
  float total = 0.0f;
  for (int s = 0; s < k; ++s) {
    float prob;
    const int best_e = row.take_best(q, softmax, prob);
    total += prob;
    const int r = t * k + s;
    if (t < end_token && q == 0 && r >= c.begin && r < c.end) {
      expert[r] = best_e;
      const float g = bad != kNoExpert ? __int_as_float(0x7fc00000) : prob;
      gate[r] = g;
      if (sGate)
        sGate[r - c.begin] = g;
      if (sCount)
        atomicAdd(&sCount[best_e], 1);
      if (sExpert)
        sExpert[r - c.begin] = best_e;
    }
  }
  if (renormalize) // uniform over the grid; this thread reads back what it wrote
    for (int s = 0; s < k; ++s) {
      const int r = t * k + s;
      if (t < end_token && q == 0 && r >= c.begin && r < c.end)
        gate[r] = (sGate ? sGate[r - c.begin] : gate[r]) / total;
    }
}

// expert[t*k + s], gate[t*k + s] for this block's chunk of pairs: the s-th
// largest probability of row t, where the probabilities are `scores`, or
// their row softmax when `softmax` is set (scores are then logits), divided
// by the sum of the row's k chosen ones when `renormalize` is set; then,
// unless chunk_counts is null, the chunk's pairs per expert into it. A token
// whose pairs straddle two chunks is routed by both blocks, each writing its
// own pairs (each selects all k, so both divide by the same sum).
template <int kGroup, int kCols>
__device__ __forceinline__ void
topk_chunk(const float *__restrict__ scores, int tokens, int experts, int k, int softmax, int renormalize, int chunk,
           int *__restrict__ expert, float *__restrict__ gate, int *__restrict__ chunk_counts,
           unsigned long long *first_bad, unsigned *seen, unsigned long long route_tag) {
  __shared__ int sCount[MF_MAX_EXPERTS];
  const bool counts = chunk_counts != nullptr; // uniform over the grid
  if (counts)
    zero_counts<MF_TOPK_THREADS>(sCount, experts);
  constexpr int kTokensPerPass = MF_TOPK_THREADS / kGroup;
  const Chunk c = this_chunk(tokens * k, chunk);
  const int first_token = c.begin / k, end_token = (c.end - 1) / k + 1; // the tokens of pairs begin .. end-1
  const int q = threadIdx.x % kGroup;
  const int warp_first = (threadIdx.x >> 5) * (32 / kGroup); // the warp's first group
  auto load = [&](Row<kGroup, kCols> &row, int pass) {
    const int t = pass + threadIdx.x / kGroup;
    row.load(scores + (long long)t * experts, experts, q, t < end_token);
  };
  auto route = [&](Row<kGroup, kCols> &row, int pass) {
    route_row(row, pass + threadIdx.x / kGroup, end_token, k, softmax, renormalize, c, expert, gate,
              counts ? sCount : nullptr, nullptr, nullptr, first_bad, seen, route_tag);
  };
  // A warp's passes run while it has tokens, so the shuffles see full warps;
  // groups past the last token hold no columns and write nothing. Each pass
  // loads the next pass's rows before it routes, to overlap their latency,
  // into the other of two rows (a copy would wait for the load).
  auto has_pass = [&](int pass) { return pass + warp_first < end_token; };
  Row<kGroup, kCols> a, b;
  load(a, first_token);
  for (int pass = first_token; has_pass(pass); pass += 2 * kTokensPerPass) {
    const int second = pass + kTokensPerPass;
    if (has_pass(second))
      load(b, second);
    route(a, pass);
    if (!has_pass(second))
      break;
    if (has_pass(second + kTokensPerPass))
      load(a, second + kTokensPerPass);
    route(b, second);
  }
  if (counts)
    store_counts<MF_TOPK_THREADS>(sCount, experts, chunk_counts);
}

// A top-k kernel for rows of E <= 32 * cols experts, `group` lanes per token.
// routing_kernels.cpp instantiates it once per entry of its table of top-k
// kernels (routing_topk_kernel), appended to this source.
#define MF_TOPK_KERNEL(name, group, cols)                                                                              \
  extern "C" __global__ void __launch_bounds__(MF_TOPK_THREADS, kMinBlocksPerSm)                                       \
      name(const float *__restrict__ scores, /* (T, E) */ int tokens, int experts, int k, int softmax,                 \
           int renormalize, int chunk, int *__restrict__ expert, /* (T*k) */ float *__restrict__ gate, /* (T*k) */     \
           int *__restrict__ chunk_counts, /* (chunks, count_stride) */                                                \
           unsigned long long *first_bad, unsigned *seen, unsigned long long route_tag) {                              \
    mf::wait_for_previous_grid();                                                                                      \
    topk_chunk<group, cols>(scores, tokens, experts, k, softmax, renormalize, chunk, expert, gate, chunk_counts,       \
                            first_bad, seen, route_tag);                                                               \
  }

// Group-limited top-k (TopKOptions::groups; dsl/top_k_select.h states the
// rule and is the oracle): a thread per token, the row's flags in local
// memory. Groups of size = experts / groups contiguous experts each score
// the sum of their two largest scores (their one score when size is 1);
// top_groups rounds of an argmax over the groups not yet taken, then k
// rounds over their experts, each keeping the first of equals (the lower
// index), so ties go as on the host. expert[t*k + s], gate[t*k + s] as
// moe_topk_e* write them; the counts follow from moe_chunk_histogram.
extern "C" __global__ void __launch_bounds__(MF_THREADS)
    moe_topk_grouped(const float *__restrict__ scores, // (T, E)
                     int tokens, int experts, int k, int groups, int top_groups, int *__restrict__ expert,
                     float *__restrict__ gate, // (P)
                     unsigned long long *first_bad, unsigned *seen, unsigned long long route_tag) {
  mf::wait_for_previous_grid();
  const int t = blockIdx.x * MF_THREADS + threadIdx.x;
  if (t >= tokens)
    return;
  const float *row = scores + static_cast<long long>(t) * experts;
  int bad = -1; // the lowest expert whose score is NaN or infinite (report_non_finite)
  for (int e = experts - 1; e >= 0; --e)
    bad = isfinite(row[e]) ? bad : e;
  if (bad >= 0)
    report_non_finite(first_bad, seen, route_tag, t, bad);
  const int size = experts / groups;
  float group_score[MF_MAX_EXPERTS];
  bool group_taken[MF_MAX_EXPERTS], candidate[MF_MAX_EXPERTS];
  for (int g = 0; g < groups; ++g) {
    float first = row[g * size], second = 0.f;
    for (int e = g * size + 1; e < (g + 1) * size; ++e) {
      const float v = row[e];
      if (v > first) {
        second = first;
        first = v;
      } else if (e == g * size + 1 || v > second) {
        second = v;
      }
    }
    group_score[g] = size == 1 ? first : first + second;
    group_taken[g] = false;
  }
  for (int e = 0; e < experts; ++e)
    candidate[e] = false;
  for (int n = 0; n < top_groups; ++n) {
    int best = -1;
    for (int g = 0; g < groups; ++g)
      if (!group_taken[g] && (best < 0 || group_score[g] > group_score[best]))
        best = g;
    group_taken[best] = true;
    for (int e = best * size; e < (best + 1) * size; ++e)
      candidate[e] = true;
  }
  for (int s = 0; s < k; ++s) {
    int best = -1;
    for (int e = 0; e < experts; ++e)
      if (candidate[e] && (best < 0 || row[e] > row[best]))
        best = e;
    candidate[best] = false;
    expert[static_cast<long long>(t) * k + s] = best;
    gate[static_cast<long long>(t) * k + s] = bad >= 0 ? __int_as_float(0x7fc00000) : row[best];
  }
}

// chunk_counts[c, e]: pairs of chunk c routed to e, for experts given.
extern "C" __global__ void __launch_bounds__(MF_THREADS)
    moe_chunk_histogram(const int *__restrict__ expert, // (P)
                        int pairs, int experts, int chunk,
                        int *__restrict__ chunk_counts) { // (chunks, count_stride)
  mf::wait_for_previous_grid();
  __shared__ int sCount[MF_MAX_EXPERTS];
  zero_counts<MF_THREADS>(sCount, experts);
  const Chunk c = this_chunk(pairs, chunk);
  for (int r = c.begin + threadIdx.x; r < c.end; r += MF_THREADS)
    atomicAdd(&sCount[expert[r]], 1);
  store_counts<MF_THREADS>(sCount, experts, chunk_counts);
}

// For the experts of this warp's slice (count_stride / kWarps of them from
// warp * that): sCount[e] = e's pairs in every chunk, sBefore[e] = those in
// chunks before this block's, sTiles[e] = its tiles of `block` rows: the
// one division by `block` (a run-time divisor costs some twenty
// instructions), so the scans and the tile order that follow multiply.
// The slice is `vectors` int4 columns; lane (g, v) sums column v of chunks
// g, g + groups, ..., kBatch loads in flight at once, then butterflies over
// g add the lanes of each column.
__device__ void sum_chunk_counts(const int *__restrict__ chunk_counts, int chunks, int experts, int block, int *sCount,
                                 int *sBefore, int *sTiles) {
  const int stride = count_stride(experts), vectors = stride / 32, groups = 32 / vectors;
  const int lane = threadIdx.x & 31, v = lane % vectors, g = lane / vectors;
  const int first = (threadIdx.x >> 5) * (stride / kWarps) + 4 * v; // this lane's column's first expert
  int total[4] = {0, 0, 0, 0}, before[4] = {0, 0, 0, 0};
  constexpr int kBatch = 8; // loads issued before the first is used
  for (int c0 = g; c0 < chunks; c0 += kBatch * groups) {
    int4 n[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int c = c0 + u * groups;
      n[u] = c < chunks ? *reinterpret_cast<const int4 *>(chunk_counts + (long long)c * stride + first)
                        : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int earlier = c0 + u * groups < (int)blockIdx.x ? 1 : 0;
      const int n4[4] = {n[u].x, n[u].y, n[u].z, n[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        total[i] += n4[i];
        before[i] += earlier * n4[i];
      }
    }
  }
  for (int d = vectors; d < 32; d <<= 1)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      total[i] += __shfl_xor_sync(kFullMask, total[i], d);
      before[i] += __shfl_xor_sync(kFullMask, before[i], d);
    }
  if (g == 0)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (first + i < experts) {
        sCount[first + i] = total[i];
        sBefore[first + i] = before[i];
        sTiles[first + i] = (total[i] + block - 1) / block;
      }
}

// The sum of v over this lane and the lanes below it (a full warp).
__device__ __forceinline__ int warp_inclusive_sum(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int below = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d)
      v += below;
  }
  return v;
}

// Warp `warp`'s share of the chunk: pairs [begin, end), in steps of 32.
struct WarpPairs {
  int begin, end;
};
__device__ __forceinline__ WarpPairs warp_pairs(Chunk c, int chunk, int warp) {
  const int per_warp = chunk / kWarps; // the host makes chunk a multiple of kWarps
  const int size = c.end - c.begin, lo = min(size, warp * per_warp);
  return {c.begin + lo, c.begin + min(size, lo + per_warp)};
}

// The experts of kIdSteps consecutive steps (32 pairs each) of a warp's
// share from `first`, loaded together so that their latencies overlap; -1
// past its end (no pair: a group of its own for __match_any_sync).
constexpr int kIdSteps = 4;
struct StepIds {
  int e[kIdSteps];
};
__device__ __forceinline__ StepIds load_ids(const int *expert, WarpPairs wp, int first) {
  StepIds ids;
#pragma unroll
  for (int u = 0; u < kIdSteps; ++u) {
    const int r = first + 32 * u + (threadIdx.x & 31);
    ids.e[u] = r < wp.end ? expert[r] : -1;
  }
  return ids;
}

// sWarpCount[w][e] = pairs of expert e in warp w's share, given the experts
// of its first steps. Only warp w touches row w, so __syncwarp orders it.
__device__ void count_warp_pairs(const int *expert, int experts, WarpPairs wp, StepIds first_ids, int *row) {
  const int lane = threadIdx.x & 31;
  for (int e = lane; e < experts; e += 32)
    row[e] = 0;
  __syncwarp();
  for (int first = wp.begin; first < wp.end; first += 32 * kIdSteps) { // uniform per warp
    const StepIds ids = first == wp.begin ? first_ids : load_ids(expert, wp, first);
#pragma unroll
    for (int u = 0; u < kIdSteps && first + 32 * u < wp.end; ++u) {
      const int e = ids.e[u];
      const unsigned peers = __match_any_sync(kFullMask, e);
      if (e >= 0 && __popc(peers & ((1u << lane) - 1u)) == 0) // the group's lowest lane speaks for it
        row[e] += __popc(peers);
      __syncwarp();
    }
  }
}

// pair_pos[r] = sOffsets[e] + row[e] + (earlier lanes of r's step with
// expert e), then row[e] moves past the step's pairs of e: row[e] starts at
// e's pairs before this warp's share, so the order of r is kept. A pair
// with expert -1 (dropped at capacity) gets the drop row. The
// experts of the first steps are count_warp_pairs', still in registers.
__device__ void place_warp_pairs(const int *expert, WarpPairs wp, StepIds first_ids, const int *sOffsets, int *row,
                                 int drop_row, int *__restrict__ pair_pos, int *__restrict__ sorted_pair) {
  const int lane = threadIdx.x & 31;
  for (int first = wp.begin; first < wp.end; first += 32 * kIdSteps) { // uniform per warp
    const StepIds ids = first == wp.begin ? first_ids : load_ids(expert, wp, first);
#pragma unroll
    for (int u = 0; u < kIdSteps && first + 32 * u < wp.end; ++u) {
      const int r = first + 32 * u + lane, e = ids.e[u];
      const unsigned peers = __match_any_sync(kFullMask, e);
      const int rank = __popc(peers & ((1u << lane) - 1u));
      const int before = e >= 0 ? row[e] : 0;
      __syncwarp(); // every lane has read row[e] before its group's lowest lane moves it
      if (e >= 0) {
        const int pos = sOffsets[e] + before + rank;
        pair_pos[r] = pos;
        sorted_pair[pos] = r;
        if (rank == 0)
          row[e] = before + __popc(peers);
      } else if (r < wp.end) { // dropped at capacity (moe_capacity_keep): the drop row
        pair_pos[r] = drop_row;
      }
      __syncwarp();
    }
  }
}

// What the placing writes (moe_scan_scatter and moe_one_block_e*, one
// kernel argument): the tables the GEMMs and the element-wise steps read,
// for `block`-row tiles, at most max_tiles of them and max_padded_rows rows.
// The host's PlacedTablesArg (runtime/routing_kernels.cpp) has the same
// layout.
struct PlacedTables {
  int block, max_tiles, max_padded_rows;
  int *counts;           // (E)
  int *offsets;          // (E+1), padded
  int *offsets_unpadded; // (E+1)
  int *num_tiles;        // (1)
  int *tile_expert;      // (max_tiles)
  int *tile_row_start;   // (max_tiles)
  int *tile_rows;        // (max_tiles)
  int *pair_pos;         // (P)
  int *sorted_pair;      // (max_padded_rows)
};
static_assert(sizeof(PlacedTables) == 16 + 9 * 8, "PlacedTablesArg's layout on the host");

// The pair-aligned tile order (routing_host.h): expert e's tiles are n =
// sTiles[e]; its first n & ~1 follow one another from base[e], and the
// tails (the last tile of an odd n) pair up in expert order: the j-th odd
// expert for odd j puts the (j-1)-th's tail and its own after its pairs; an
// unpaired last tail goes at base[E]. odd_rank[e]: e's rank among the odd
// experts; odd_expert[j]: the j-th odd expert.
struct TilePairs {
  int *base, *odd_rank, *odd_expert, *num_odd;
};

// The barrier of the placing's threads (the first MF_THREADS of the block):
// a named one, so that route_one_block's other warps may have left.
__device__ __forceinline__ void placing_sync() { asm volatile("bar.sync 1, %0;" ::"r"(MF_THREADS) : "memory"); }

// The sums over the threads below this one of each of v's four values, and
// in `total` over all, for the block's first MF_THREADS threads (a warp's
// scan by shuffles, then the warps' totals through sWarp, kWarps int4s).
__device__ __forceinline__ int4 block_exclusive_scan(int4 v, int4 &total, int4 *sWarp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int4 incl = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int x = __shfl_up_sync(kFullMask, incl.x, d), y = __shfl_up_sync(kFullMask, incl.y, d);
    const int z = __shfl_up_sync(kFullMask, incl.z, d), w = __shfl_up_sync(kFullMask, incl.w, d);
    if (lane >= d) {
      incl.x += x;
      incl.y += y;
      incl.z += z;
      incl.w += w;
    }
  }
  if (lane == 31)
    sWarp[warp] = incl;
  placing_sync();
  int4 before = make_int4(0, 0, 0, 0), all = make_int4(0, 0, 0, 0);
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int4 t = sWarp[w];
    const int earlier = w < warp ? 1 : 0;
    all = make_int4(all.x + t.x, all.y + t.y, all.z + t.z, all.w + t.w);
    before = make_int4(before.x + earlier * t.x, before.y + earlier * t.y, before.z + earlier * t.z,
                       before.w + earlier * t.w);
  }
  placing_sync(); // sWarp is free again
  total = all;
  return make_int4(before.x + incl.x - v.x, before.y + incl.y - v.y, before.z + incl.z - v.z, before.w + incl.w - v.w);
}

// Thread e of the block's first MF_THREADS (one per expert, MF_MAX_EXPERTS
// <= MF_THREADS): sOffsets[e] (e <= E), the padded offsets, and the
// pair-aligned tile order's tables, by two block-wide scans (the padded
// rows, the pairs, the odd experts and the tiles; then each expert's tile
// slots, which follow from its odd rank). Block 0 also writes counts,
// offsets, offsets_unpadded and num_tiles (every block computes the same).
// As a thread per expert rather than a lane per eight: at decoding sizes
// these scans were a chain of dependent steps that the whole block waited
// for.
__device__ void scan_experts_and_tiles(int experts, const int *sCount, const int *sTiles, int *sOffsets, TilePairs tp,
                                       int4 *sScan, const PlacedTables &out) {
  const int e = threadIdx.x, block = out.block;
  const bool mine = e < experts, writes = blockIdx.x == 0;
  const int n = mine ? sTiles[e] : 0, count = mine ? sCount[e] : 0;
  int4 total;
  const int4 first = block_exclusive_scan(make_int4(n * block, count, n & 1, n), total, sScan);
  const int rank = first.z; // among the odd experts
  const int slots = (n & ~1) + ((n & 1) && (rank & 1) ? 2 : 0);
  int4 all_slots;
  const int base = block_exclusive_scan(make_int4(slots, 0, 0, 0), all_slots, sScan).x;
  if (mine) {
    sOffsets[e] = first.x;
    tp.base[e] = base;
    if (n & 1) {
      tp.odd_rank[e] = rank;
      tp.odd_expert[rank] = e;
    }
    if (writes) {
      out.counts[e] = count;
      out.offsets[e] = first.x;
      out.offsets_unpadded[e] = first.y;
    }
  }
  if (e == 0) {
    sOffsets[experts] = total.x;
    tp.base[experts] = all_slots.x;
    *tp.num_odd = total.z;
    if (writes) {
      out.offsets[experts] = total.x;
      out.offsets_unpadded[experts] = total.y;
      *out.num_tiles = total.w;
    }
  }
}

// Tile i of the pair-aligned order: the largest e with base[e] <= i holds
// position i (experts taking no slots have empty ranges), either as one of
// its pairs' tiles or in its tail pair; past base[E], the unpaired tail.
__device__ void write_tile(int i, int experts, int block, const int *sCount, const int *sTiles, const int *sOffsets,
                           TilePairs tp, int *__restrict__ tile_expert, int *__restrict__ tile_row_start,
                           int *__restrict__ tile_rows) {
  if ((long long)i * block >= sOffsets[experts]) {
    tile_expert[i] = -1;
    tile_row_start[i] = -1;
    tile_rows[i] = 0;
    return;
  }
  int e;
  if (i >= tp.base[experts]) {
    e = tp.odd_expert[*tp.num_odd - 1];
  } else {
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tp.base[mid] <= i)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int j = i - tp.base[lo], whole = sTiles[lo] & ~1;
    e = lo;
    if (j < whole) {
      tile_expert[i] = e;
      tile_row_start[i] = sOffsets[e] + j * block;
      tile_rows[i] = min(block, sCount[e] - j * block);
      return;
    }
    if (j == whole) // the first of the tail pair: the previous odd expert's
      e = tp.odd_expert[tp.odd_rank[lo] - 1];
  }
  const int k = sTiles[e] - 1; // the expert's last tile
  tile_expert[i] = e;
  tile_row_start[i] = sOffsets[e] + k * block;
  tile_rows[i] = sCount[e] - k * block;
}

// This block's share (block b takes every gridDim.x-th item) of the tile
// table and of sorted_pair's padding rows (-1): each expert's segment past
// its pairs, then everything past the last segment.
__device__ void write_tiles_and_padding(int experts, const int *sCount, const int *sTiles, const int *sOffsets,
                                        TilePairs tp, const PlacedTables &out) {
  const int thread = blockIdx.x * MF_THREADS + threadIdx.x, threads = gridDim.x * MF_THREADS;
  const int max_padded_rows = out.max_padded_rows;
  int *__restrict__ sorted_pair = out.sorted_pair;
  for (int i = thread; i < out.max_tiles; i += threads)
    write_tile(i, experts, out.block, sCount, sTiles, sOffsets, tp, out.tile_expert, out.tile_row_start, out.tile_rows);
  // Each expert's segment past its pairs: a warp per 32 experts finds those
  // with such rows in one ballot and writes each one's rows with all its
  // lanes (a warp per expert walked every expert, most with none, one after
  // another: at decoding sizes a chain of 16 steps a warp for 128 experts).
  const int lane = threadIdx.x & 31;
  for (int e0 = (thread >> 5) * 32; e0 < experts; e0 += threads) { // uniform per warp
    const int e = e0 + lane;
    const int from = e < experts ? sOffsets[e] + sCount[e] : 0, to = e < experts ? sOffsets[e + 1] : 0;
    for (unsigned todo = __ballot_sync(kFullMask, from < to); todo != 0; todo &= todo - 1) {
      const int src = __ffs(todo) - 1;
      const int first = __shfl_sync(kFullMask, from, src), end = __shfl_sync(kFullMask, to, src);
      for (int r = first + lane; r < end; r += 32)
        sorted_pair[r] = -1;
    }
  }
  // The rows past the last segment (most of them at decoding sizes: room
  // for every expert's last tile), four a store where they line up.
  int r = sOffsets[experts];
  if (r % 4 == 0 && max_padded_rows % 4 == 0 && reinterpret_cast<unsigned long long>(sorted_pair + r) % 16 == 0) {
    for (int v = r / 4 + thread; v < max_padded_rows / 4; v += threads)
      reinterpret_cast<int4 *>(sorted_pair)[v] = make_int4(-1, -1, -1, -1);
    return;
  }
  for (r += thread; r < max_padded_rows; r += threads)
    sorted_pair[r] = -1;
}

// Block b (at least one, also for no pairs) places chunk b's pairs:
// pair_pos[r] = offsets[e] + (pairs r' < r with expert e), e = expert[r];
// sorted_pair[pair_pos[r]] = r. A pair's rank among earlier pairs of its
// expert is: earlier chunks (sBefore) + earlier warps' shares of this chunk
// (a scan of sWarpCount over warps) + earlier steps and lanes of its warp.
// The counts per expert come from chunk_counts (every chunk's), or, for a
// block that is the only chunk and counted its pairs itself (kOwnCounts),
// from own_counts (shared; chunk_counts then null). Run by the block's first
// MF_THREADS threads.
template <bool kOwnCounts>
__device__ __forceinline__ void scan_scatter_block(const int *expert, const int *__restrict__ chunk_counts,
                                                   const int *own_counts, int pairs, int experts, int chunk, int chunks,
                                                   const PlacedTables &out) {
  const int block = out.block;
  __shared__ int sWarpCount[kWarps][MF_MAX_EXPERTS];
  __shared__ int sCount[MF_MAX_EXPERTS], sBefore[MF_MAX_EXPERTS], sTiles[MF_MAX_EXPERTS];
  __shared__ int sOffsets[MF_MAX_EXPERTS + 1];
  __shared__ int sPairBase[MF_MAX_EXPERTS + 1], sOddRank[MF_MAX_EXPERTS], sOddExpert[MF_MAX_EXPERTS], sNumOdd;
  __shared__ int4 sScan[kWarps];
  const TilePairs tp{sPairBase, sOddRank, sOddExpert, &sNumOdd};
  const int warp = threadIdx.x >> 5;
  const WarpPairs wp = warp_pairs(this_chunk(pairs, chunk), chunk, warp);
  const StepIds first_ids = load_ids(expert, wp, wp.begin); // in flight with the count table's loads
  if (kOwnCounts) {
    for (int e = threadIdx.x; e < experts; e += MF_THREADS) {
      sCount[e] = own_counts[e];
      sBefore[e] = 0;
      sTiles[e] = (own_counts[e] + block - 1) / block;
    }
  } else {
    sum_chunk_counts(chunk_counts, chunks, experts, block, sCount, sBefore, sTiles);
  }
  count_warp_pairs(expert, experts, wp, first_ids, sWarpCount[warp]);
  placing_sync();
  scan_experts_and_tiles(experts, sCount, sTiles, sOffsets, tp, sScan, out);
  // Each warp's share of each expert starts after the earlier chunks' and
  // warps' pairs of it.
  for (int e = threadIdx.x; e < experts; e += MF_THREADS) {
    int running = sBefore[e];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int n = sWarpCount[w][e];
      sWarpCount[w][e] = running;
      running += n;
    }
  }
  placing_sync();
  place_warp_pairs(expert, wp, first_ids, sOffsets, sWarpCount[warp], out.max_padded_rows - 1, out.pair_pos,
                   out.sorted_pair);
  write_tiles_and_padding(experts, sCount, sTiles, sOffsets, tp, out);
}

extern "C" __global__ void __launch_bounds__(MF_THREADS, kMinBlocksPerSm)
    moe_scan_scatter(const int *__restrict__ expert,       // (P)
                     const int *__restrict__ chunk_counts, // (chunks, count_stride)
                     int pairs, int experts, int chunk, int chunks, PlacedTables out) {
  mf::wait_for_previous_grid();
  scan_scatter_block<false>(expert, chunk_counts, nullptr, pairs, experts, chunk, chunks, out);
}

// The whole routing of a few tokens in one block (routing_in_one_block on
// the host): at decoding sizes each launch of the top-k / scan-and-scatter
// pair costs several microseconds of latency for a handful of pairs, and
// the counts and the experts pass through global memory between them.
// Here a warp per token (kGroup = 32: tokens <= MF_TOPK_THREADS / 32) routes
// every token at once and counts into shared memory, keeping each pair's
// expert and gate in shared memory too (pairs <= MF_ONE_BLOCK_PAIRS); then
// the first MF_THREADS threads place the pairs as moe_scan_scatter's only
// block would, from those. Same tables, bit for bit, as the two kernels.
// Its time is a chain of dependent steps, the other warps waiting at the
// barriers (see the latency note at the top), so the top-k takes a row over
// a whole warp, four scores a lane for 128 experts, rather than over a group
// of 8 lanes with 16 each: at one token of 128 experts 9.7 k -> 8.3 k warp
// instructions and 12.6 -> 11.7 us (H100); the placing's steps are the
// rest.
template <int kGroup, int kCols>
__device__ __forceinline__ void
route_one_block(const float *__restrict__ scores, int tokens, int experts, int k, int softmax, int renormalize,
                int *__restrict__ expert, float *__restrict__ gate, const PlacedTables &out,
                unsigned long long *first_bad, unsigned *seen, unsigned long long route_tag) {
  __shared__ int sTopkCount[MF_MAX_EXPERTS];
  __shared__ int sExpert[MF_ONE_BLOCK_PAIRS];
  __shared__ float sGate[MF_ONE_BLOCK_PAIRS];
  static_assert(kGroup == 32, "a warp per token");
  zero_counts<MF_TOPK_THREADS>(sTopkCount, experts);
  const int pairs = tokens * k;
  const Chunk all{0, pairs};
  const int t = threadIdx.x >> 5; // this warp's token
  if (t < tokens) {
    Row<kGroup, kCols> row;
    row.load(scores + (long long)t * experts, experts, threadIdx.x & 31, true);
    route_row(row, t, tokens, k, softmax, renormalize, all, expert, gate, sTopkCount, sExpert, sGate, first_bad, seen,
              route_tag);
  }
  __syncthreads();
  if (threadIdx.x >= MF_THREADS)
    return;
  // One chunk of whole 32-pair steps per warp, as warp_pairs cuts it.
  const int chunk = (pairs + 32 * kWarps - 1) / (32 * kWarps) * (32 * kWarps);
  scan_scatter_block<true>(sExpert, nullptr, sTopkCount, pairs, experts, chunk, 1, out);
}

#define MF_ONE_BLOCK_KERNEL(name, group, cols)                                                                         \
  extern "C" __global__ void __launch_bounds__(MF_TOPK_THREADS, 1)                                                     \
      name(const float *__restrict__ scores, int tokens, int experts, int k, int softmax, int renormalize,             \
           int *__restrict__ expert, float *__restrict__ gate, PlacedTables out, unsigned long long *first_bad,        \
           unsigned *seen, unsigned long long route_tag) {                                                             \
    mf::wait_for_previous_grid();                                                                                      \
    route_one_block<group, cols>(scores, tokens, experts, k, softmax, renormalize, expert, gate, out, first_bad, seen, \
                                 route_tag);                                                                           \
  }

// ---------------------------------------------------------------- capacity

// Block e decides which of expert e's pairs it keeps at a capacity of
// `capacity` pairs (dsl/capacity.h): placed[r] = e for a kept pair, -1 for a
// dropped one; blocks write disjoint pairs (each has one expert). The
// counting and placing kernels then read `placed` in place of the experts.
// Priority is a 32-bit key, larger first, ties to the lower r (for one
// expert, the earlier token):
//   token order: (k - 1 - slot) * T + (T - 1 - t), unique
//   score:       the score's bits made order-preserving as unsigned
// The capacity-th largest key is found by a radix select, eight bits a pass
// (only the bytes the largest key can have), a 256-bin histogram of the
// expert's pairs each; then the keys above it are kept, and of the keys
// equal to it (scores only: token-order keys are unique) as many as are
// left, lowest r first. A block is one expert's, so the passes run
// kCapacityThreads threads each loading kCapacityUnroll pairs at once: the
// block count (E) is below the SM count and each pass is latency-bound.
constexpr int kCapacityThreads = MF_CAPACITY_THREADS, kCapacityWarps = kCapacityThreads / 32, kCapacityUnroll = 4;
static_assert(kCapacityThreads % 32 == 0 && kCapacityThreads <= 1024, "whole warps, one block");

__device__ __forceinline__ unsigned keep_key(const float *__restrict__ score, int r, int tokens, int k, int by_score) {
  if (by_score) {
    const unsigned u = __float_as_uint(score[r]);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
  const int t = r / k, slot = r - t * k;
  return static_cast<unsigned>(k - 1 - slot) * static_cast<unsigned>(tokens) + static_cast<unsigned>(tokens - 1 - t);
}

// Block-wide exclusive prefix sum of each thread's v, and the block's total.
struct BlockCount {
  int before, total;
};
__device__ __forceinline__ BlockCount capacity_block_count(int v, int *sWarp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int incl = warp_inclusive_sum(v);
  __syncthreads(); // sWarp is free again
  if (lane == 31)
    sWarp[warp] = incl;
  __syncthreads();
  int before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kCapacityWarps; ++w) {
    before += w < warp ? sWarp[w] : 0;
    all += sWarp[w];
  }
  return {before + incl - v, all};
}

// The loops over every pair r run kCapacityUnroll independent loads in
// flight per thread: step u of an iteration takes r = base + u * threads +
// tid (written out in each loop: as a lambda, the captured counters went to
// local memory).
constexpr int kCapacityStep = kCapacityThreads * kCapacityUnroll;

extern "C" __global__ void __launch_bounds__(kCapacityThreads)
    moe_capacity_keep(const int *__restrict__ expert,  // (P)
                      const float *__restrict__ score, // (P), read when by_score
                      int tokens, int k, int capacity, int by_score,
                      int *__restrict__ placed) { // (P)
  mf::wait_for_previous_grid();
  __shared__ int sHist[256], sWarp[kCapacityWarps];
  __shared__ unsigned sPrefix;
  __shared__ int sWant;
  const int e = blockIdx.x, pairs = tokens * k;
  int mine = 0;
  for (int base = 0; base < pairs; base += kCapacityStep)
#pragma unroll
    for (int u = 0; u < kCapacityUnroll; ++u) {
      const int r = base + u * kCapacityThreads + threadIdx.x;
      mine += r < pairs && __ldg(expert + r) == e;
    }
  if (capacity_block_count(mine, sWarp).total <= capacity) { // room for every pair of e
    for (int base = 0; base < pairs; base += kCapacityStep)
#pragma unroll
      for (int u = 0; u < kCapacityUnroll; ++u) {
        const int r = base + u * kCapacityThreads + threadIdx.x;
        if (r < pairs && __ldg(expert + r) == e)
          placed[r] = e;
      }
    return;
  }
  // The highest byte a key can have set.
  const unsigned max_key = by_score ? 0xffffffffu : static_cast<unsigned>(pairs - 1);
  int top_shift = 0;
  while (top_shift < 24 && (max_key >> (top_shift + 8)) != 0)
    top_shift += 8;
  unsigned prefix = 0, mask = top_shift < 24 ? ~0u << (top_shift + 8) : 0u;
  int want = capacity; // the rank of the threshold among keys matching the prefix
  for (int shift = top_shift; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += kCapacityThreads)
      sHist[b] = 0;
    __syncthreads();
    for (int base = 0; base < pairs; base += kCapacityStep)
#pragma unroll
      for (int u = 0; u < kCapacityUnroll; ++u) {
        const int r = base + u * kCapacityThreads + threadIdx.x;
        if (r >= pairs || __ldg(expert + r) != e)
          continue;
        const unsigned key = keep_key(score, r, tokens, k, by_score);
        if ((key & mask) == prefix)
          atomicAdd(&sHist[(key >> shift) & 255u], 1);
      }
    __syncthreads();
    if (threadIdx.x == 0) { // the bin holding the want-th largest key
      int above = 0, b = 255;
      for (; b > 0 && above + sHist[b] < want; --b)
        above += sHist[b];
      sPrefix = prefix | (static_cast<unsigned>(b) << shift);
      sWant = want - above;
    }
    __syncthreads();
    prefix = sPrefix;
    want = sWant;
    mask |= 255u << shift;
  }
  if (!by_score) { // unique keys: the threshold's pair is the last one kept
    for (int base = 0; base < pairs; base += kCapacityStep)
#pragma unroll
      for (int u = 0; u < kCapacityUnroll; ++u) {
        const int r = base + u * kCapacityThreads + threadIdx.x;
        if (r < pairs && __ldg(expert + r) == e)
          placed[r] = keep_key(score, r, tokens, k, 0) >= prefix ? e : -1;
      }
    return;
  }
  // Scores: keep the keys above the threshold and the first `want` equal to
  // it, in r order (a block count per step, since steps take r in order).
  int ties_before = 0;
  for (int base = 0; base < pairs; base += kCapacityThreads) {
    const int r = base + threadIdx.x;
    const bool of_e = r < pairs && __ldg(expert + r) == e;
    const unsigned key = of_e ? keep_key(score, r, tokens, k, 1) : 0u;
    const bool tie = of_e && key == prefix;
    const BlockCount c = capacity_block_count(tie ? 1 : 0, sWarp);
    if (of_e)
      placed[r] = key > prefix || (tie && ties_before + c.before < want) ? e : -1;
    ties_before += c.total;
  }
}
