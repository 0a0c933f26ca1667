// Schedule::gather_upstream_in_gemms: under padded_elementwise, the
// backward's GEMMs gather dy's rows by token (the dH GEMM's A, dW2's
// operand) instead of reading a per-pair copy of them, while x's copy for dW1
// and dW3 stays. The program and the memory plan are checked here; the
// values in test_cpu_training.cpp and on the GPU ("+upstream" presets).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/choices_without_effect.h"
#include "lowering/default_schedule.h"
#include "lowering/gemm_plan.h"
#include "lowering/training.h"
#include "planned_step.h"
#include "program_order.h"

using namespace moeforge;

namespace {

using testing::kMiB;
using Lowered = testing::PlannedStep;

Lowered lowered(const ExampleShape &s, const Schedule &sch) {
  return testing::planned_step(make_example("swiglu_moe", s), s.tokens, sch);
}

Schedule default_of(const ExampleShape &s) {
  Example ex = make_example("swiglu_moe", s);
  return default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)});
}

const GemmStep *gemm_reading(const KernelProgram &p, const std::string &tensor, size_t from) {
  for (size_t i = from; i < p.steps.size(); ++i)
    if (const auto *g = std::get_if<GemmStep>(&p.steps[i]); g && (g->a == tensor || g->b[0] == tensor))
      return g;
  return nullptr;
}

} // namespace

TEST_CASE("gather upstream: dy's rows gathered by the dH GEMM and dW2, x's copy kept, fine64's peak lower") {
  const ExampleShape s = testing::shape(16384, 2048, 1408, 64, 8); // fine64
  const Schedule def = default_of(s);
  REQUIRE(def.gather_upstream_in_gemms()); // on in the default
  const Lowered copy = lowered(s, Schedule(def).gather_upstream_in_gemms(false)), gather = lowered(s, def);
  CHECK(testing::reads_follow_writes(gather.t.program));
  CHECK(Schedule::from_text(Schedule(def).gather_upstream_in_gemms(true).to_text()).gather_upstream_in_gemms());
  // The copy: d_y_rows, made in the padded order and read by the dH GEMM.
  REQUIRE(copy.t.program.find("d_y_rows") != nullptr);
  CHECK(gather.t.program.find("d_y_rows") == nullptr);
  const GemmStep *dh = gemm_reading(gather.t.program, "d_y", gather.t.forward_steps);
  REQUIRE(dh != nullptr);
  CHECK(dh->a == "d_y");
  CHECK(dh->a_rows == RowMap::gather_token);
  // x's padded copy, which the weight gradients dW1 and dW3 read by TMA, stays.
  CHECK(gather.t.program.find("x_rows_route") != nullptr);
  // The backward's fullest step held dy's copy beside dH (544 + 374 MiB);
  // now it is the input gradient's per-pair rows and the router's share.
  CHECK(copy.plan.workspace_after > 900 * kMiB);
  CHECK(gather.plan.workspace_after < 700 * kMiB);
  CHECK(gather.plan.saved.arena_bytes == copy.plan.saved.arena_bytes);
  Example ex = make_example("swiglu_moe", s);
  const Func out = ex.pipeline.func(ex.output);
  // dW2 reads its A (the gated h) by TMA and gathers its B (dy's rows) by
  // cp.async, and keeps the default's persistent blocks and TMA stores.
  CHECK(choices_not_taken(ex.pipeline, Schedule(def).gather_upstream_in_gemms(true), {out}).empty());
  const GemmStep *dw2 = nullptr;
  for (const Step &st : gather.t.program.steps)
    if (const auto *g = std::get_if<GemmStep>(&st); g && g->output == "d_w2")
      dw2 = g;
  REQUIRE(dw2 != nullptr);
  CHECK(dw2->b[0] == "d_y");
  const GemmPlan plan = plan_gemm(gather.t.program, *dw2);
  CHECK(plan.a_tma_rows());
  CHECK(!plan.b_tma_rows());
  CHECK(plan.persistent());
  CHECK(plan.out_tma());
  CHECK(plan.not_applied.empty());
}

TEST_CASE("gather upstream: a choice without effect is named with its reason") {
  const ExampleShape s = testing::shape(256, 64, 128, 8, 2);
  Example ex = make_example("swiglu_moe", s);
  const Func out = ex.pipeline.func(ex.output);
  const Schedule def = default_schedule(ex.pipeline, {out});
  auto note = [&](const Schedule &sch) {
    for (const std::string &n : choices_not_taken(ex.pipeline, sch, {out}))
      if (n.rfind("gather_upstream_in_gemms(true)", 0) == 0)
        return n;
    return std::string();
  };
  // gather_in_gemms gathers dy's rows (and x's) already.
  CHECK(note(Schedule(def).gather_upstream_in_gemms(true).gather_in_gemms(true)).find("gather_in_gemms(true)") !=
        std::string::npos);
  // Without padded_elementwise no copy is made to begin with.
  CHECK(note(Schedule(def).gather_upstream_in_gemms(true).padded_elementwise(false)).find("padded_elementwise") !=
        std::string::npos);
  CHECK(note(Schedule(def).gather_upstream_in_gemms(true)).empty());
  CHECK(note(def).empty());
}
