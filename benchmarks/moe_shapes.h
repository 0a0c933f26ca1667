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

} // namespace moeforge::bench
