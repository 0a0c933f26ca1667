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
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/layer.h"
#include "benchmarks/dense_roof.h"
#include "benchmarks/moe_shapes.h"
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

// The presets with per-Func tiles for these layers: the single-B GEMMs take
// 256-wide tiles (SwiGLU's two-B GEMM already holds 2 x 128 columns), and the
// router GEMM, only E columns wide, a 64-wide tile.
Schedule tuned(const Shape &s, const std::string &variant) {
  Schedule t = scattermoe();
  if (variant == "tuned_2cta" || variant == "tuned_tma_2cta") {
    // 96 KiB and 64 accumulators per block: two blocks share each SM (the
    // plain wgmma loop: the warp-specialised one keeps one block per SM).
    t.mma("*", MmaKind::wgmma).tile("*", 128, 128, 64).stages("*", 3);
    if (s.swiglu)
      t.tile("h", 128, 64, 64);
    if (variant == "tuned_tma_2cta") // loads by TMA, stages paced by mbarriers and a block barrier
      t.tma("*", true);
    return t;
  }
  if (variant == "tuned_ws_deep") {
    // Warp-specialised with 128-wide tiles and six stages in flight (four
    // for SwiGLU's two-B GEMM, whose stages are half as large again).
    t.mma("*", MmaKind::wgmma_ws).stages("*", 6);
    if (s.swiglu)
      t.stages("h", 4);
    return t;
  }
  if (variant == "tuned_b64") {
    // 64-row blocks: less padding when experts get few rows (mbpaper: ~256
    // rows per expert, a quarter of them padding at block 128).
    t.block(64).tile("*", 64, 256, 64).warps("*", 4, 1).tile("h", 64, s.swiglu ? 128 : 256, 64);
    return t;
  }
  const bool tma = variant.rfind("tuned_tma", 0) == 0;
  if (variant == "tuned_ws" || variant == "tuned_r4" || variant == "tuned_r16" || variant == "tuned_persist" || tma)
    t.mma("*", MmaKind::wgmma_ws);
  if (tma) // the producer loads B tiles (and A rows in tile order) with TMA
    t.tma("*", true);
  if (variant == "tuned_tma_blocked") // a padded copy of x: the first GEMM's A by TMA as well
    t.permutation(Permutation::blocked);
  // Pairs of row tiles share B through multicast, pairs being the halves of
  // a 256-row routing tile (always one expert); _o: only the second GEMM's,
  // whose A (rows in tile order) comes by TMA too.
  if (variant == "tuned_tma_cluster" || variant == "tuned_tma_cluster_o")
    t.block(256).cluster(variant == "tuned_tma_cluster" ? "*" : "o", 2);
  // _pair_o: pairs of 128-row tiles (pair-aligned routing tiles: one
  // expert's, or two experts' last tiles loading B each) walked by persistent
  // clusters, for the second GEMM only.
  if (variant == "tuned_tma_pair_o" || variant == "tuned_tma_persist_pair_o")
    t.cluster("o", 2).persistent("o", true);
  // _persist_pair_o: and persistent blocks for the first GEMM, whose next
  // tile's first stages then load under this tile's epilogue.
  if (variant == "tuned_tma_persist_pair_o")
    t.persistent("h", true);
  if (variant == "tuned_persist" || variant == "tuned_tma_persist") // epilogues overlap the next tile's loads
    t.persistent("*", true);
  if (variant == "tuned_r4" || variant == "tuned_r16")
    t.raster("*", variant == "tuned_r4" ? 4 : 16);
  t.tile("o", 128, 256, 64).stages("o", 4).tile("logits", 128, 64, 64);
  if (!s.swiglu)
    t.tile("h", 128, 256, 64).stages("h", 4);
  return t;
}

void run_forward(benchmark::State &state, Shape shape, const char *schedule_name, bool skewed);

// A schedule that does not fit a shape (a schedule file's tile for another
// layer, say) skips that one benchmark with the reason, not the whole run.
void BM_forward(benchmark::State &state, Shape shape, const char *schedule_name, bool skewed) {
  try {
    run_forward(state, shape, schedule_name, skewed);
  } catch (const UserError &e) {
    state.SkipWithError(e.what());
  }
}

