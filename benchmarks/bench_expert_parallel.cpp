// The expert-parallel training step (backends/cuda/parallel/expert_parallel_layer.h)
// on R GPUs of the machine, R = 1 and 2: each rank trains on the shape's
// token count of its own (weak scaling), the experts spread E / R a rank,
// under the training schedule of issue #16's table (tuned_wide, storing).
// Beside it, in the same process, one GPU doing the same work: the unsplit
// layer over all R ranks' tokens (CUDA graphs, as bench_moe_train times it).
//
//   ep/<shape>/<routing>/ranks:<R>/chunks:<C>
//                                    step_ms  serial_ms  hidden_ms  one_gpu_ms  tokens_per_s
//                                    one_gpu_tokens_per_s  speedup  exchange_ms  exchange_share
//                                    exposed_ms  counts_ms  rows_rank<q>
//
// step_ms: the slowest rank's forward + backward (they wait for each other)
// with the backward's row moves overlapped (the layer's default);
// serial_ms: the same with every row move in step order, and hidden_ms the
// difference, the time the overlap hides. exchange_ms: the serial step's
// dispatches and returns, forward and backward (including any wait for the
// other rank), exchange_share its share of the serial step; exposed_ms: the
// overlapped step's time spent waiting for rows; counts_ms: the counts'
// exchange with its host synchronisation. Medians of 5 steps each.
// speedup: one GPU's step over the R ranks' step for the same tokens.
// chunks: Schedule::exchange_chunks, the forward's rows in C rounds of
// expert groups, each round's GEMMs under the next round's transfer (C = 1:
// one round); the one-GPU step is timed once per shape and routing.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <tuple>

#include "backends/cuda/parallel/expert_parallel_layer.h"
#include "benchmarks/moe_shapes.h"
#include "benchmarks/train_schedule.h"
#include "examples/biased_moe.h"

using namespace moeforge;

namespace {

using Shape = bench::MoeShape;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One GPU training the unsplit layer over `tokens` tokens: ms per step.
double one_gpu_step_ms(const Example &ex, const ExampleShape &es, const Schedule &schedule, const Shape &shape,
                       bool skewed) {
  cuda::Device device(0);
  cuda::CompiledTraining compiled =
      cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), schedule, device.arch_specific());
  cuda::TrainingLayer layer(device, compiled, es.tokens);
  bench::upload_inputs(layer, ex, es, skewed ? Bias::ramp : Bias::none, shape.skew_ramp);
  std::mt19937_64 rng(2);
  layer.upload_repeated(compiled.training.seed,
                        bench::bench_values(std::min<int64_t>(bench::pattern_values(), es.tokens * es.d), rng,
                                            random_stream("d_y"), -1, 1));
  cuda::Stream stream;
  cuda::CudaGraph fwd = cuda::CudaGraph::capture(stream, [&] { layer.forward(stream); });
  cuda::CudaGraph bwd = cuda::CudaGraph::capture(stream, [&] { layer.backward(stream); });
  stream.synchronize();
  bench::cooldown();
  return bench::time_ms(stream, 5, [&] {
    fwd.launch(stream);
    bwd.launch(stream);
  });
}

// One rank's steps, with its row moves in step order (serial) or on a second
// stream beside the compute (overlap).
struct RankTimes {
  std::vector<double> step_ms, exchange_ms, counts_ms;
  std::vector<std::pair<std::string, double>> phases; // the last step's
};

struct Rank {
  RankTimes serial, overlap;
  int64_t received = 0;
};

// `steps` timed steps of `layer` into `t` (exchange: the phases named for
// the row moves, which with overlap are the waits for them).
void time_steps(cuda::ExpertParallelLayer &layer, const cuda::Stream &stream, int steps, RankTimes &t) {
  for (int i = 0; i < steps; ++i) {
    layer.forward(stream);
    layer.backward(stream);
    stream.synchronize();
    double total = 0, exchange = 0, counts = 0;
    for (const auto &[phase, ms] : layer.phase_ms()) {
      total += ms;
      if (phase.find("dispatch") != std::string::npos || phase.find("return") != std::string::npos)
        exchange += ms;
      if (phase.find("counts") != std::string::npos)
        counts += ms;
    }
    t.step_ms.push_back(total);
    t.exchange_ms.push_back(exchange);
    t.counts_ms.push_back(counts);
    t.phases = layer.phase_ms();
  }
}

