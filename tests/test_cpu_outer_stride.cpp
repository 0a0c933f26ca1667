// Params stored inside a larger tensor on the CPU backend: a training step of
// transformers' SwiGLU layout (w1 and w3 the halves of one gate_up_proj,
// tests/strided_params.h) against the float64 reference, every gradient
// included, under the default schedule, both presets and plain mma.sync (on caller memory,
// both halves and their gradients in one tensor each: tests/python's
// test_params_stored_inside_one_tensor_are_read_and_written_there).
#include <doctest/doctest.h>

#include "cpu_compare.h"
#include "lowering/default_schedule.h"
#include "strided_params.h"

using namespace moeforge;
using cpu_test::cpu_train_and_compare;

TEST_CASE("cpu outer stride: a training step of gate_up_proj's halves matches the reference") {
  for (int64_t tokens : {1, 37, 300}) {
    const ExampleShape s = testing::shape(tokens, 64, 128, 8, 2);
    const Example ex = testing::gate_up_swiglu(s);
    const Func out = ex.pipeline.func(ex.output);
    for (const Schedule &sch :
         {default_schedule(ex.pipeline, {out}), preset("scattermoe"), preset("megablocks"), Schedule("mma_sync")}) {
      INFO(tokens << " tokens, " << sch.name());
      const testing::Outcome o = cpu_train_and_compare(ex, ex.random_inputs(s, 23), tokens, sch);
      CHECK(o.routing_mismatches == 0);
      CHECK(o.worst_error <= 2e-2); // a cancellation judged by its spread reads at the bar
    }
  }
}
