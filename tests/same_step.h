// Two schedules that differ only in where a layer keeps its tensors (their
// layout or memory, not the arithmetic) give the same training step bit for
// bit: one step of each on the same inputs and upstream gradient, through
// the backend interface (runtime/backend.h), poisoned first.
#pragma once

#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <vector>

#include "examples/examples.h"
#include "runtime/backend.h"
#include "training_compare.h"

namespace moeforge::testing {

inline void check_same_step(Backend &backend, const Example &ex, const TensorMap &inputs, int64_t tokens,
                            const Schedule &a, const Schedule &b) {
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
    CHECK(layers[0]->gradient(of).data == layers[1]->gradient(of).data);
  }
}

} // namespace moeforge::testing
