// What a training backward holds at once in its workspace (runtime/memory_plan.h's
// plan_step_memory over lowering's program) under the backward's memory
// choices: atomic_combine (the input gradient added onto the router's
// share, no per-pair rows of width d) and gather_in_gemms (dy's and x's rows
// gathered by the GEMMs, no padded copies), beside the in-place activation
// gradient every schedule gets.
#include <doctest/doctest.h>

#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/training.h"
#include "runtime/memory_plan.h"
#include "runtime/program_shapes.h"

using namespace moeforge;

namespace {

struct Planned {
  TrainingProgram t;
  StepMemoryPlan plan;
};

Planned planned(const ExampleShape &s, bool memory_choices) {
  Example ex = make_example("swiglu_moe", s);
  const Func out = ex.pipeline.func(ex.output);
  Schedule sch = default_schedule(ex.pipeline, {out});
  // Without them, dy's rows copied per pair (gather_upstream_in_gemms, on in
  // the default, gathers them too: test_gather_upstream.cpp).
  sch.atomic_combine(memory_choices).gather_in_gemms(memory_choices).gather_upstream_in_gemms(false);
  Planned p{lower_training(ex.pipeline, out, sch), {}};
  ProgramShapes shapes(p.t.program, s.tokens);
  auto bytes = [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); };
  // Without scratch in the outputs, so that the choices' own effect shows.
  p.plan = plan_step_memory(p.t.program, bytes, p.t.forward_steps, 256, OutputScratch::off);
  return p;
}

} // namespace

TEST_CASE("backward workspace: with both memory choices qwen3moe's holds no T k x d tensor, 3 T k x f at its peak") {
  const ExampleShape s = testing::shape(16384, 2048, 768, 128, 8); // qwen3moe
  const Planned lean = planned(s, true), plain = planned(s, false);
  const size_t rows = 16384 * 8 + 128 * 127; // T k pairs and the padding of 128 experts' blocks
  const size_t tk_f = rows * 768 * 2, t_d = size_t(16384) * 2048;
  // The peak: dA (over dy W2^T's bytes), dA2 and the gated h that dW2 reads,
  // and dy in bf16 (the example's dy is f32; a GEMM reads bf16).
  CHECK(lean.plan.workspace_after <= 3 * tk_f + 2 * t_d + (size_t(8) << 20));
  for (const auto &[name, size] : lean.plan.workspace.size) {
    INFO(name);
    CHECK(size < size_t(16384) * 8 * 2048 * 2); // under one T k x d bf16 tensor
  }
  // Without them: dy's per-pair copy beside those, and the input gradient's
  // per-pair rows later; more than one T k x d tensor more.
  CHECK(plain.plan.workspace_after >= lean.plan.workspace_after + size_t(16384) * 8 * 2048 * 2);
  // The forward's workspace: h alone once the combine adds into y.
  CHECK(lean.plan.workspace_before <= tk_f + (size_t(8) << 20));
  CHECK(plain.plan.workspace_before > lean.plan.workspace_before);
  // What the forward keeps: the same tensors, padded with x gathered by the
  // weight gradients' GEMMs (sorted_saved needs x's padded copy there).
  CHECK(lean.plan.saved.arena_bytes >= plain.plan.saved.arena_bytes);
  CHECK(lean.plan.saved.arena_bytes <= plain.plan.saved.arena_bytes + 2 * 128 * 127 * 768 * 2 + (size_t(1) << 20));
}