void run_forward(benchmark::State &state, Shape shape, const char *schedule_name, bool skewed) {
  ExampleShape es = shape.example();
  Bias bias = skewed ? Bias::ramp : Bias::none;
  Example ex = biased_moe(es, shape.swiglu, bias, shape.swiglu);
  std::string name = schedule_name;
  // A name ending in ".sched" is a schedule file (Schedule::save's text):
  // MOEFORGE_BENCH_SCHEDULES lists such files to time beside the variants.
  Schedule schedule = name.size() > 6 && name.substr(name.size() - 6) == ".sched" ? Schedule::load(name)
                      : name.rfind("tuned", 0) == 0                               ? tuned(shape, name)
                                                                                  : preset(name);
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
  bench::upload_inputs(layer, ex, es, bias, shape.skew_ramp);
  cuda::Stream stream;
  cuda::CudaGraph graph = cuda::CudaGraph::capture(stream, [&] { layer.enqueue(stream); });

  std::vector<int32_t> experts;
  double ours = 0;
  for (auto _ : state) {
    double ms = time_ms(stream, 10, [&] { graph.launch(stream); });
    state.SetIterationTime(ms / 1e3);
    ours += ms;
  }
  ours /= static_cast<double>(state.iterations());
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
  state.counters["max_over_mean"] = *std::max_element(counts.begin(), counts.end()) / mean;
  state.counters["act_MiB"] = double(layer.activation_bytes()) / (1 << 20);
  state.SetLabel(device().name());
  for (const std::string &line : layer.timeline(stream)) // a MOEFORGE_TIMELINE build only
    std::printf("timeline %s %s %s: %s\n", shape.name, schedule_name, skewed ? "skewed" : "uniform", line.c_str());
  if (std::getenv("MOEFORGE_PROFILE")) {
    // Where the time goes, step by step (one run, after the timed ones).
    layer.profile(stream);
    for (const auto &[step, ms] : layer.profile(stream))
      std::printf("profile %s %s %s: %-32s %8.3f ms\n", shape.name, schedule_name, skewed ? "skewed" : "uniform",
                  step.c_str(), ms);
  }
}

// The schedule files named in MOEFORGE_BENCH_SCHEDULES (comma-separated).
std::vector<std::string> schedule_files() {
  std::vector<std::string> files;
  const char *env = std::getenv("MOEFORGE_BENCH_SCHEDULES");
  std::string list = env ? env : "", item;
  for (size_t i = 0; i <= list.size(); ++i)
    if (i == list.size() || list[i] == ',') {
      if (!item.empty())
        files.push_back(item);
      item.clear();
    } else {
      item += list[i];
    }
  return files;
}

void register_all() {
  static const std::vector<std::string> files = schedule_files(); // the names must outlive registration
  for (const Shape &s : bench::kMoeShapes)
    for (const std::string &f : files)
      for (bool skew : {false, true}) {
        std::string name = std::string("forward/") + s.name + "/" + f + (skew ? "/skewed" : "/uniform");
        benchmark::RegisterBenchmark(name.c_str(), BM_forward, s, f.c_str(), skew)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond)
            ->Iterations(3);
      }
  for (const Shape &s : bench::kMoeShapes)
    for (const char *p :
         {"megablocks", "scattermoe", "tuned", "tuned_2cta", "tuned_ws", "tuned_ws_deep", "tuned_b64", "tuned_r4",
          "tuned_r16", "tuned_persist", "tuned_tma", "tuned_tma_persist", "tuned_tma_blocked", "tuned_tma_2cta",
          "tuned_tma_cluster", "tuned_tma_cluster_o", "tuned_tma_pair_o", "tuned_tma_persist_pair_o"})
      for (bool skew : {false, true}) {
        std::string name = std::string("forward/") + s.name + "/" + p + (skew ? "/skewed" : "/uniform");
        benchmark::RegisterBenchmark(name.c_str(), BM_forward, s, p, skew)
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
