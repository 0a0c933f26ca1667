// A training step of the MoE layer on the GPU, forward + backward, against the
// dense roof of the same GEMMs, in one process.
//
// Shapes, routing and FLOPs are design.md's (mixtral, fine64, mbpaper;
// forward 2 T k d (f1 + f), backward twice that). Our time is the whole step
// as one CUDA graph: router GEMM, softmax, device routing, permutation,
// expert GEMMs, combine, then the derived backward (gradients of x, the
// router and every expert weight: transposes, SDD/DSD-shaped GEMMs, expert
// reductions, the gate and router gradients). The roof is cuBLAS doing the
// forward and backward GEMMs with no routing (benchmarks/dense_roof.h).
// Reported: TFLOP/s, ratio = roof time / our time, forward and backward
// milliseconds, and the activation memory the forward keeps for the
// backward (saved_MiB) for each memory choice (store, lean or recompute).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "backends/cuda/runtime/training_layer.h"
#include "benchmarks/clock_counters.h"
#include "benchmarks/dense_roof.h"
#include "benchmarks/moe_shapes.h"
#include "benchmarks/schedule_files.h"
#include "benchmarks/train_schedule.h"
#include "examples/biased_moe.h"
#include "lowering/default_schedule.h"
#include "schedules/presets.h"

using namespace moeforge;
using bench::time_ms;

namespace {

using Shape = bench::MoeShape;

cuda::Device &device() {
  static cuda::Device d;
  return d;
}

// What the forward keeps for the backward, on top of a schedule:
//   store      every activation the backward reads (the schedule as written)
//   lean       the layer input, the pre-activations and the routing tables:
//              the activation is made again under the GEMMs that read it
//              (recompute_elementwise) and the gate's gradient comes from the
//              dH GEMM (gate_gradient_from_dh), so no expert output is kept;
//              the gated h dW2 reads is made on its own before dA, so the
//              backward's peak holds one T k x f tensor fewer
//              (split_pointwise_for_memory), and the activation gradients
//              take the saved pre-activations' bytes on caller memory
//              (gradients_over_saved), grouped by expert without padding
//              (sorted_saved); the backward's GEMMs gather dy's
//              rows themselves, with no per-pair copy
//              (gather_upstream_in_gemms); y, dy and dx are bf16, as a bf16
//              model passes them (bf16_boundary): the default schedule's
//              choices
//   recompute  the routing tables and the input: the forward runs again
enum class Memory { store, lean, recompute };

const char *memory_name(Memory m) { return m == Memory::store ? "store" : m == Memory::lean ? "lean" : "recompute"; }

// A preset by name, tuned_wide (benchmarks/schedules/train/tuned_wide_*.sched),
// "default" (what MoELayer and the CLI run when given no schedule: its lean
// choices are its own, so it is timed as written), "default_narrow" (the
// default with every single-B contraction's narrow tail: the last column
// tile's wgmmas narrower where it is half full or less) or a schedule
// file.
// "default+a-b" (MOEFORGE_BENCH_DEFAULT_CHOICES) is the default with
// layer-wide choice a on and b off, to time a choice against the default in
// one process; "+a:f" sets a per-Func choice for Func f (persistent:d_x is
// `persistent("d_x", true)`).
Schedule schedule_of(const Shape &shape, const Example &ex, const std::string &name, Memory memory) {
  const bool with_choices = name.rfind("default+", 0) == 0 || name.rfind("default-", 0) == 0;
  if (with_choices) {
    std::string text = default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)}).to_text();
    for (size_t at = 7; at < name.size();) {
      const size_t next = name.find_first_of("+-", at + 1);
      const std::string choice = name.substr(at + 1, next - at - 1);
      const size_t colon = choice.find(':');
      const std::string on = name[at] == '+' ? "true" : "false";
      text += colon == std::string::npos
                  ? choice + "(" + on + ")\n"
                  : choice.substr(0, colon) + "(\"" + choice.substr(colon + 1) + "\", " + on + ")\n";
      at = next == std::string::npos ? name.size() : next;
    }
    Schedule s = Schedule::from_text(text, name);
    s.recompute(memory == Memory::recompute);
    return s;
  }
  const bool is_default = name == "default" || name == "default_narrow";
  Schedule s = name == "tuned_wide"            ? bench::tuned_wide(shape.swiglu)
               : is_default                    ? default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)})
               : bench::is_schedule_file(name) ? Schedule::load(name)
                                               : preset(name);
  if (name == "default_narrow")
    for (const char *f : {"o", "d_h", "d_w1", "d_w2", "d_w3", "d_x"})
      s.narrow_tail(f, true);
  if (memory == Memory::lean)
    s.recompute_elementwise(true)
        .gate_gradient_from_dh(true)
        .split_pointwise_for_memory(true)
        .gradients_over_saved(true)
        .sorted_saved(true)
        .sorted_gathers(true)
        .gather_upstream_in_gemms(true)
        .bf16_boundary(true);
  s.recompute(memory == Memory::recompute);
  return s;
}

