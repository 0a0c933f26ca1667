// What the training tests of every compiled backend share: the presets with
// their memory-mode suffixes, the training algebra as the reference sees it,
// a random upstream gradient, and one forward + backward of a training layer
// (cpu::CpuTrainingLayer or cuda::TrainingLayer) checked Func by Func
// against the float64 reference.
#pragma once

#include <random>
#include <string>

#include "dsl/training.h"
#include "layer_compare.h"
#include "schedules/presets.h"

namespace moeforge::testing {

// A preset by name, with "+padded" (padded_elementwise), "+lean" (the lean
// memory mode: recompute_elementwise and gate_gradient_from_dh, which keep
// the pre-activations, the layer input and the routing tables only) and
// "+chain" (chain_summed_gemms: SwiGLU's input gradient as one GEMM) and
// "+atomic" (atomic_combine: the combine added up in o's GEMM epilogue),
// "+gather" (gather_in_gemms), "+split" (split_pointwise_for_memory) and
// "+over" (gradients_over_saved: on caller memory the activation gradients
// take the saved pre-activations' bytes), "+upstream"
// (gather_upstream_in_gemms: dy's rows gathered in the GEMMs, x's copied) and
// "+boundary" (bf16_boundary: y, dy and dx in bf16).
inline Schedule training_preset(const std::string &name, bool recompute) {
  auto has = [&](const char *part) { return name.find(part) != std::string::npos; };
  Schedule s = preset(name.substr(0, name.find('+')));
  s.recompute(recompute);
  if (has("+padded"))
    s.padded_elementwise(true);
  if (has("+lean"))
    s.recompute_elementwise(true).gate_gradient_from_dh(true);
  if (has("+chain"))
    s.chain_summed_gemms(true);
  if (has("+atomic"))
    s.atomic_combine(true);
  if (has("+gather"))
    s.gather_in_gemms(true);
  if (has("+split"))
    s.split_pointwise_for_memory(true);
  if (has("+over"))
    s.gradients_over_saved(true);
  if (has("+upstream"))
    s.gather_upstream_in_gemms(true);
  if (has("+boundary"))
    s.bf16_boundary(true);
  return s;
}

// The example as the reference sees a training step: its training algebra,
// with the upstream gradient as one more input.
inline Example training_example(const Example &ex) {
  Example t = ex;
  t.pipeline = training_algebra(ex.pipeline, ex.pipeline.func(ex.output)).pipeline;
  return t;
}

// U(-1, 1), shaped like the output: (tokens, d), the token count read off
// the first buffer over the output's token dim (x in an MoE layer, q in
// attention); bf16-exact, so a schedule that stores dy in bf16
// (bf16_boundary) reads what the reference and an f32 dy read.
inline HostTensor upstream_gradient(const Example &ex, const TensorMap &inputs, uint64_t seed) {
  const auto &args = ex.pipeline.func(ex.output).args();
  const Dim tokens = args[0].dim();
  int64_t rows = -1;
  for (const BufferPtr &b : ex.pipeline.buffers())
    if (rows < 0 && !b->dims.empty() && b->dims[0].same_as(tokens) && inputs.count(b->name))
      rows = inputs.at(b->name).shape[0];
  REQUIRE_MESSAGE(rows >= 0, "no input over the output's first dim " << tokens.name());
  HostTensor g({rows, args[1].dim().extent()});
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  for (double &v : g.data)
    v = round_to_bf16(u(rng));
  return g;
}

// One step of `layer` (built from `program`) on `inputs` with upstream
// gradient `dy`, poisoned first; `step(layer)` runs forward and backward.
// Every output, gradient and kept intermediate within 2e-2 of the float64
// reference (a Func whose exact value is ~0 against 1e-3 of the largest
// output).
template <typename Layer, typename Step>
Outcome step_and_compare(const Example &ex, TensorMap inputs, const KernelProgram &program, const std::string &seed,
                         Layer &layer, const Schedule &schedule, Step step, double tolerance = 2e-2) {
  HostTensor dy = upstream_gradient(ex, inputs, 11);
  layer.upload(inputs);
  layer.poison();
  layer.upload_upstream_gradient(dy);
  step(layer);
  inputs[seed] = dy;
  const Example t = training_example(ex);
  return compare_with_reference(t, inputs, program, layer, schedule.to_text(), tolerance,
                                /*floor_fraction=*/1e-3, schedule.capacity(), schedule.fp8_funcs(t.pipeline));
}

} // namespace moeforge::testing