void BM_expert_parallel(benchmark::State &state, Shape shape, bool skewed, int ranks, int chunks) {
  std::string why;
  if (!cuda::gpu_available(&why) || !cuda::nccl_available(&why)) {
    state.SkipWithError(("no GPU or NCCL: " + why).c_str());
    return;
  }
  ExampleShape es = shape.example(); // per rank
  Example ex = biased_moe(es, shape.swiglu, Bias::none, shape.swiglu);
  const Schedule schedule = bench::tuned_wide(shape.swiglu);
  std::vector<int> devices(ranks);
  for (int r = 0; r < ranks; ++r)
    devices[r] = r;
  std::string arch;
  {
    cuda::Device d(0);
    arch = d.arch_specific();
  }
  cuda::CompiledExpertParallel compiled = cuda::compile_expert_parallel(
      ex.pipeline, Schedule(schedule).expert_parallel(ranks).exchange_chunks(chunks), arch);
  std::vector<cuda::Communicator> comms = cuda::Communicator::for_devices(devices);
  const int steps = 5;
  for (auto _ : state) {
    std::vector<Rank> times(ranks);
    cuda::on_each_rank(devices, [&](int q) {
      cuda::Device device(devices[q]);
      cuda::Stream stream;
      cuda::ExpertParallelLayer layer(device, compiled, comms[q], es.tokens);
      bench::upload_inputs(layer, ex, es, skewed ? Bias::ramp : Bias::none, shape.skew_ramp);
      std::mt19937_64 rng(2 + q);
      layer.upload_repeated("d_y", bench::bench_values(std::min<int64_t>(bench::pattern_values(), es.tokens * es.d),
                                                       rng, random_stream("d_y"), -1, 1));
      layer.time_phases(true);
      for (int i = 0; i < 2; ++i) { // warm-up: NCCL's connections, the first set_tokens
        layer.forward(stream);
        layer.backward(stream);
      }
      stream.synchronize();
      bench::cooldown();
      layer.overlap(false);
      time_steps(layer, stream, steps, times[q].serial);
      layer.overlap(true);
      time_steps(layer, stream, steps, times[q].overlap);
      times[q].received = layer.received_rows();
    });
    // The ranks wait for each other at every exchange: the step is the slowest's.
    auto slowest = [&](RankTimes Rank::*mode) {
      size_t s = 0;
      for (size_t q = 1; q < times.size(); ++q)
        if (median((times[q].*mode).step_ms) > median((times[s].*mode).step_ms))
          s = q;
      return s;
    };
    const size_t so = slowest(&Rank::overlap), ss = slowest(&Rank::serial);
    const RankTimes &on = times[so].overlap, &off = times[ss].serial;
    const double step = median(on.step_ms), serial = median(off.step_ms);
    ExampleShape all = es;
    all.tokens = es.tokens * ranks;
    Example whole = biased_moe(all, shape.swiglu, Bias::none, shape.swiglu);
    static std::map<std::string, double> one_gpu; // per shape, routing and ranks: the chunks share it
    const std::string key = std::string(shape.name) + (skewed ? "/skewed/" : "/uniform/") + std::to_string(ranks);
    if (!one_gpu.count(key))
      one_gpu[key] = one_gpu_step_ms(whole, all, schedule, shape, skewed);
    const double one = one_gpu.at(key);
    state.SetIterationTime(step / 1e3);
    state.counters["step_ms"] = step;
    state.counters["serial_ms"] = serial;
    state.counters["hidden_ms"] = serial - step;
    state.counters["one_gpu_ms"] = one;
    state.counters["tokens_per_s"] = double(all.tokens) / (step * 1e-3);
    state.counters["one_gpu_tokens_per_s"] = double(all.tokens) / (one * 1e-3);
    state.counters["speedup"] = one / step;
    state.counters["exchange_ms"] = median(off.exchange_ms);
    state.counters["exchange_share"] = median(off.exchange_ms) / serial;
    state.counters["exposed_ms"] = median(on.exchange_ms);
    state.counters["counts_ms"] = median(off.counts_ms);
    state.counters["chunks"] = chunks;
    for (int q = 0; q < ranks; ++q)
      state.counters["rows_rank" + std::to_string(q)] = double(times[q].received);
    for (const auto &[mode, t, r] : {std::tuple{"serial", &off, ss}, std::tuple{"overlap", &on, so}})
      for (const auto &[phase, ms] : t->phases)
        std::printf("phases %s %s ranks:%d chunks:%d %s rank %zu: %-48s %8.3f ms\n", shape.name,
                    skewed ? "skewed" : "uniform", ranks, chunks, mode, r, phase.c_str(), ms);
  }
}

} // namespace

int main(int argc, char **argv) {
  int devices = 0;
  if (cuda::gpu_available())
    MOEFORGE_CU(cuDeviceGetCount, &devices);
  for (const Shape &s : bench::kMoeShapes) {
    if (std::string(s.name) == "mbpaper")
      continue; // top-1 over 64 small experts: the issue asks for mixtral and fine64
    for (bool skewed : {false, true})
      for (int ranks = 1; ranks <= std::max(1, std::min(devices, 2)); ranks *= 2)
        for (int chunks : {1, 2, 4}) {
          if (chunks > 1 && ranks == 1)
            continue; // rounds hide transfers, which one rank's are not
          std::string name = std::string("ep/") + s.name + (skewed ? "/skewed" : "/uniform") +
                             "/ranks:" + std::to_string(ranks) + "/chunks:" + std::to_string(chunks);
          benchmark::RegisterBenchmark(name.c_str(), BM_expert_parallel, s, skewed, ranks, chunks)
              ->UseManualTime()
              ->Iterations(1)
              ->Unit(benchmark::kMillisecond);
        }
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
}
