#include "backends/cuda/parallel/expert_exchange.h"

#include <numeric>

#include "dsl/error.h"

namespace moeforge::cuda {

ExpertPlacement::ExpertPlacement(int experts, int ranks) : experts_(experts), ranks_(ranks) {
  user_check(ranks >= 1) << "expert parallelism over " << ranks << " ranks: give at least one rank";
  user_check(experts >= 1 && experts % ranks == 0)
      << "expert parallelism places " << experts << " experts over " << ranks
      << " ranks in equal blocks: choose a rank count that divides the expert count";
}

int64_t ExchangeSizes::total_send() const { return std::accumulate(send_rows.begin(), send_rows.end(), int64_t(0)); }
int64_t ExchangeSizes::total_recv() const { return std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t(0)); }

ExchangeSizes exchange_sizes(const ExpertPlacement &placement, const std::vector<int32_t> &my_counts,
                             const std::vector<int32_t> &recv_counts) {
  const int R = placement.ranks(), El = placement.local_experts();
  internal_check(my_counts.size() == size_t(placement.experts()) && recv_counts.size() == size_t(R * El))
      << "exchange_sizes: counts of the wrong length";
  ExchangeSizes s;
  s.send_rows.assign(R, 0);
  s.recv_rows.assign(R, 0);
  s.send_counts = my_counts;
  s.recv_counts = recv_counts;
  for (int q = 0; q < R; ++q)
    for (int j = 0; j < El; ++j) {
      const int32_t out = my_counts[q * El + j], in = recv_counts[q * El + j];
      user_check(out >= 0) << "expert parallelism: this rank counts " << out << " rows for expert " << q * El + j
                           << ": the routing tables are corrupt";
      user_check(in >= 0) << "expert parallelism: rank " << q << " sent a count of " << in
                          << " rows for this rank's expert " << j << " (of " << El
                          << "): its routing tables are corrupt";
      s.send_rows[q] += out;
      s.recv_rows[q] += in;
    }
  return s;
}

ExpertGroup chunk_experts(int local_experts, int chunks, int chunk) {
  internal_check(chunks >= 1 && chunks <= local_experts && chunk >= 0 && chunk < chunks)
      << "chunk " << chunk << " of " << chunks << " over " << local_experts << " experts";
  return {static_cast<int>(int64_t(chunk) * local_experts / chunks),
          static_cast<int>(int64_t(chunk + 1) * local_experts / chunks)};
}

ExchangeSlices exchange_slices(const ExchangeSizes &sizes, const ExpertPlacement &placement, ExpertGroup group) {
  const int R = placement.ranks(), El = placement.local_experts();
  internal_check(0 <= group.first && group.first <= group.end && group.end <= El) << "expert group out of range";
  internal_check(sizes.send_counts.size() == size_t(R * El) && sizes.recv_counts.size() == size_t(R * El))
      << "exchange_slices: sizes without the per-expert counts (exchange_sizes makes them)";
  ExchangeSlices x;
  int64_t send_base = 0, recv_base = 0;
  for (int q = 0; q < R; ++q) {
    // Rank q's rows lie back to back in expert order on both sides.
    int64_t send_at = send_base, recv_at = recv_base, send = 0, recv = 0;
    for (int j = 0; j < group.end; ++j) {
      const int64_t out = sizes.send_counts[q * El + j], in = sizes.recv_counts[q * El + j];
      if (j < group.first) {
        send_at += out;
        recv_at += in;
      } else {
        send += out;
        recv += in;
      }
    }
    x.send_at.push_back(send_at);
    x.send_rows.push_back(send);
    x.recv_at.push_back(recv_at);
    x.recv_rows.push_back(recv);
    send_base += sizes.send_rows[q];
    recv_base += sizes.recv_rows[q];
  }
  return x;
}

ExpertExchange::ExpertExchange(const Communicator &comm, const ExpertPlacement &placement)
    : comm_(comm), placement_(placement),
      recv_counts_(sizeof(int32_t) * size_t(placement.ranks() * placement.local_experts())) {
  user_check(comm.size() == placement.ranks()) << "expert parallelism over " << placement.ranks()
                                               << " ranks needs a communicator of that size, not " << comm.size();
}

