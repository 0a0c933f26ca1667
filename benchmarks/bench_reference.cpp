// The Eigen reference on the example layers: how long the oracle takes on a
// small MoE, which bounds how large the checked test and CLI shapes can be.
#include <benchmark/benchmark.h>

#include "backends/reference/evaluate.h"
#include "examples/examples.h"

namespace {

void BM_reference(benchmark::State &state, const char *example, moeforge::Precision precision) {
  moeforge::ExampleShape shape;
  shape.tokens = state.range(0);
  shape.d = 256;
  shape.f = 512;
  shape.experts = 8;
  shape.topk = 2;
  moeforge::Example ex = moeforge::make_example(example, shape);
  moeforge::TensorMap inputs = ex.random_inputs(shape, 7);
  for (auto _ : state) {
    moeforge::EvalResult r = moeforge::evaluate(ex.pipeline, inputs, precision);
    benchmark::DoNotOptimize(r.values.size());
  }
  // Expert FLOPs only (router excluded), as design.md counts them.
  double f1 = std::string(example) == "swiglu_moe" ? 2.0 * shape.f : shape.f;
  double flops = 2.0 * shape.tokens * shape.topk * shape.d * (f1 + shape.f);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK_CAPTURE(BM_reference, moe_mlp_f32, "moe_mlp", moeforge::Precision::f32)
    ->Arg(256)
    ->Arg(1024)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_reference, swiglu_moe_f32, "swiglu_moe", moeforge::Precision::f32)
    ->Arg(1024)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_reference, moe_mlp_f64, "moe_mlp", moeforge::Precision::f64)
    ->Arg(1024)
    ->Unit(benchmark::kMillisecond);

} // namespace

BENCHMARK_MAIN();
