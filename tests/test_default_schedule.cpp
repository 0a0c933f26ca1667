// lowering/default_schedule.h: the schedule a layer runs when none is named
// is the best hand-written one (bench_moe_train's tuned_wide, lean memory
// mode) wherever that one applies: on the benchmark's SwiGLU and GeLU
// layers it compiles to the very same CUDA, forward and backward, so its
// speed is tuned_wide's by construction; on other layers it draws no "not
// applied" note.
#include <doctest/doctest.h>

#include <string>

#include "backends/cuda/runtime/training_layer.h"
#include "benchmarks/train_schedule.h"
#include "examples/biased_moe.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/choices_without_effect.h"
#include "lowering/default_schedule.h"

using namespace moeforge;

namespace {

// The generated source with the schedule's name left out (kernels are named
// by their steps, the module by its schedule).
std::string cuda_of(const Pipeline &p, const Func &out, const Schedule &s) {
  KernelProgram program = lower_training(p, out, s).program;
  program.schedule_name = "any";
  return generate_cuda(program).source;
}

// bench_moe_train's layers, smaller: many experts with a small f for
// SwiGLU, top-1 with a wide f for GeLU.
ExampleShape bench_like(bool swiglu) {
  return swiglu ? testing::shape(512, 256, 192, 16, 4) : testing::shape(512, 256, 512, 16, 1);
}

} // namespace

TEST_CASE("default schedule: the benchmark's layers compile to tuned_wide's lean kernels, forward and backward") {
  for (bool swiglu : {true, false}) {
    INFO(std::string(swiglu ? "SwiGLU" : "GeLU"));
    Example ex = biased_moe(bench_like(swiglu), swiglu, Bias::none, swiglu); // bench_moe_train's layer
    const Func out = ex.pipeline.func(ex.output);
    Schedule tuned = bench::tuned_wide(swiglu);
    tuned.recompute_elementwise(true)
        .gate_gradient_from_dh(true)
        .split_pointwise_for_memory(true)
        .gradients_over_saved(true)
        .sorted_saved(true)
        .sorted_gathers(true)
        .gather_upstream_in_gemms(true)
        .bf16_boundary(true); // bench_moe_train's lean mode
    const Schedule def = default_schedule(ex.pipeline, {out});
    CHECK(cuda_of(ex.pipeline, out, def) == cuda_of(ex.pipeline, out, tuned));
    CHECK(choices_not_taken(ex.pipeline, def, {out}) == std::vector<std::string>{});
  }
}

TEST_CASE("default schedule: the examples train under it with no choice left unapplied") {
  const ExampleShape s = testing::shape(64, 64, 128, 8, 2);
  for (const char *name :
       {"moe_mlp", "swiglu_moe", "geglu_moe", "expert_bias_moe", "shared_expert_moe", "deepseek_moe", "rmsnorm_moe"}) {
    INFO(std::string(name));
    Example ex = make_example(name, s);
    const Func out = ex.pipeline.func(ex.output);
    const Schedule def = default_schedule(ex.pipeline, {out});
    std::string notes;
    for (const std::string &n : choices_not_taken(ex.pipeline, def, {out}))
      notes += n + "\n";
    CHECK(notes == "");
    // And the forward's own default, for a layer that only runs forward.
    CHECK(choices_not_taken(ex.pipeline, default_schedule(ex.pipeline)).empty());
  }
}
