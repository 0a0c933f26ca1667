// Routed rows between ranks: expert parallelism's dispatch and its return.
//
// Experts are placed in contiguous blocks, E / R per rank (rank q owns
// experts q E/R .. (q+1) E/R - 1). Each rank routes its own tokens; its
// routed rows, sorted by expert (as the blocked routing format sorts them,
// without the padding), are then already grouped by the rank that owns
// their expert, so the rows for rank q are one contiguous slice.
//
// An exchange first moves the counts: each rank sends every other rank its
// number of pairs for each of that rank's experts (E/R int32 per peer),
// on the device. NCCL's sends take their sizes from the host, so the counts
// then cross to the host with one stream synchronisation, and the rows
// follow with exact sizes: a rank receives, source rank by source rank, each
// source's rows for its experts in that source's expert order. The return
// moves rows of the same sizes back, each to the rank and place it came from.
#pragma once

#include <cstdint>
#include <vector>

#include "backends/cuda/parallel/nccl.h"
#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/stream.h"

namespace moeforge::cuda {

// Which rank owns which expert: contiguous blocks of experts / ranks.
class ExpertPlacement {
public:
  // UserError unless ranks >= 1 and ranks divides experts.
  ExpertPlacement(int experts, int ranks);
  int experts() const { return experts_; }
  int ranks() const { return ranks_; }
  int local_experts() const { return experts_ / ranks_; }
  int owner(int expert) const { return expert / local_experts(); }
  int first_expert(int rank) const { return rank * local_experts(); }

private:
  int experts_, ranks_;
};

// The sizes of one exchange on one rank, known on the host.
struct ExchangeSizes {
  std::vector<int64_t> send_rows;   // [R] rows this rank sends to each rank
  std::vector<int64_t> recv_rows;   // [R] rows it receives from each rank
  std::vector<int32_t> send_counts; // [R x E/R] rows to rank q for its local expert j, at q * E/R + j
  std::vector<int32_t> recv_counts; // [R x E/R] rows from rank q for local expert j, at q * E/R + j
  int64_t total_send() const;
  int64_t total_recv() const;
};

// A group of every rank's local experts, [first, end) (the same on every
// rank): the rows of one round of a chunked exchange.
struct ExpertGroup {
  int first = 0, end = 0;
};
// Group `chunk` of `chunks` (1 <= chunks <= local experts, chunk < chunks):
// consecutive experts, as even as the division allows.
ExpertGroup chunk_experts(int local_experts, int chunks, int chunk);

// One round's rows, per rank q: rows [send_at[q], send_at[q] + send_rows[q])
// of the send buffer go to q, rows [recv_at[q], ...) of the receive buffer
// come from q (the buffers laid out as for the whole exchange).
struct ExchangeSlices {
  std::vector<int64_t> send_at, send_rows, recv_at, recv_rows;
};
ExchangeSlices exchange_slices(const ExchangeSizes &sizes, const ExpertPlacement &placement, ExpertGroup group);

// The sizes from this rank's per-expert counts and the counts every rank
// sent it (the host half of exchange_counts, and the tests' oracle).
ExchangeSizes exchange_sizes(const ExpertPlacement &placement, const std::vector<int32_t> &my_counts,
                             const std::vector<int32_t> &recv_counts);

class ExpertExchange {
public:
  // `comm` must outlive the exchange; its size is the placement's ranks.
  ExpertExchange(const Communicator &comm, const ExpertPlacement &placement);

  // counts: device int32 [E], this rank's routed pairs per expert. Every
  // rank calls it (a collective). Synchronises `stream` once.
  ExchangeSizes exchange_counts(CUdeviceptr counts, const Stream &stream);
  // rows: this rank's routed rows sorted by expert, row_bytes each
  // (sizes.total_send() of them). recv: room for sizes.total_recv() rows.
  void dispatch(CUdeviceptr rows, CUdeviceptr recv, size_t row_bytes, const ExchangeSizes &sizes,
                const Stream &stream) const;
  // The reverse: `processed`, laid out as dispatch's `recv`, back into
  // `rows`' layout on the ranks the rows came from.
  void give_back(CUdeviceptr processed, CUdeviceptr rows, size_t row_bytes, const ExchangeSizes &sizes,
                 const Stream &stream) const;
  // One round of a chunked exchange: the rows of `group`'s experts only, to
  // and from the places the whole exchange gives them.
  void dispatch(CUdeviceptr rows, CUdeviceptr recv, size_t row_bytes, const ExchangeSizes &sizes, ExpertGroup group,
                const Stream &stream) const;
  void give_back(CUdeviceptr processed, CUdeviceptr rows, size_t row_bytes, const ExchangeSizes &sizes,
                 ExpertGroup group, const Stream &stream) const;

  const ExpertPlacement &placement() const { return placement_; }

private:
  // One grouped round of sends and receives: to rank q `send_rows[q]` rows
  // from `send` (slices back to back), from rank q `recv_rows[q]` into `recv`.
  void all_to_all(CUdeviceptr send, const std::vector<int64_t> &send_rows, CUdeviceptr recv,
                  const std::vector<int64_t> &recv_rows, size_t row_bytes, const Stream &stream) const;
  // The same with each rank's slice placed by its own first row.
  void all_to_all(CUdeviceptr send, const std::vector<int64_t> &send_at, const std::vector<int64_t> &send_rows,
                  CUdeviceptr recv, const std::vector<int64_t> &recv_at, const std::vector<int64_t> &recv_rows,
                  size_t row_bytes, const Stream &stream) const;

  const Communicator &comm_;
  ExpertPlacement placement_;
  DeviceBuffer recv_counts_; // [R x E/R] int32
};

} // namespace moeforge::cuda
