#include "backends/cuda/expert_exchange.h"

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

ExpertExchange::ExpertExchange(const Communicator &comm, const ExpertPlacement &placement)
    : comm_(comm), placement_(placement),
      recv_counts_(sizeof(int32_t) * size_t(placement.ranks() * placement.local_experts())) {
  user_check(comm.size() == placement.ranks()) << "expert parallelism over " << placement.ranks()
                                               << " ranks needs a communicator of that size, not " << comm.size();
}

void ExpertExchange::all_to_all(CUdeviceptr send, const std::vector<int64_t> &send_rows, CUdeviceptr recv,
                                const std::vector<int64_t> &recv_rows, size_t row_bytes, const Stream &stream) const {
  const int R = placement_.ranks();
  // Sends and receives of one round in one group: NCCL pairs them up
  // whatever order the ranks post them in. A rank sends nothing where it has
  // no rows, and its peer expects none there (the sizes agree by
  // construction), so zero-row pairs are skipped on both sides.
  MOEFORGE_NCCL(ncclGroupStart);
  size_t sent = 0, received = 0;
  for (int q = 0; q < R; ++q) {
    const size_t out = size_t(send_rows[q]) * row_bytes, in = size_t(recv_rows[q]) * row_bytes;
    if (out)
      MOEFORGE_NCCL(ncclSend, reinterpret_cast<const void *>(send + sent), out, ncclUint8, q, comm_.handle(),
                    stream.handle());
    if (in)
      MOEFORGE_NCCL(ncclRecv, reinterpret_cast<void *>(recv + received), in, ncclUint8, q, comm_.handle(),
                    stream.handle());
    sent += out;
    received += in;
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

} // namespace moeforge::cuda
