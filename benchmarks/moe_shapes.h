// What the GPU benchmarks share: design.md's three shapes, the example layer
// of a shape, and its inputs on a device layer.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <thread>

#include "benchmarks/dense_roof.h"
#include "examples/biased_moe.h"

namespace moeforge::bench {

struct MoeShape {
  const char *name;
  int64_t tokens, d, f, experts, k;
  bool swiglu;
  double skew_ramp; // router bias ramp giving the busiest expert about 3x the mean
  double flops() const { return 2.0 * tokens * k * d * ((swiglu ? 2.0 : 1.0) * f + f); }
  RoofShape roof() const { return {tokens, k, d, f, swiglu}; }
  ExampleShape example() const {
    ExampleShape es;
    es.tokens = tokens;
    es.d = d;
    es.f = f;
    es.experts = experts;
    es.topk = k;
    return es;
  }
};

inline constexpr MoeShape kMoeShapes[] = {
    {"mixtral", 8192, 4096, 14336, 8, 2, true, 1.0},
    {"fine64", 16384, 2048, 1408, 64, 8, true, 0.6},
    {"mbpaper", 16384, 1024, 4096, 64, 1, false, 0.35},
};

// Two more training shapes, as real models have them: many experts with a
// small f (Qwen3-30B-A3B's 128 experts, f = 768, top-8) and d = f = 2880,
// no multiple of 128 (gpt-oss-120b's 128 experts, top-4).
inline constexpr MoeShape kExtraTrainShapes[] = {
    {"qwen3moe", 16384, 2048, 768, 128, 8, true, 0.6},
    {"gptoss", 8192, 2880, 2880, 128, 4, true, 0.6},
};

// How many random values a benchmark input repeats: 4M, or
// MOEFORGE_BENCH_PATTERN_VALUES (to time whether the repetition matters).
inline int64_t pattern_values() {
  const char *v = std::getenv("MOEFORGE_BENCH_PATTERN_VALUES");
  return v ? std::max<int64_t>(1, std::atoll(v)) : int64_t(1) << 22;
}

// MOEFORGE_BENCH_COOLDOWN_S seconds idle (default none) before a timed
// block: the card's clock depends on what it ran just before (seconds of
// GEMMs slow the next block by several percent), so a comparison with
// another harness gives both the same pause first.
inline void cooldown() {
  const char *v = std::getenv("MOEFORGE_BENCH_COOLDOWN_S");
  if (v && *v)
    std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(v)));
}

// MOEFORGE_BENCH_STEADY_S seconds (default 0: off) of the same work before
// a second, steady-state timing of ours and of the roof (time_ms_steady in
// dense_roof.h): the clock a continuous run keeps under the power limit.
inline double steady_seconds() {
  const char *v = std::getenv("MOEFORGE_BENCH_STEADY_S");
  return v && *v ? std::atof(v) : 0.0;
}

// `n` random values in [lo, hi): a sequential generator's for the usual 4M,
// a counter-based hash (filled on every core) past that.
inline HostTensor bench_values(int64_t n, std::mt19937_64 &rng, uint64_t stream, double lo, double hi) {
  return n > int64_t(1) << 22 ? hashed_random_tensor({n}, 1, stream, lo, hi) : random_tensor({n}, rng, lo, hi);
}

// Random inputs of the example's ranges on `layer` (a cuda::CudaLayer or
// cuda::TrainingLayer), the router bias from `bias`. Tensors past 4M values
// repeat a 4M random pattern: gigabytes of weights need no host-side random
// numbers to time realistically, and x's rows still cover every routing choice.
template <typename Layer>
void upload_inputs(Layer &layer, const Example &ex, const ExampleShape &es, Bias bias, double ramp) {
  std::mt19937_64 rng(1);
  const int64_t pattern = pattern_values();
  for (const BufferPtr &b : ex.pipeline.buffers()) {
    if (b->name == "bias") {
      layer.upload_repeated("bias", router_bias(bias, es.experts, ramp));
      continue;
    }
    int64_t n = 1;
    for (const Dim &d : b->dims)
      n *= d.is_dynamic() ? es.tokens : d.extent();
    auto it = ex.init_scale.find(b->name);
    double a = it == ex.init_scale.end() ? 1.0 : it->second;
    const int64_t m = std::min<int64_t>(n, pattern);
    layer.upload_repeated(b->name, bench_values(m, rng, random_stream(b->name), -a, a));
  }
}

// The experts token t routes to under balanced routing: (t k + i) mod E for
// i < k. Over every token these are 0 .. T k - 1 mod E, so each expert gets
// exactly T k / E pairs where E divides T k (balanced_routing_fits).
inline int64_t balanced_expert(int64_t t, int64_t i, int64_t k, int64_t experts) { return (t * k + i) % experts; }
inline bool balanced_routing_fits(const MoeShape &s) { return (s.tokens * s.k) % s.experts == 0 && s.d >= s.experts; }

// Inputs whose router sends every expert the same number of rows: x and wr
// as upload_inputs makes them (x not repeated: each row is its own), except
// that in x's first E columns the token's balanced experts hold 1 and the
// others random values in [-0.25, 0.25), and wr's first E rows are 64 times
// the identity: a chosen expert's logit is 64 plus the other columns' sum
// (about +-1), every other one's at most 16 plus that sum. (Random rather
// than zero: a GEMM's power, so its clock at the card's limit, depends on
// the operands' bits.) Why: with near-uniform random routing about half
// the experts of a shape like mbpaper (256 +- 16 rows each) end in a tile
// of a few rows that still streams the expert's whole weights; routed this
// way no expert has such a tail, and the forward's time against the same
// layer under uniform routing prices the tails.
template <typename Layer> void upload_balanced_inputs(Layer &layer, const Example &ex, const MoeShape &shape) {
  upload_inputs(layer, ex, shape.example(), Bias::none, 0.0);
  const int64_t T = shape.tokens, d = shape.d, E = shape.experts, k = shape.k;
  auto scale = [&](const std::string &name) {
    auto it = ex.init_scale.find(name);
    return it == ex.init_scale.end() ? 1.0 : it->second;
  };
  const double ax = scale("x"), awr = scale("wr");
  HostTensor x = hashed_random_tensor({T, d}, 1, random_stream("x"), -ax, ax);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < E; ++c)
      x.at({t, c}) *= 0.25 / ax; // random still, in [-0.25, 0.25): logits up to 16
    for (int64_t i = 0; i < k; ++i)
      x.at({t, balanced_expert(t, i, k, E)}) = 1.0;
  }
  layer.upload("x", x);
  std::mt19937_64 rng(2);
  HostTensor wr = random_tensor({d, E}, rng, -awr, awr);
  for (int64_t c = 0; c < E; ++c)
    for (int64_t e = 0; e < E; ++e)
      wr.at({c, e}) = c == e ? 64.0f : 0.0f;
  layer.upload("wr", wr);
}

} // namespace moeforge::bench
