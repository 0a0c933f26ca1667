// The MoE forward pass on the GPU against the dense roof, in one process.
//
// Shapes, routing and FLOP counts are design.md's: mixtral, fine64, mbpaper;
// uniform routing (random router) and skewed routing (logits plus a ramp over
// the experts); FLOPs = 2 T k d (f1 + f), f1 = 2f for SwiGLU. Our time is the
// whole forward: router GEMM, softmax, device routing, permutation, expert
// GEMMs, combine, replayed as one CUDA graph. The roof is cuBLAS doing
// X[Tk, d] W1[d, f1] and H[Tk, f] W2[f, d] with no routing, measured here
// (benchmarks/dense_roof.h, shared with the training benchmarks).
// Reported: TFLOP/s and ratio = roof time / our time, with the device name.
// `expert_batched/<shape>` times cuBLAS on the layer's per-expert weights
// with equal rows per expert and no routing (dense_roof.h) the same way: a
// reference for how far per-expert weights alone put a forward below the roof.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/runtime/layer.h"
#include "benchmarks/clock_counters.h"
#include "benchmarks/dense_roof.h"
#include "benchmarks/moe_shapes.h"
#include "benchmarks/schedule_files.h"
#include "benchmarks/source_file.h"
#include "examples/biased_moe.h"
#include "schedules/presets.h"

using namespace moeforge;
using bench::time_ms;

