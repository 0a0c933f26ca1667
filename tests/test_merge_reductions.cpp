// Schedule::merge_weight_gradients (lowering/merge_reductions.h): SwiGLU's
// dW1 and dW3 as one expert reduction with two B operands. What the
// program and its GEMM plan become is checked here; the values on the CPU
// backend in test_cpu_merge_reductions.cpp, the CUDA kernels in
// test_cuda_merge_reductions.cpp.
#include <doctest/doctest.h>

#include <string>

#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/choices_without_effect.h"
#include "lowering/default_schedule.h"
#include "lowering/gemm_plan.h"
#include "planned_step.h"
#include "program_order.h"

using namespace moeforge;

namespace {

const GemmStep *gemm_writing(const KernelProgram &p, const std::string &output) {
  for (const Step &s : p.steps)
    if (const auto *g = std::get_if<GemmStep>(&s); g && g->output == output)
      return g;
  return nullptr;
}

int expert_reductions(const KernelProgram &p) {
  int n = 0;
  for (const Step &s : p.steps)
    if (const auto *g = std::get_if<GemmStep>(&s))
      n += g->expert_k;
  return n;
}

} // namespace

TEST_CASE("merge weight gradients: fine64's dW1 and dW3 become one reduction of 128 + 128 columns") {
  const ExampleShape s = testing::shape(16384, 2048, 1408, 64, 8); // fine64
  Example ex = make_example("swiglu_moe", s);
  const Schedule def = default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)});
  CHECK(def.merge_weight_gradients()); // the default's, where SwiGLU has two weight gradients
  const testing::PlannedStep on = testing::planned_step(ex, s.tokens, def);
  const testing::PlannedStep off = testing::planned_step(ex, s.tokens, Schedule(def).merge_weight_gradients(false));
  CHECK(testing::reads_follow_writes(on.t.program));
  CHECK(expert_reductions(on.t.program) + 1 == expert_reductions(off.t.program));
  const GemmStep *g = gemm_writing(on.t.program, "d_w1");
  REQUIRE(g != nullptr);
  CHECK(gemm_writing(on.t.program, "d_w3") == nullptr); // a further output of d_w1's step
  REQUIRE(g->b.size() == 2);
  CHECK(g->b[0] == "d_x_s_a");
  CHECK(g->b[1] == "d_x_s_a2");
  REQUIRE(g->extra.size() == 1);
  CHECK(g->extra[0].output == "d_w3");
  CHECK(g->tiling.tile_n == 128); // each B's columns: 11 tiles for f = 1408 where each gradient took 6 of 256
  const GemmPlan &p = planned(*g);
  CHECK(p.nb == 2);
  CHECK(p.in_place());
  CHECK(p.a_tma_rows());
  CHECK(p.b_tma_rows());
  CHECK(p.k_unpadded); // x's sorted rows, zeroed past each expert's in the last k-tile
  CHECK(p.persistent());
  CHECK(p.out_tma()); // both gradients staged and stored by TMA, one after the other
  CHECK(p.shared_bytes() == planned(*gemm_writing(off.t.program, "d_w1")).shared_bytes());
  const std::string text = describe(p, *g, true);
  CHECK(text.find("2 B operands") != std::string::npos);
  CHECK(text.find("B d_x_s_a, d_x_s_a2: sorted rows (no padding) by TMA") != std::string::npos);
  CHECK(text.find("outputs d_w1, d_w3") != std::string::npos);
  // The memory each entry point takes is unchanged: both gradients and x's
  // rows are alive together either way.
  CHECK(on.plan.workspace_after == off.plan.workspace_after);
  CHECK(on.plan.workspace_before == off.plan.workspace_before);
}

TEST_CASE("merge weight gradients: where no two reductions qualify, the choice is reported without effect") {
  // GeLU's experts have one gradient per weight, each with its own A; the
  // default leaves the choice out there.
  Example ex = make_example("moe_mlp", testing::shape(256, 64, 128, 8, 2));
  const Func out = ex.pipeline.func(ex.output);
  const Schedule s = default_schedule(ex.pipeline, {out}).merge_weight_gradients(true);
  bool reported = false;
  for (const std::string &n : choices_not_taken(ex.pipeline, s, {out}))
    reported |= n.rfind("merge_weight_gradients(true)", 0) == 0;
  CHECK(reported);
  CHECK_FALSE(default_schedule(ex.pipeline, {out}).merge_weight_gradients());
  // Nor where x's rows are gathered by cp.async (gather_in_gemms): two B
  // beside a gathered A leave the consumers short of registers, so the
  // reductions stay apart and the choice is reported.
  Example sw = make_example("swiglu_moe", testing::shape(256, 64, 128, 8, 2));
  const Func sw_out = sw.pipeline.func(sw.output);
  const Schedule gathered = default_schedule(sw.pipeline, {sw_out}).gather_in_gemms(true);
  CHECK(gathered.merge_weight_gradients());
  bool gathered_reported = false;
  for (const std::string &n : choices_not_taken(sw.pipeline, gathered, {sw_out}))
    gathered_reported |= n.rfind("merge_weight_gradients(true)", 0) == 0;
  CHECK(gathered_reported);
}

TEST_CASE("merge weight gradients: a schedule file names the choice, and it survives a round trip") {
  Schedule s;
  s.merge_weight_gradients(true);
  const Schedule back = Schedule::from_text(s.to_text());
  CHECK(back.merge_weight_gradients());
  CHECK(s.to_text().find("merge_weight_gradients(true)") != std::string::npos);
}
