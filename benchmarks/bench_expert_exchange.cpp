// Expert parallelism's row exchange over NCCL (backends/cuda/parallel/expert_exchange.h)
// on every GPU of the machine, one thread per rank: the counts' exchange
// with its one host synchronisation, the dispatch of each rank's routed rows
// (T * k rows of width d, bf16) to the ranks owning their experts, and their
// return. Routing uniform at random, or skewed (expert weights falling
// linearly from 5 to 1 over the experts); each rank routes T tokens of its
// own.
//
//   exchange/<shape>/<routing>/ranks:<R>   counts_us  dispatch_ms  give_back_ms  off_rank_GBps
//
// off_rank_GBps: bytes each rank sends to other ranks per second of dispatch,
// averaged over ranks (a rank's own rows move too, within the GPU).
#include <benchmark/benchmark.h>

#include <chrono>
#include <random>

#include "backends/cuda/parallel/expert_exchange.h"
#include "benchmarks/moe_shapes.h"

using namespace moeforge;

namespace {

struct RankResult {
  double counts_us = 0, dispatch_ms = 0, give_back_ms = 0, off_rank_bytes = 0;
};

// Each rank's counts per expert for `pairs` pairs (uniform or skewed).
std::vector<int32_t> route(int experts, int64_t pairs, bool skewed, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> weight(experts, 1.0);
  if (skewed)
    for (int e = 0; e < experts; ++e)
      weight[e] = 1.0 + 2.0 * (experts - 1 - e) / std::max(1, experts - 1) * 2.0;
  std::discrete_distribution<int> pick(weight.begin(), weight.end());
  std::vector<int32_t> counts(experts, 0);
  for (int64_t p = 0; p < pairs; ++p)
    ++counts[pick(rng)];
  return counts;
}

void BM_exchange(benchmark::State &state, bench::MoeShape shape, bool skewed, int ranks) {
  if (!cuda::nccl_available()) {
    state.SkipWithError("NCCL is not usable");
    return;
  }
  cuda::ExpertPlacement placement(int(shape.experts), ranks);
  std::vector<int> devices(ranks);
  for (int r = 0; r < ranks; ++r)
    devices[r] = r;
  std::vector<cuda::Communicator> comms = cuda::Communicator::for_devices(devices);
  const int64_t pairs = shape.tokens * shape.k;
  const size_t row_bytes = size_t(shape.d) * 2;
  const int reps = 10;
  for (auto _ : state) {
    std::vector<RankResult> res(ranks);
    cuda::on_each_rank(devices, [&](int r) {
      cuda::Stream stream;
      cuda::ExpertExchange ex(comms[r], placement);
      cuda::DeviceBuffer counts = cuda::DeviceBuffer::from(route(int(shape.experts), pairs, skewed, 7 + r));
      cuda::DeviceBuffer rows(size_t(pairs) * row_bytes);
      rows.fill32(0x3f803f80u); // bf16 ones: the values do not matter to the copy
      cuda::ExchangeSizes sizes = ex.exchange_counts(counts.ptr(), stream);
      // The most any rank can receive: every rank's pairs.
      cuda::DeviceBuffer recv(size_t(pairs) * ranks * row_bytes);
      ex.dispatch(rows.ptr(), recv.ptr(), row_bytes, sizes, stream); // warm-up: NCCL's connections
      ex.give_back(recv.ptr(), rows.ptr(), row_bytes, sizes, stream);
      stream.synchronize();
      cuda::Event a, b, c;
      for (int i = 0; i < reps; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        sizes = ex.exchange_counts(counts.ptr(), stream);
        res[r].counts_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        a.record(stream);
        ex.dispatch(rows.ptr(), recv.ptr(), row_bytes, sizes, stream);
        b.record(stream);
        ex.give_back(recv.ptr(), rows.ptr(), row_bytes, sizes, stream);
        c.record(stream);
        res[r].dispatch_ms += cuda::elapsed_ms(a, b);
        res[r].give_back_ms += cuda::elapsed_ms(b, c);
      }
      for (int q = 0; q < ranks; ++q)
        if (q != r)
          res[r].off_rank_bytes += double(sizes.send_rows[q]) * double(row_bytes);
    });
    RankResult mean;
    for (const RankResult &x : res) {
      mean.counts_us += x.counts_us / reps / ranks;
      mean.dispatch_ms += x.dispatch_ms / reps / ranks;
      mean.give_back_ms += x.give_back_ms / reps / ranks;
      mean.off_rank_bytes += x.off_rank_bytes / ranks;
    }
    state.SetIterationTime((mean.dispatch_ms + mean.give_back_ms) * 1e-3 + mean.counts_us * 1e-6);
    state.counters["counts_us"] = mean.counts_us;
    state.counters["dispatch_ms"] = mean.dispatch_ms;
    state.counters["give_back_ms"] = mean.give_back_ms;
    state.counters["off_rank_GBps"] = mean.off_rank_bytes / (mean.dispatch_ms * 1e-3) / 1e9;
  }
}

} // namespace

int main(int argc, char **argv) {
  int devices = 0;
  if (cuda::gpu_available())
    MOEFORGE_CU(cuDeviceGetCount, &devices);
  for (const bench::MoeShape &s : bench::kMoeShapes)
    for (bool skewed : {false, true})
      for (int ranks = 1; ranks <= std::min(devices, 8); ranks *= 2) {
        if (s.experts % ranks)
          continue;
        std::string name =
            std::string("exchange/") + s.name + (skewed ? "/skewed" : "/uniform") + "/ranks:" + std::to_string(ranks);
        benchmark::RegisterBenchmark(name.c_str(), BM_exchange, s, skewed, ranks)
            ->UseManualTime()
            ->Iterations(1)
            ->Unit(benchmark::kMillisecond);
      }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
}