namespace {

using Shape = bench::MoeShape;

cuda::Device &device() {
  static cuda::Device d;
  return d;
}

// The card's clocks beside each timed region (clock_counters.h).
cuda::ClockSampler *clocks() { return bench::clocks_of(device()); }

// The hand-written schedules timed beside the presets, as files under
// benchmarks/schedules/forward/ (<name>_swiglu.sched, <name>_gelu.sched: the
// single-B GEMMs take 256-wide tiles, SwiGLU's two-B GEMM holds 2 x 128
// columns already, the router GEMM a 64-wide tile; TMA loads in the
// warp-specialised loop; _cluster_o: the second GEMM's B multicast to two
// blocks on the halves of 256-row routing tiles; _pair_o: pairs of 128-row
// tiles walked by persistent clusters; _persist_pair_o: and the first GEMM
// in persistent blocks). Experiments that were not kept are paragraphs in
// benchmarks/NOTES.md.
const char *const kForwardSchedules[] = {"tuned_tma",        "tuned_tma_cluster_o",
                                         "tuned_tma_pair_o", "tuned_tma_persist_pair_o",
                                         "tuned_tma@cap1.0", "tuned_tma@cap1.25"};

Schedule hand_written(const Shape &s, const std::string &name) {
  return Schedule::load(
      bench::source_file("benchmarks/schedules/forward/" + name + (s.swiglu ? "_swiglu" : "_gelu") + ".sched"));
}

// uniform: the random router's near-uniform choices; skewed: logits plus a
// ramp over the experts; balanced (MOEFORGE_BENCH_BALANCED=1): every expert
// exactly T k / E rows (moe_shapes.h's upload_balanced_inputs), to price
// the tiles of an expert's last few rows against uniform.
enum class Routing { uniform, skewed, balanced };
const char *routing_name(Routing r) {
  return r == Routing::uniform ? "uniform" : r == Routing::skewed ? "skewed" : "balanced";
}

void run_forward(benchmark::State &state, Shape shape, const char *schedule_name, Routing routing);

// A schedule that does not fit a shape (a schedule file's tile for another
// layer, say) skips that one benchmark with the reason, not the whole run.
void BM_forward(benchmark::State &state, Shape shape, const char *schedule_name, Routing routing) {
  try {
    run_forward(state, shape, schedule_name, routing);
  } catch (const UserError &e) {
    state.SkipWithError(e.what());
  }
}

void run_forward(benchmark::State &state, Shape shape, const char *schedule_name, Routing routing) {
  ExampleShape es = shape.example();
  Bias bias = routing == Routing::skewed ? Bias::ramp : Bias::none;
  Example ex = biased_moe(es, shape.swiglu, bias, shape.swiglu);
  std::string name = schedule_name;
  // "<schedule>@cap<F>": that schedule with a fixed expert capacity F
  // (Schedule::capacity), timed beside the dropless one.
  double capacity = 0;
  if (size_t at = name.find("@cap"); at != std::string::npos) {
    capacity = std::stod(name.substr(at + 4));
    name = name.substr(0, at);
  }
  // A name ending in ".sched" is a schedule file (Schedule::save's text):
  // MOEFORGE_BENCH_SCHEDULES lists such files to time beside the variants.
  Schedule schedule = bench::is_schedule_file(name) ? Schedule::load(name)
                      : name.rfind("tuned", 0) == 0 ? hand_written(shape, name)
                                                    : preset(name);
  if (capacity > 0)
    schedule.capacity(capacity);
  if (routing == Routing::balanced && !bench::balanced_routing_fits(shape)) {
    state.SkipWithError("balanced routing needs E to divide T k and d >= E");
    return;
  }
  // Compiling needs no GPU: without one, every variant is still lowered and
  // compiled (a schedule or codegen error shows here), then skipped.
  std::string why;
  if (!cuda::gpu_available(&why)) {
    cuda::compile_layer(ex.pipeline, schedule, "sm_90a");
    state.SkipWithError(("compiled; no GPU to run on: " + why).c_str());
    return;
  }
  cuda::CompiledLayer compiled = cuda::compile_layer(ex.pipeline, schedule, device().arch_specific());
  cuda::CudaLayer layer(device(), compiled, shape.tokens);
  if (routing == Routing::balanced)
    bench::upload_balanced_inputs(layer, ex, shape);
  else
    bench::upload_inputs(layer, ex, es, bias, shape.skew_ramp);
  cuda::Stream stream;
  cuda::CudaGraph graph = cuda::CudaGraph::capture(stream, [&] { layer.enqueue(stream); });

  std::vector<int32_t> experts;
  double ours = 0;
  stream.synchronize();
  bench::cooldown();
  bench::ClockMeans ours_means; // the clocks over every timed iteration
  for (auto _ : state) {
    cuda::ClockReading r;
    double ms = time_ms(
        stream, 10, [&] { graph.launch(stream); }, clocks(), &r);
    state.SetIterationTime(ms / 1e3);
    ours += ms;
    ours_means.add(r);
  }
  ours /= static_cast<double>(state.iterations());
  const cuda::ClockReading ours_clocks = ours_means.mean();
  experts = layer.routed_experts(ex.route);
  std::vector<int64_t> counts(shape.experts, 0);
  for (int32_t e : experts)
    ++counts[e];
  double mean = double(shape.tokens * shape.k) / double(shape.experts);
  double roof = bench::roof_forward_ms({shape.tokens, shape.k, shape.d, shape.f, shape.swiglu});
  // The roof on inputs of 1.0, as measured before 2026-11-23 (dense_roof.h): for comparison.
  double roof_ones =
      bench::roof_forward_ms({shape.tokens, shape.k, shape.d, shape.f, shape.swiglu}, bench::RoofData::ones);
  state.counters["TFLOPs"] = shape.flops() / (ours * 1e-3) / 1e12;
  state.counters["roof_TFLOPs"] = shape.flops() / (roof * 1e-3) / 1e12;
  state.counters["ratio"] = roof / ours;
  state.counters["roof_ones_TFLOPs"] = shape.flops() / (roof_ones * 1e-3) / 1e12;
  // The roof again, timed right after ours and the same idle pause first
  // (dense_roof.h: the clock drifts over a run): ratio_paired compares the
  // two at one clock; `ratio` keeps the roof timed once per process. The
  // paired roof is one 20-repetition sample: cuBLAS itself ran at 650-765
  // TFLOP/s on an H100 across one run, so read its median over rounds, and
  // beside `ratio`, not instead of it.
  bench::cooldown();
  cuda::ClockReading roof_clocks;
  const double roof_now =
      bench::roof_forward_ms_now({shape.tokens, shape.k, shape.d, shape.f, shape.swiglu}, clocks(), &roof_clocks);
  state.counters["roof_paired_TFLOPs"] = shape.flops() / (roof_now * 1e-3) / 1e12;
  state.counters["ratio_paired"] = roof_now / ours;
  if (clocks()) {
    // What each ran at. ratio_cycles = (roof time x roof clock) / (our time x
    // our clock): the paired ratio with the clock difference taken out, so
    // the part of a gap that is cycles shows apart from the part that is the
    // clock the card's power limit allowed each.
    bench::report_clocks(state, "", ours_clocks);
    bench::report_clocks(state, "roof_", roof_clocks);
    state.counters["power_limit_W"] = roof_clocks.power_limit_w;
    state.counters["ratio_cycles"] = (roof_now * roof_clocks.sm_mhz) / (ours * ours_clocks.sm_mhz);
  }
  if (const double steady_s = bench::steady_seconds(); steady_s > 0) {
    // Both again at the clock a continuous run keeps (moe_shapes.h), each
    // after the same idle pause and steady_s seconds of its own work, timed
    // over about a second.
    cuda::ClockReading ours_steady_clocks, roof_steady_clocks;
    bench::cooldown();
    const double ours_steady = bench::time_ms_steady(
        stream, ours, steady_s * 1e3, 1e3, [&] { graph.launch(stream); }, clocks(), &ours_steady_clocks);
    bench::cooldown();
    const double roof_steady = bench::roof_forward_ms_steady({shape.tokens, shape.k, shape.d, shape.f, shape.swiglu},
                                                             steady_s * 1e3, 1e3, clocks(), &roof_steady_clocks);
    bench::report_steady(state, clocks() != nullptr, shape.flops(), ours_steady, ours_steady_clocks, roof_steady,
                         roof_steady_clocks);
  }
  state.counters["max_over_mean"] = *std::max_element(counts.begin(), counts.end()) / mean;
  if (routing == Routing::balanced &&
      std::any_of(counts.begin(), counts.end(), [&](int64_t c) { return double(c) != mean; })) {
    state.SkipWithError("balanced routing came out unbalanced: an expert's rows differ from T k / E");
    return;
  }
  // Pairs dropped at the capacity, of T * k (0 for dropless schedules).
  state.counters["dropped_pct"] = 100.0 * double(layer.dropped_pairs(ex.route)) / double(shape.tokens * shape.k);
  state.counters["act_MiB"] = double(layer.activation_bytes()) / (1 << 20);
  state.SetLabel(device().name());
  for (const std::string &line : layer.timeline(stream)) // a MOEFORGE_TIMELINE build only
    std::printf("timeline %s %s %s: %s\n", shape.name, schedule_name, routing_name(routing), line.c_str());
  if (std::getenv("MOEFORGE_PROFILE")) {
    // Where the time goes, step by step (one run, after the timed ones).
    layer.profile(stream);
    for (const auto &[step, ms] : layer.profile(stream))
      std::printf("profile %s %s %s: %-32s %8.3f ms\n", shape.name, schedule_name, routing_name(routing), step.c_str(),
                  ms);
  }
}

// The expert-batched roof (dense_roof.h) against the dense roof, on the
// same counters as a schedule's forward: cuBLAS with the layer's per-expert
// weights, every expert given T*k/E rows, no routing. Its ratio is how close
// the vendor's own GEMM comes to the dense roof with an MoE layer's weights;
// a routed forward's ratio is to be read beside it.
void run_expert_batched(benchmark::State &state, Shape shape);
void BM_expert_batched(benchmark::State &state, Shape shape) {
  std::string why;
  if (!cuda::gpu_available(&why)) {
    state.SkipWithError(("no GPU to run on: " + why).c_str());
    return;
  }
  try { // a shape the roof cannot split into equal experts: skipped with dense_roof's reason
    run_expert_batched(state, shape);
  } catch (const UserError &e) {
    state.SkipWithError(e.what());
  }
}

void run_expert_batched(benchmark::State &state, Shape shape) {
  const bench::RoofShape roof_shape = shape.roof();
  double batched = 0;
  bench::cooldown();
  bench::ClockMeans batched_means;
  for (auto _ : state) {
    cuda::ClockReading r;
    const double ms = bench::expert_batched_forward_ms_now(roof_shape, shape.experts, clocks(), &r);
    state.SetIterationTime(ms / 1e3);
    batched += ms;
    batched_means.add(r);
  }
  batched /= static_cast<double>(state.iterations());
  bench::cooldown();
  cuda::ClockReading roof_clocks;
  const double roof_now = bench::roof_forward_ms_now(roof_shape, clocks(), &roof_clocks);
  state.counters["TFLOPs"] = shape.flops() / (batched * 1e-3) / 1e12;
  state.counters["roof_paired_TFLOPs"] = shape.flops() / (roof_now * 1e-3) / 1e12;
  state.counters["ratio_paired"] = roof_now / batched;
  if (clocks()) {
    const cuda::ClockReading batched_clocks = batched_means.mean();
    bench::report_clocks(state, "", batched_clocks);
    bench::report_clocks(state, "roof_", roof_clocks);
    state.counters["ratio_cycles"] = (roof_now * roof_clocks.sm_mhz) / (batched * batched_clocks.sm_mhz);
  }
  if (const double steady_s = bench::steady_seconds(); steady_s > 0) {
    cuda::ClockReading batched_steady_clocks, roof_steady_clocks;
    bench::cooldown();
    const double batched_steady = bench::expert_batched_forward_ms_steady(roof_shape, shape.experts, steady_s * 1e3,
                                                                          1e3, clocks(), &batched_steady_clocks);
    bench::cooldown();
    const double roof_steady =
        bench::roof_forward_ms_steady(roof_shape, steady_s * 1e3, 1e3, clocks(), &roof_steady_clocks);
    bench::report_steady(state, clocks() != nullptr, shape.flops(), batched_steady, batched_steady_clocks, roof_steady,
                         roof_steady_clocks);
  }
  state.SetLabel(device().name());
}

void register_all() {
  static const std::vector<std::string> files = bench::schedule_files(); // the names must outlive registration
  std::vector<const char *> names;
  for (const std::string &f : files)
    names.push_back(f.c_str());
  names.insert(names.end(), {"megablocks", "scattermoe"});
  names.insert(names.end(), std::begin(kForwardSchedules), std::end(kForwardSchedules));
  const int rounds = bench::bench_rounds();
  std::vector<Routing> routings{Routing::uniform, Routing::skewed};
  if (const char *v = std::getenv("MOEFORGE_BENCH_BALANCED"); v && std::string(v) == "1")
    routings.push_back(Routing::balanced);
  for (int round = 1; round <= rounds; ++round)
    for (const Shape &s : bench::kMoeShapes) {
      std::string name = std::string("expert_batched/") + s.name;
      if (rounds > 1)
        name += "/round" + std::to_string(round);
      benchmark::RegisterBenchmark(name.c_str(), BM_expert_batched, s)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(3);
    }
  for (int round = 1; round <= rounds; ++round)
    for (const Shape &s : bench::kMoeShapes)
      for (const char *p : names)
        for (Routing routing : routings) {
          std::string name = std::string("forward/") + s.name + "/" + p + "/" + routing_name(routing);
          if (rounds > 1)
            name += "/round" + std::to_string(round);
          benchmark::RegisterBenchmark(name.c_str(), BM_forward, s, p, routing)
              ->UseManualTime()
              ->Unit(benchmark::kMillisecond)
              ->Iterations(3);
        }
}

} // namespace

int main(int argc, char **argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
