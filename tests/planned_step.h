// A training step lowered under a schedule, with its memory plan at a token
// count: what the tests of the backward's memory choices measure.
#pragma once

#include "examples/examples.h"
#include "lowering/training.h"
#include "runtime/memory_plan.h"
#include "runtime/program_shapes.h"

namespace moeforge::testing {

constexpr size_t kMiB = size_t(1) << 20;

struct PlannedStep {
  TrainingProgram t;
  StepMemoryPlan plan;
};

// `scratch` off: the workspace without scratch in the outputs, so that a
// memory choice's own effect shows.
inline PlannedStep planned_step(const Example &ex, int64_t tokens, const Schedule &sch,
                                OutputScratch scratch = OutputScratch::on) {
  PlannedStep l{lower_training(ex.pipeline, ex.pipeline.func(ex.output), sch), {}};
  ProgramShapes shapes(l.t.program, tokens);
  auto bytes = [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); };
  l.plan = plan_step_memory(l.t.program, bytes, l.t.forward_steps, 256, scratch);
  return l;
}

} // namespace moeforge::testing