void BM_train(benchmark::State &state, Shape shape, const char *schedule_name, Memory memory, bool skewed) {
  ExampleShape es = shape.example();
  Example ex = biased_moe(es, shape.swiglu, Bias::none, shape.swiglu);
  Schedule schedule = schedule_of(shape, ex, schedule_name, memory);
  // MOEFORGE_WRITE_SCHEDULES=<dir>: each benchmark's schedule as a file
  // (<shape>_<schedule>_<memory>.sched), so that another harness (the
  // PyTorch module's, benchmarks/torch_module_train.py) times the very same
  // schedule.
  if (const char *dir = std::getenv("MOEFORGE_WRITE_SCHEDULES"))
    schedule.save(std::string(dir) + "/" + shape.name + "_" + schedule_name + "_" + memory_name(memory) + ".sched");
  std::string why;
  if (!cuda::gpu_available(&why)) {
    cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), schedule, "sm_90a");
    state.SkipWithError(("compiled; no GPU to run on: " + why).c_str());
    return;
  }
  cuda::CompiledTraining compiled =
      cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), schedule, device().arch_specific());
  cuda::TrainingLayer layer(device(), compiled, shape.tokens);
  bench::upload_inputs(layer, ex, es, skewed ? Bias::ramp : Bias::none, shape.skew_ramp);
  std::mt19937_64 rng(2);
  const int64_t dy_values = std::min<int64_t>(bench::pattern_values(), shape.tokens * shape.d);
  layer.upload_repeated(compiled.training.seed, bench::bench_values(dy_values, rng, random_stream("d_y"), -1, 1));
  cuda::Stream stream;
  cuda::CudaGraph fwd = cuda::CudaGraph::capture(stream, [&] { layer.forward(stream); });
  cuda::CudaGraph bwd = cuda::CudaGraph::capture(stream, [&] { layer.backward(stream); });

  stream.synchronize();
  bench::cooldown();
  double ours = 0;
  for (auto _ : state) {
    double ms = time_ms(stream, 5, [&] {
      fwd.launch(stream);
      bwd.launch(stream);
    });
    state.SetIterationTime(ms / 1e3);
    ours += ms;
  }
  ours /= static_cast<double>(state.iterations());
  double f_ms = time_ms(stream, 5, [&] { fwd.launch(stream); });
  double b_ms = time_ms(stream, 5, [&] { bwd.launch(stream); });
  bench::RoofShape rs = shape.roof();
  double roof = bench::roof_forward_backward_ms(rs);
  state.counters["TFLOPs"] = rs.forward_backward_flops() / (ours * 1e-3) / 1e12;
  state.counters["roof_TFLOPs"] = rs.forward_backward_flops() / (roof * 1e-3) / 1e12;
  state.counters["ratio"] = roof / ours;
  state.counters["fwd_ms"] = f_ms;
  state.counters["bwd_ms"] = b_ms;
  if (const double steady_s = bench::steady_seconds(); steady_s > 0) {
    // The step and the roof again at the clock a continuous run keeps
    // (moe_shapes.h), each after the same idle pause and steady_s seconds
    // of its own work, timed over about a second.
    cuda::ClockSampler *clocks = bench::clocks_of(device());
    cuda::ClockReading ours_clocks, roof_clocks;
    bench::cooldown();
    const double ours_steady = bench::time_ms_steady(
        stream, ours, steady_s * 1e3, 1e3,
        [&] {
          fwd.launch(stream);
          bwd.launch(stream);
        },
        clocks, &ours_clocks);
    bench::cooldown();
    const double roof_steady = bench::roof_forward_backward_ms_steady(rs, steady_s * 1e3, 1e3, clocks, &roof_clocks);
    bench::report_steady(state, clocks != nullptr, rs.forward_backward_flops(), ours_steady, ours_clocks, roof_steady,
                         roof_clocks);
  }
  state.counters["saved_MiB"] = double(layer.saved_bytes()) / (1 << 20);
  // Every tensor the step holds beyond its inputs and weights (activations,
  // intermediates, gradients), all allocated up front: the step's peak
  // beyond them, as torch's step_peak_MiB counts it.
  state.counters["step_MiB"] = double(layer.layer().activation_bytes()) / (1 << 20);
  state.SetLabel(device().name());
  // A MOEFORGE_TIMELINE build: each GEMM's tile phases (setup, main loop,
  // epilogue), forward and backward alike.
  const std::string tag = std::string(schedule_name) + "/" + memory_name(memory) + (skewed ? " skewed" : "");
  for (const std::string &line : layer.timeline(stream))
    std::printf("timeline %s %s: %s\n", shape.name, tag.c_str(), line.c_str());
  if (std::getenv("MOEFORGE_PROFILE")) {
    for (const auto &[step, ms] : layer.profile_forward(stream))
      std::printf("profile %s %s fwd: %-36s %8.3f ms\n", shape.name, tag.c_str(), step.c_str(), ms);
    for (const auto &[step, ms] : layer.profile_backward(stream))
      std::printf("profile %s %s bwd: %-36s %8.3f ms\n", shape.name, tag.c_str(), step.c_str(), ms);
  }
}

