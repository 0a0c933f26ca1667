// Shared by the CPU-backend tests: run a layer under a schedule on the CPU
// with poisoned (NaN) outputs, evaluate the Eigen reference in f64 on the same
// inputs, and compare every Func the program materialises.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include <memory>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_layer.h"
#include "backends/cpu/cpu_training.h"
#include "backends/reference/evaluate.h"
#include "examples/biased_moe.h"
#include "layer_compare.h"
#include "schedules/presets.h"
#include "training_compare.h"

namespace moeforge::cpu_test {

using testing::EdgeCase;
using testing::Outcome;
using testing::shape;

inline double normalized_error(const HostTensor &a, const HostTensor &b) {
  REQUIRE(a.shape == b.shape);
  return max_normalized_error(a, b);
}

// Through the backend interface (runtime/backend.h), as any caller runs a
// layer, so that every CPU test exercises it too.
inline Outcome run_and_compare(const Example &ex, const TensorMap &inputs, int64_t tokens, const Schedule &schedule,
                               double tolerance = 1e-2) {
  const std::unique_ptr<Layer> layer = cpu::make_backend()->layer(ex.pipeline, schedule, tokens);
  layer->upload(inputs);
  layer->poison();
  layer->run();
  return testing::compare_with_reference(ex, inputs, layer->program(), *layer, schedule.to_text(), tolerance,
                                         /*floor_fraction=*/0, schedule.capacity(), schedule.fp8_funcs(ex.pipeline));
}

// One training step (forward, then backward) on the CPU backend, checked as
// the GPU's training tests check theirs (training_compare.h).
inline Outcome cpu_train_and_compare(const Example &ex, const TensorMap &inputs, int64_t tokens,
                                     const Schedule &schedule, double tolerance = 2e-2) {
  const std::unique_ptr<TrainingLayer> layer =
      cpu::make_backend()->training_layer(ex.pipeline, {ex.pipeline.func(ex.output)}, schedule, tokens);
  const TrainingProgram &t = layer->training();
  return testing::step_and_compare(
      ex, inputs, t.program, t.seed, *layer, schedule,
      [](TrainingLayer &l) {
        l.forward();
        l.backward();
      },
      tolerance);
}

} // namespace moeforge::cpu_test
