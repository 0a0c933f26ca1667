// Two schedules that differ only in where a layer keeps its tensors (their
// layout or memory, not the arithmetic) give the same training step bit for
// bit: one step of each on the same inputs and upstream gradient, through
// the backend interface (runtime/backend.h), poisoned first.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "examples/examples.h"
#include "runtime/backend.h"
#include "training_compare.h"

namespace moeforge::testing {

// `summed_in_any_order`: gradients a backend sums with atomic adds in no
// fixed order (the CUDA backend's router weight gradient, split-K over the
// tokens), equal within f32 rounding instead of bit for bit.
inline void check_same_step(Backend &backend, const Example &ex, const TensorMap &inputs, int64_t tokens,
                            const Schedule &a, const Schedule &b,
                            const std::vector<std::string> &summed_in_any_order = {}) {
  const Func out = ex.pipeline.func(ex.output);
  const HostTensor dy = upstream_gradient(ex, inputs, 11);
  std::vector<std::unique_ptr<TrainingLayer>> layers;
  for (const Schedule *s : {&a, &b}) {
    layers.push_back(backend.training_layer(ex.pipeline, {out}, *s, tokens));
    TrainingLayer &l = *layers.back();
    l.upload(inputs);
    l.poison();
    l.upload_upstream_gradient(ex.output, dy);
    l.forward();
    l.backward();
  }
  const TrainingProgram &t = layers[0]->training();
  CHECK(layers[0]->output(ex.output).data == layers[1]->output(ex.output).data);
  for (const std::string &of : t.of) {
    INFO("gradient of " << of);
    const HostTensor ga = layers[0]->gradient(of), gb = layers[1]->gradient(of);
    if (std::find(summed_in_any_order.begin(), summed_in_any_order.end(), of) == summed_in_any_order.end()) {
      CHECK(ga.data == gb.data);
      continue;
    }
    REQUIRE(ga.data.size() == gb.data.size());
    double scale = 0, worst = 0;
    for (size_t i = 0; i < ga.data.size(); ++i) {
      scale = std::max(scale, std::fabs(ga.data[i]));
      worst = std::max(worst, std::fabs(ga.data[i] - gb.data[i]));
    }
    CHECK(worst <= 1e-5 * scale);
  }
}

} // namespace moeforge::testing