void ExpertExchange::all_to_all(CUdeviceptr send, const std::vector<int64_t> &send_rows, CUdeviceptr recv,
                                const std::vector<int64_t> &recv_rows, size_t row_bytes, const Stream &stream) const {
  std::vector<int64_t> send_at(send_rows.size()), recv_at(recv_rows.size());
  std::exclusive_scan(send_rows.begin(), send_rows.end(), send_at.begin(), int64_t(0));
  std::exclusive_scan(recv_rows.begin(), recv_rows.end(), recv_at.begin(), int64_t(0));
  all_to_all(send, send_at, send_rows, recv, recv_at, recv_rows, row_bytes, stream);
}

void ExpertExchange::all_to_all(CUdeviceptr send, const std::vector<int64_t> &send_at,
                                const std::vector<int64_t> &send_rows, CUdeviceptr recv,
                                const std::vector<int64_t> &recv_at, const std::vector<int64_t> &recv_rows,
                                size_t row_bytes, const Stream &stream) const {
  const int R = placement_.ranks();
  // Sends and receives of one round in one group: NCCL pairs them up
  // whatever order the ranks post them in. A rank sends nothing where it has
  // no rows, and its peer expects none there (the sizes agree by
  // construction), so zero-row pairs are skipped on both sides.
  MOEFORGE_NCCL(ncclGroupStart);
  for (int q = 0; q < R; ++q) {
    const size_t out = size_t(send_rows[q]) * row_bytes, in = size_t(recv_rows[q]) * row_bytes;
    if (out)
      MOEFORGE_NCCL(ncclSend, reinterpret_cast<const void *>(send + size_t(send_at[q]) * row_bytes), out, ncclUint8, q,
                    comm_.handle(), stream.handle());
    if (in)
      MOEFORGE_NCCL(ncclRecv, reinterpret_cast<void *>(recv + size_t(recv_at[q]) * row_bytes), in, ncclUint8, q,
                    comm_.handle(), stream.handle());
  }
  MOEFORGE_NCCL(ncclGroupEnd);
}

ExchangeSizes ExpertExchange::exchange_counts(CUdeviceptr counts, const Stream &stream) {
  const int R = placement_.ranks(), El = placement_.local_experts();
  std::vector<int64_t> each(R, 1);
  all_to_all(counts, each, recv_counts_.ptr(), each, sizeof(int32_t) * El, stream);
  // NCCL's sends take their sizes from the host: the one synchronisation.
  stream.synchronize();
  std::vector<int32_t> mine(placement_.experts());
  MOEFORGE_CU(cuMemcpyDtoH, mine.data(), counts, sizeof(int32_t) * mine.size());
  return exchange_sizes(placement_, mine, recv_counts_.download<int32_t>());
}

void ExpertExchange::dispatch(CUdeviceptr rows, CUdeviceptr recv, size_t row_bytes, const ExchangeSizes &sizes,
                              const Stream &stream) const {
  all_to_all(rows, sizes.send_rows, recv, sizes.recv_rows, row_bytes, stream);
}

void ExpertExchange::give_back(CUdeviceptr processed, CUdeviceptr rows, size_t row_bytes, const ExchangeSizes &sizes,
                               const Stream &stream) const {
  all_to_all(processed, sizes.recv_rows, rows, sizes.send_rows, row_bytes, stream);
}

void ExpertExchange::dispatch(CUdeviceptr rows, CUdeviceptr recv, size_t row_bytes, const ExchangeSizes &sizes,
                              ExpertGroup group, const Stream &stream) const {
  const ExchangeSlices x = exchange_slices(sizes, placement_, group);
  all_to_all(rows, x.send_at, x.send_rows, recv, x.recv_at, x.recv_rows, row_bytes, stream);
}

void ExpertExchange::give_back(CUdeviceptr processed, CUdeviceptr rows, size_t row_bytes, const ExchangeSizes &sizes,
                               ExpertGroup group, const Stream &stream) const {
  const ExchangeSlices x = exchange_slices(sizes, placement_, group);
  all_to_all(processed, x.recv_at, x.recv_rows, rows, x.send_at, x.send_rows, row_bytes, stream);
}

} // namespace moeforge::cuda
