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
// backward (saved_MiB) for each memory choice (store or recompute).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include "backends/cuda/training_layer.h"
#include "benchmarks/dense_roof.h"
#include "benchmarks/moe_shapes.h"
#include "benchmarks/train_schedule.h"
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

// The forward benchmark's tuned schedule (256-wide tiles for its single-B
// GEMMs, warp-specialised wgmma; the backward's GEMMs get the default tile),
// or, wide, bench::tuned_wide: 256-wide tiles for the backward's too.
Schedule tuned(const Shape &s, bool wide) {
  if (wide)
    return bench::tuned_wide(s.swiglu);
  Schedule t = scattermoe();
  t.mma("*", MmaKind::wgmma_ws).tile("o", 128, 256, 64).stages("o", 4).tile("logits", 128, 64, 64);
  if (!s.swiglu)
    t.tile("h", 128, 256, 64).stages("h", 4);
  return t;
}

// A variant's schedule: a base name, then modifiers after '+', each one
// schedule change, so that an experiment is a benchmark name
// ("tuned_wide_lean+blocked") rather than an edit here.
Schedule variant(const Shape &shape, const std::string &full) {
  const std::string name = full.substr(0, full.find('+'));
  Schedule schedule = name.rfind("tuned", 0) == 0 ? tuned(shape, name.rfind("tuned_wide", 0) == 0) : preset(name);
  if (name == "tuned_wide_persist")
    schedule.persistent("*", true);
  if (name == "tuned_wide_lean")
    schedule.recompute_elementwise(true).gate_gradient_from_dh(true);
  if (name == "tuned_wide_gate")
    schedule.gate_gradient_from_dh(true);
  for (size_t at = full.find('+'); at != std::string::npos;) {
    const size_t next = full.find('+', at + 1);
    const std::string mod = full.substr(at + 1, next == std::string::npos ? std::string::npos : next - at - 1);
    if (mod == "blocked") // sort-and-pad: x copied in the padded order, read by TMA
      schedule.permutation(Permutation::blocked);
    else if (mod == "chain") // SwiGLU's input gradient as one GEMM over both reductions
      schedule.chain_summed_gemms(true);
    else if (mod == "persist_dx") // the input gradient's GEMMs persistent, stored by TMA
      schedule.persistent("d_x", true).tma_store("d_x", true);
    else {
      std::fprintf(stderr, "bench_moe_train: unknown variant modifier '+%s' in '%s'\n", mod.c_str(), full.c_str());
      std::exit(2);
    }
    at = next;
  }
  return schedule;
}

void BM_train(benchmark::State &state, Shape shape, const char *schedule_name, bool recompute, bool skewed) {
  ExampleShape es = shape.example();
  Example ex = biased_moe(es, shape.swiglu, Bias::none, shape.swiglu);
  Schedule schedule = variant(shape, schedule_name);
  schedule.recompute(recompute);
  // MOEFORGE_WRITE_SCHEDULES=<dir>: each variant's schedule as a file
  // (<shape>_<variant>.sched), so that another harness (the PyTorch module's,
  // benchmarks/torch_module_train.py) times the very same schedule.
  if (const char *dir = std::getenv("MOEFORGE_WRITE_SCHEDULES"))
    schedule.save(std::string(dir) + "/" + shape.name + "_" + schedule_name + (recompute ? "+re" : "") + ".sched");
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
  layer.upload_repeated(compiled.training.seed, random_tensor({1 << 22}, rng, -1, 1));
  cuda::Stream stream;
  cuda::CudaGraph fwd = cuda::CudaGraph::capture(stream, [&] { layer.forward(stream); });
  cuda::CudaGraph bwd = cuda::CudaGraph::capture(stream, [&] { layer.backward(stream); });

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
  state.counters["saved_MiB"] = double(layer.saved_bytes()) / (1 << 20);
  // Every tensor the step holds beyond its inputs and weights (activations,
  // intermediates, gradients), all allocated up front: the step's peak
  // beyond them, as torch's step_peak_MiB counts it.
  state.counters["step_MiB"] = double(layer.layer().activation_bytes()) / (1 << 20);
  state.SetLabel(device().name());
  // A MOEFORGE_TIMELINE build: each GEMM's tile phases (setup, main loop,
  // epilogue), forward and backward alike.
  const std::string tag = std::string(schedule_name) + (recompute ? "+re" : "") + (skewed ? " skewed" : "");
  for (const std::string &line : layer.timeline(stream))
    std::printf("timeline %s %s: %s\n", shape.name, tag.c_str(), line.c_str());
  if (std::getenv("MOEFORGE_PROFILE")) {
    for (const auto &[step, ms] : layer.profile_forward(stream))
      std::printf("profile %s %s fwd: %-36s %8.3f ms\n", shape.name, tag.c_str(), step.c_str(), ms);
    for (const auto &[step, ms] : layer.profile_backward(stream))
      std::printf("profile %s %s bwd: %-36s %8.3f ms\n", shape.name, tag.c_str(), step.c_str(), ms);
  }
}

// train/<shape>/<routing>/<schedule>/<memory>: every schedule on the design
// shapes with uniform routing; the widest schedule also with skewed routing
// (a ramp on the router logits: the busiest expert gets about 3x the mean)
// and on the extra shapes; tuned_wide_lean: tuned_wide keeping only the
// pre-activations of the activation (recompute_elementwise) and no expert
// outputs (gate_gradient_from_dh), uniform and skewed, on every shape;
// tuned_wide_gate: the latter alone; tuned_wide_lean+persist_dx: the lean
// mode with the input gradient's GEMM in persistent blocks.
void register_all() {
  auto add = [](const Shape &s, const char *p, bool re, bool skewed) {
    std::string name =
        std::string("train/") + s.name + (skewed ? "/skewed/" : "/uniform/") + p + (re ? "/recompute" : "/store");
    benchmark::RegisterBenchmark(name.c_str(), BM_train, s, p, re, skewed)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(2);
  };
  for (const Shape &s : bench::kMoeShapes) {
    for (const char *p : {"megablocks", "scattermoe", "tuned", "tuned_wide", "tuned_wide_persist"})
      for (bool re : {false, true})
        add(s, p, re, false);
    add(s, "tuned_wide", false, true);
    add(s, "tuned_wide_gate", false, false);
    add(s, "tuned_wide_lean", false, false);
    add(s, "tuned_wide_lean", false, true);
    for (const char *v : {"tuned_wide_lean+persist_dx"})
      for (bool skewed : {false, true})
        add(s, v, false, skewed);
  }
  for (const Shape &s : bench::kExtraTrainShapes)
    for (bool skewed : {false, true})
      for (bool re : {false, true})
        if (!(skewed && re))
          add(s, "tuned_wide", re, skewed);
  for (const Shape &s : bench::kExtraTrainShapes)
    for (bool skewed : {false, true})
      for (const char *v : {"tuned_wide_lean", "tuned_wide_lean+persist_dx"})
        add(s, v, false, skewed);
}

} // namespace

int main(int argc, char **argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
