// Schedule::atomic_input_gradient: atomic_combine's backward half alone. The
// backward's input gradient is added up from the experts' dX GEMM onto the
// router's share (no T k x d per-pair rows), while the forward's combine
// stays a kernel. The program and the memory plan are checked here; the
// values in test_cpu_training.cpp and on the GPU.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/choices_without_effect.h"
#include "lowering/default_schedule.h"
#include "lowering/training.h"
#include "planned_step.h"
#include "program_order.h"
#include "schedules/presets.h"
#include "user_error.h"

using namespace moeforge;

namespace {

using testing::kMiB;
using Lowered = testing::PlannedStep;

int atomic_gemms(const KernelProgram &p, size_t begin, size_t end) {
  int n = 0;
  for (size_t i = begin; i < end; ++i)
    if (const auto *g = std::get_if<GemmStep>(&p.steps[i]); g && g->out_add)
      ++n;
  return n;
}

std::string note_of(const Example &ex, const Schedule &sch) {
  for (const std::string &n : choices_not_taken(ex.pipeline, sch, {ex.pipeline.func(ex.output)}))
    if (n.rfind("atomic_input_gradient(true)", 0) == 0)
      return n;
  return "";
}

} // namespace

TEST_CASE("atomic input gradient: the backward adds dX up atomically, the forward's combine stays, fine64's peak "
          "lower") {
  const ExampleShape s = testing::shape(16384, 2048, 1408, 64, 8); // fine64
  Example ex = make_example("swiglu_moe", s);
  const Schedule def = default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)});
  Schedule atomic = def;
  atomic.atomic_input_gradient(true);
  CHECK(Schedule::from_text(atomic.to_text()).atomic_input_gradient());
  const Lowered plain = testing::planned_step(ex, s.tokens, def), added = testing::planned_step(ex, s.tokens, atomic),
                least = testing::planned_step(ex, s.tokens,
                                              Schedule(atomic).gather_upstream_in_gemms(false).gather_in_gemms(true));
  for (const Lowered *l : {&added, &least}) {
    const KernelProgram &p = l->t.program;
    CHECK(testing::reads_follow_writes(p));
    // The forward as the default's: no atomic combine there.
    CHECK(l->t.forward_steps == plain.t.forward_steps);
    CHECK(atomic_gemms(p, 0, l->t.forward_steps) == 0);
    // The backward: one expert GEMM adds onto the router's share of d_x,
    // and the per-pair rows it summed are gone.
    CHECK(atomic_gemms(p, l->t.forward_steps, p.steps.size()) == 1);
    CHECK(p.find("d_x_s2") == nullptr);
    CHECK(p.tensor("d_x").dtype == DType::f32); // atomic adds sum in f32, whatever bf16_boundary says
    CHECK(p.tensor("y").dtype == DType::bf16);  // the forward's output keeps the boundary's bf16
  }
  REQUIRE(plain.t.program.find("d_x_s2") != nullptr);
  // fine64's backward peaks at the per-pair rows (512 MiB in pair order,
  // beside the router's gradients; x's copy for the weight gradients is as
  // large, grouped by expert without padding: sorted_gathers); then x's
  // copy is the largest, and with x gathered in the GEMMs too, the
  // activation's gradient (374).
  CHECK(plain.plan.workspace_after > 512 * kMiB);
  CHECK(added.plan.workspace_after < 560 * kMiB);
  CHECK(least.plan.workspace_after < 380 * kMiB);
  CHECK(added.plan.workspace_before == plain.plan.workspace_before);
  CHECK(added.plan.saved.arena_bytes == plain.plan.saved.arena_bytes);
  CHECK(note_of(ex, atomic).empty());
}

TEST_CASE("atomic input gradient: a choice without effect is named with its reason; refused with expert_parallel") {
  const ExampleShape s = testing::shape(256, 64, 128, 8, 2);
  Example ex = make_example("swiglu_moe", s);
  const Schedule def = default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)});
  CHECK(note_of(ex, Schedule(def).atomic_input_gradient(true).atomic_combine(true)) ==
        "atomic_input_gradient(true) is not applied: it changes nothing in this layer's program: atomic_combine(true) "
        "adds the input gradient up atomically already");
  // Top-1: each token's one row is its input gradient's expert share.
  Example top1 = make_example("moe_mlp", testing::shape(256, 64, 128, 8, 1));
  const Schedule def1 = default_schedule(top1.pipeline, {top1.pipeline.func(top1.output)});
  CHECK(note_of(top1, Schedule(def1).atomic_input_gradient(true)).find("over k > 1 pairs") != std::string::npos);
  // A schedule of the layer-wide choices alone (the default's per-Func
  // ones name the backward's Funcs, which the forward's validate does not know).
  Schedule layer_wide = preset("scattermoe");
  layer_wide.atomic_input_gradient(true).validate(ex.pipeline);
  CHECK_THROWS_WITH_AS(Schedule(layer_wide).expert_parallel(2).validate(ex.pipeline),
                       doctest::Contains("atomic_input_gradient(true) with expert_parallel(2): the input gradient's "
                                         "rows are summed on the token's GPU"),
                       UserError);
}
