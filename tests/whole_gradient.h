// A layer's outputs and the gradients of every Input and Param as one
// pipeline: what lower() compiles when a training step is not split into a
// forward and a backward entry point (lower_training). Shared by the CPU,
// CUDA codegen and GPU tests of that lowering.
#pragma once

#include <random>

#include "backends/reference/evaluate.h"
#include "dsl/autodiff.h"
#include "examples/aux_loss_example.h"

namespace moeforge::testing {

struct WholeGradient {
  Example example;  // the aux-loss layer with every output and gradient as outputs
  TensorMap inputs; // random inputs, and random upstream gradients (seeds)
};

inline WholeGradient outputs_and_gradients(const AuxLossLayer &a, const ExampleShape &s) {
  std::vector<Func> outputs = a.output_funcs();
  Gradients g = grad(a.example.pipeline, outputs);
  std::vector<Func> all = outputs;
  for (const BufferPtr &b : a.example.pipeline.buffers())
    if (auto it = g.of.find(b->name); it != g.of.end())
      all.push_back(it->second);
  WholeGradient w{a.example, a.example.random_inputs(s, 8)};
  w.example.pipeline = Pipeline(all);
  EvalResult fwd = evaluate(a.example.pipeline, w.inputs, Precision::f64);
  std::mt19937_64 rng(21);
  for (size_t i = 0; i < g.seeds.size(); ++i)
    w.inputs[g.seeds[i]] = random_tensor(fwd[outputs[i].name()].shape, rng, -1.0, 1.0, /*bf16=*/false);
  return w;
}

} // namespace moeforge::testing
