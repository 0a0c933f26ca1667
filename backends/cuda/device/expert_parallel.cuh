// Expert parallelism's row moves on one rank, compiled at run time with
// NVRTC (embedded at build time, backends/cuda/CMakeLists.txt):
//   mf_ep_pack    rows in pair order (r = t * k + slot), or in the routing's
//                 padded order, to the exchange's
//                 order: grouped by expert, experts in order, pair order
//                 within each (what ExpertExchange::dispatch sends, each
//                 rank's experts one contiguous slice)
//   mf_ep_unpack  the reverse
//   mf_ep_select  the expert side's selection scores of the received rows:
//                 1 at a row's local expert, 0 elsewhere
// Rows move as 16-byte vectors (the layers' rows are multiples of 16 bytes).
// A pair's place in the exchange's order comes from the token side's
// routing tables: its rank within its expert (pair_pos minus the expert's
// padded offset) past the expert's unpadded offset.

#ifndef __CUDACC_RTC__
#include <cstdint>
#endif

namespace mf_ep {

__device__ __forceinline__ long long exchange_row(long long r, const int *expert, const int *pair_pos,
                                                  const int *offsets, const int *offsets_unpadded) {
  const int e = expert[r];
  return static_cast<long long>(offsets_unpadded[e]) + (pair_pos[r] - offsets[e]);
}

} // namespace mf_ep

extern "C" __global__ void mf_ep_pack(const uint4 *__restrict__ pairs_rows, uint4 *__restrict__ exchange_rows,
                                      const int *__restrict__ expert, const int *__restrict__ pair_pos,
                                      const int *__restrict__ offsets, const int *__restrict__ offsets_unpadded,
                                      long long pairs, int row_vectors, int padded) {
  const long long total = pairs * row_vectors;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long r = i / row_vectors, v = i % row_vectors;
    const long long c = mf_ep::exchange_row(r, expert, pair_pos, offsets, offsets_unpadded);
    // A padded source (a schedule that keeps per-pair tensors in the
    // routing's padded order) holds pair r's row at pair_pos[r].
    const long long from = padded ? static_cast<long long>(pair_pos[r]) : r;
    exchange_rows[c * row_vectors + v] = pairs_rows[from * row_vectors + v];
  }
}

// `unused` keeps mf_ep_pack's parameter list, so one launch serves both (the
// destination is always in pair order).
extern "C" __global__ void mf_ep_unpack(const uint4 *__restrict__ exchange_rows, uint4 *__restrict__ pairs_rows,
                                        const int *__restrict__ expert, const int *__restrict__ pair_pos,
                                        const int *__restrict__ offsets, const int *__restrict__ offsets_unpadded,
                                        long long pairs, int row_vectors, int unused) {
  const long long total = pairs * row_vectors;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long r = i / row_vectors, v = i % row_vectors;
    const long long c = mf_ep::exchange_row(r, expert, pair_pos, offsets, offsets_unpadded);
    pairs_rows[i] = exchange_rows[c * row_vectors + v];
  }
}

// segment_end[s]: received rows before the end of segment s = q * L + j
// (rank q's rows for local expert j), inclusive prefix sums; L = local
// experts. A row's segment is found by binary search.
extern "C" __global__ void mf_ep_select(float *__restrict__ select, const long long *__restrict__ segment_end,
                                        int segments, int local_experts, long long rows) {
  const long long total = rows * local_experts;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long n = i / local_experts;
    int lo = 0, hi = segments - 1;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (segment_end[mid] > n)
        hi = mid;
      else
        lo = mid + 1;
    }
    select[i] = (lo % local_experts) == (i % local_experts) ? 1.0f : 0.0f;
  }
}