// train/<shape>/<routing>/<schedule>/<memory>: the presets and tuned_wide
// on the design shapes, uniform routing, storing or recomputing; tuned_wide
// in every memory mode on every shape, and skewed routing (a ramp on the
// router logits: the busiest expert gets about 3x the mean) storing or lean;
// the default schedule, both routings, on every shape (train/<shape>/
// <routing>/default/store: its memory choices are its own), and with its
// narrow tails where a column extent leaves one; the schedule files of MOEFORGE_BENCH_SCHEDULES; all of it
// MOEFORGE_BENCH_ROUNDS times over (a "/round<r>" suffix where more than
// once). Experiments with other variants are entries of benchmarks/NOTES.md.
void register_all() {
  const int rounds = bench::bench_rounds();
  int round = 1;
  auto add = [&](const Shape &s, const char *p, Memory m, bool skewed) {
    std::string name = std::string("train/") + s.name + (skewed ? "/skewed/" : "/uniform/") + p + "/" + memory_name(m);
    if (rounds > 1)
      name += "/round" + std::to_string(round);
    benchmark::RegisterBenchmark(name.c_str(), BM_train, s, p, m, skewed)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(2);
  };
  // Schedule files (MOEFORGE_BENCH_SCHEDULES: what `moeforge tune --train`
  // wrote) as written, uniform and skewed, beside tuned_wide storing.
  static const std::vector<std::string> files = bench::schedule_files(); // the names must outlive registration
  auto tuned_wide = [&](const Shape &s) {
    for (Memory m : {Memory::store, Memory::lean, Memory::recompute})
      add(s, "tuned_wide", m, false);
    for (Memory m : {Memory::store, Memory::lean})
      add(s, "tuned_wide", m, true);
    for (bool skewed : {false, true})
      add(s, "default", Memory::store, skewed);
    // Where a column extent leaves the last 256-wide tile half full or less
    // (fine64's f = 1408, gptoss's 2880).
    if (s.f % 256 != 0 || s.d % 256 != 0)
      for (bool skewed : {false, true})
        add(s, "default_narrow", Memory::store, skewed);
  };
  // MOEFORGE_BENCH_DEFAULT_CHOICES: ';'-separated variants of the default,
  // each "+choice" / "-choice" layer-wide or "+choice:func" for one Func
  // (e.g. "+gather_in_gemms;+atomic_input_gradient+gather_in_gemms;
  // +persistent:d_x").
  static const std::vector<std::string> variants = [] {
    std::vector<std::string> out;
    const char *env = std::getenv("MOEFORGE_BENCH_DEFAULT_CHOICES");
    for (std::string rest = env ? env : ""; !rest.empty();) {
      const size_t semi = rest.find(';');
      if (const std::string v = rest.substr(0, semi); !v.empty())
        out.push_back("default" + v);
      rest = semi == std::string::npos ? "" : rest.substr(semi + 1);
    }
    return out;
  }();
  for (round = 1; round <= rounds; ++round) {
    // Every training shape, the extra ones too (qwen3moe, gptoss): a
    // variant is timed where the default is.
    auto add_variants = [&](const Shape &s) {
      for (const std::string &v : variants)
        for (bool skewed : {false, true})
          add(s, v.c_str(), Memory::store, skewed);
    };
    for (const Shape &s : bench::kMoeShapes)
      add_variants(s);
    for (const Shape &s : bench::kExtraTrainShapes)
      add_variants(s);
    for (const Shape &s : bench::kMoeShapes)
      for (const std::string &f : files)
        for (bool skewed : {false, true})
          add(s, f.c_str(), Memory::store, skewed);
    for (const Shape &s : bench::kMoeShapes)
      for (const char *p : {"megablocks", "scattermoe"})
        for (Memory m : {Memory::store, Memory::recompute})
          add(s, p, m, false);
    for (const Shape &s : bench::kMoeShapes)
      tuned_wide(s);
    for (const Shape &s : bench::kExtraTrainShapes)
      tuned_wide(s);
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
