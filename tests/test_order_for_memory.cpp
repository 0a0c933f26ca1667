// lowering/order_for_memory.h: a training step's backward runs in the order
// that keeps the fewest bytes live, every step still after what it needs.
#include <doctest/doctest.h>

#include <algorithm>
#include <set>

#include "dsl/error.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/order_for_memory.h"
#include "lowering/training.h"
#include "program_order.h"
#include "program_steps.h"
#include "runtime/memory_plan.h"
#include "runtime/program_shapes.h"
#include "schedules/presets.h"

using namespace moeforge;

namespace {

// Qwen3-MoE's layer shape: where the order was seen to matter (its
// backward's T k x d temporaries are most of a layer's transient memory).
ExampleShape qwen3moe_shape() { return testing::shape(16384, 2048, 768, 128, 8); }

TrainingProgram lowered(const std::string &example, const ExampleShape &s, bool default_schedule) {
  Example ex = make_example(example, s);
  const Func out = ex.pipeline.func(ex.output);
  // The default's backward with the gated h merged into the activation
  // gradients' kernel (made after dH), the order this file's cases follow;
  // split apart it runs before dH (test_split_for_memory.cpp); dy's rows
  // copied per pair, which the cases below order.
  const Schedule sch = default_schedule ? moeforge::default_schedule(ex.pipeline, {out})
                                              .split_pointwise_for_memory(false)
                                              .gather_upstream_in_gemms(false)
                                        : preset("scattermoe");
  return lower_training(ex.pipeline, out, sch);
}

size_t backward_workspace(const TrainingProgram &t, const ExampleShape &s) {
  ProgramShapes shapes(t.program, s.tokens);
  auto bytes = [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); };
  return plan_step_memory(t.program, bytes, t.forward_steps).workspace_after;
}

} // namespace

TEST_CASE("order for memory: the weight gradient that reads the gathered upstream gradient runs as soon as it can") {
  const ExampleShape s = qwen3moe_shape();
  TrainingProgram t = lowered("swiglu_moe", s, true);
  CHECK(testing::reads_follow_writes(t.program));
  // d_y_rows (T k x d, the upstream gradient in expert rows) is read by the
  // dH GEMM and by dW2's: with dW2 right after dH it is dead before the
  // input gradient's T k x d temporaries exist.
  const size_t d_h = testing::step_index(t.program, "gemm_d_h"), d_w2 = testing::step_index(t.program, "gemm_d_w2");
  CHECK(d_w2 < testing::step_index(t.program, "gemm_d_x_s2_d_x_s"));
  CHECK(d_w2 < testing::step_index(t.program, "gather_x_rows_route"));
  CHECK(d_h < d_w2);
  const size_t ordered = backward_workspace(t, s);

  // Autodiff's order (dW2 last) keeps d_y_rows through the whole backward:
  // its workspace is larger by about that tensor, and the pass finds the
  // order back.
  TrainingProgram late = t;
  Step moved = late.program.steps[d_w2];
  late.program.steps.erase(late.program.steps.begin() + static_cast<long>(d_w2));
  late.program.steps.push_back(moved);
  CHECK(testing::reads_follow_writes(late.program));
  const size_t autodiff = backward_workspace(late, s);
  CHECK(autodiff > ordered + (size_t(400) << 20));
  std::vector<std::string> held = late.program.outputs;
  for (size_t i = 0; i < late.forward_steps; ++i)
    for (const std::string &o : step_outputs(late.program.steps[i]))
      held.push_back(o);
  const size_t peak_before = peak_live_bytes(late.program, late.forward_steps, late.program.steps.size(), held);
  order_steps_for_memory(late.program, late.forward_steps, late.program.steps.size(), held);
  CHECK(testing::reads_follow_writes(late.program));
  CHECK(peak_live_bytes(late.program, late.forward_steps, late.program.steps.size(), held) < peak_before);
  CHECK(backward_workspace(late, s) == ordered);
}

TEST_CASE("order for memory: every example's backward stays valid, and no step runs before what it needs") {
  ExampleShape s;
  s.tokens = 300;
  for (const std::string &name : example_names())
    for (bool by_default : {false, true}) {
      INFO(name << (by_default ? " default schedule" : " scattermoe"));
      TrainingProgram t;
      try {
        t = lowered(name, s, by_default);
      } catch (const UserError &) {
        continue; // an example the schedule cannot train (its own tests say why)
      }
      CHECK(testing::reads_follow_writes(t.program));
      // The pass keeps the forward and backward apart: the saved tensors
      // are the same set whatever the backward's order.
      for (const std::string &n : t.saved) {
        bool written_in_forward = false;
        for (size_t i = 0; i < t.forward_steps; ++i)
          for (const std::string &o : step_outputs(t.program.steps[i]))
            written_in_forward |= o == n;
        CHECK(written_in_forward);
      }
    }
}
