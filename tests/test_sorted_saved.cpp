// Schedule::sorted_saved (lowering/sorted_rows.h): the saved pre-activations
// that the backward writes its gradients over, and those gradients, stored
// grouped by expert without the padding. What the program, its GEMM plans
// and the saved region become is checked here; the values on the CPU
// backend in test_cpu_sorted_saved.cpp and on the GPU in
// test_cuda_sorted_saved.cpp.
#include <doctest/doctest.h>

#include <string>

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

using Lowered = testing::PlannedStep;

Lowered lowered(const std::string &example, const ExampleShape &s, bool sorted) {
  Example ex = make_example(example, s);
  Schedule sch = default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)});
  // On in the default where it applies: not for GeLU, whose pre-activation
  // leaves with h by TMA.
  CHECK(sch.sorted_saved() == (example == "swiglu_moe"));
  // dW1 and dW3 apart, each its own step to look at (the merged one's
  // sorted operands: test_merge_reductions.cpp).
  return testing::planned_step(ex, s.tokens, sch.sorted_saved(sorted).merge_weight_gradients(false));
}

const GemmStep &gemm_writing(const KernelProgram &p, const std::string &output) {
  for (const Step &s : p.steps)
    if (const auto *g = std::get_if<GemmStep>(&s); g && g->output == output)
      return *g;
  FAIL("no GEMM writes " << output);
  throw std::logic_error("unreachable");
}

constexpr size_t kMiB = size_t(1) << 20;

} // namespace

TEST_CASE("sorted saved: fine64's pre-activations and the gradients over them lose the padding") {
  const ExampleShape s = testing::shape(16384, 2048, 1408, 64, 8); // fine64
  const Lowered on = lowered("swiglu_moe", s, true), off = lowered("swiglu_moe", s, false);
  CHECK(testing::reads_follow_writes(on.t.program));
  CHECK(on.t.written_over_saved == off.t.written_over_saved);
  for (const char *name : {"h_silu_in", "h_rhs", "d_x_s_a", "d_x_s_a2"}) {
    INFO(name);
    CHECK(on.t.program.tensor(name).layout == RowLayout::sorted);
    CHECK_FALSE(on.t.program.tensor(name).zero_padding);
    CHECK(off.t.program.tensor(name).layout == RowLayout::padded);
  }
  // h, which the down projection reads, keeps its padded rows; so does the
  // gated h, dW2's A by TMA, written in the same kernel as the gradients.
  CHECK(on.t.program.tensor("h").layout == RowLayout::padded);
  CHECK(on.t.program.tensor("h_gated").layout == RowLayout::padded);
  // The GEMMs read them by TMA from the tile's sorted row: dW1's and dW3's B,
  // the input gradient's A and A2; gemm_h stores them row by row.
  for (const char *w : {"d_w1", "d_w3"}) {
    INFO(w);
    const GemmStep &g = gemm_writing(on.t.program, w);
    CHECK(on.t.program.tensor(g.b[0]).layout == RowLayout::sorted);
    CHECK(planned(g).b_tma_rows());
  }
  const GemmStep &dx = gemm_writing(on.t.program, "d_x_s2");
  REQUIRE(dx.chained);
  CHECK(planned(dx).a_tma());
  CHECK(on.t.program.tensor(dx.a).layout == RowLayout::sorted);
  CHECK(on.t.program.tensor(dx.chained->a).layout == RowLayout::sorted);
  const GemmStep &h = gemm_writing(on.t.program, "h_silu_in");
  CHECK_FALSE(planned(h).tiling.tma_store);
  // The saved region holds T k x f twice and the probabilities: 708 MiB
  // where the padded rows took 752.
  const size_t pre = size_t(16384) * 8 * 1408 * 2;
  CHECK(on.plan.saved.arena_bytes >= 2 * pre);
  CHECK(on.plan.saved.arena_bytes < 2 * pre + 8 * kMiB);
  CHECK(off.plan.saved.arena_bytes >= on.plan.saved.arena_bytes + 40 * kMiB);
  // Each gradient still sits on its saved tensor's bytes; the backward's
  // workspace is no larger.
  for (const auto &[out, in] : on.t.written_over_saved)
    CHECK(on.plan.saved.offset.at(out) == on.plan.saved.offset.at(in));
  CHECK(on.plan.workspace_after <= off.plan.workspace_after);
}

TEST_CASE("sorted saved: at every bench shape the saved region is T k rows, SwiGLU or GeLU") {
  for (const char *example : {"moe_mlp", "swiglu_moe"})
    for (const ExampleShape &s : {testing::shape(16384, 2048, 1408, 64, 8), testing::shape(16384, 2048, 768, 128, 8),
                                  testing::shape(8192, 2880, 2880, 128, 4), testing::shape(8192, 4096, 14336, 8, 2)}) {
      INFO(example << " T " << s.tokens << " f " << s.f << " E " << s.experts);
      const Lowered on = lowered(example, s, true), off = lowered(example, s, false);
      CHECK(testing::reads_follow_writes(on.t.program));
      CHECK(on.plan.saved.arena_bytes <= off.plan.saved.arena_bytes);
      CHECK(on.plan.workspace_after <= off.plan.workspace_after);
      // SwiGLU's pre-activations leave the padding; GeLU's pre-activation is
      // stored with h by TMA (a tile's box), so it keeps its padded rows.
      const bool swiglu = std::string(example) == "swiglu_moe";
      for (const auto &[out, in] : on.t.written_over_saved) {
        INFO(out << " over " << in);
        CHECK((on.t.program.tensor(in).layout == RowLayout::sorted) == swiglu);
        CHECK(on.t.program.tensor(out).layout == on.t.program.tensor(in).layout);
      }
      if (swiglu) // E (block - 1) rows of f at least, twice (gpt-oss: 180 MiB)
        CHECK(off.plan.saved.arena_bytes - on.plan.saved.arena_bytes >= size_t(s.experts) * 64 * s.f * 2 * 2);
    }
}

TEST_CASE("sorted saved: without gradients over saved the choice does nothing, and says so") {
  // The pre-activations are then saved in pair order already.
  const ExampleShape s = testing::shape(200, 64, 128, 8, 2);
  Example ex = make_example("swiglu_moe", s);
  const Func out = ex.pipeline.func(ex.output);
  Schedule sch = default_schedule(ex.pipeline, {out});
  sch.gradients_over_saved(false);
  const TrainingProgram t = lower_training(ex.pipeline, out, sch);
  CHECK(t.program.tensor("h_silu_in").layout == RowLayout::pair);
  bool noted = false;
  for (const std::string &n : choices_not_taken(ex.pipeline, sch, {out}))
    noted |= n.rfind("sorted_saved(true) is not applied", 0) == 0;
  CHECK(noted);
}

TEST_CASE("sorted saved: the schedule text round-trips") {
  Schedule s("x");
  s.sorted_saved(true);
  CHECK(s.to_text().find("sorted_saved(true)") != std::string::npos);
  CHECK(Schedule::from_text(s.to_text()).sorted_saved());
  CHECK_FALSE(Schedule::from_text(Schedule(s).sorted_saved(false).to_text()).sorted_saved());
}

TEST_CASE("sorted gathers: x's rows for dW1 and dW3 lose the padding, and the backward's workspace with them") {
  // fine64 and qwen3moe: the copy is the backward's fullest tensor.
  for (const ExampleShape &s : {testing::shape(16384, 2048, 1408, 64, 8), testing::shape(16384, 2048, 768, 128, 8)}) {
    INFO("f " << s.f << " E " << s.experts);
    Example ex = make_example("swiglu_moe", s);
    // dW1 and dW3 apart (merged, they are one step with these operands).
    const Schedule base = default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)}).merge_weight_gradients(false);
    const Lowered on = testing::planned_step(ex, s.tokens, Schedule(base).sorted_gathers(true));
    const Lowered off = testing::planned_step(ex, s.tokens, Schedule(base).sorted_gathers(false));
    CHECK(testing::reads_follow_writes(on.t.program));
    const GemmStep &w1 = gemm_writing(on.t.program, "d_w1"), &w3 = gemm_writing(on.t.program, "d_w3");
    REQUIRE(w1.a == w3.a);
    const TensorDecl &rows = on.t.program.tensor(w1.a);
    CHECK(rows.layout == RowLayout::sorted);
    CHECK_FALSE(rows.zero_padding);
    CHECK(off.t.program.tensor(w1.a).layout == RowLayout::padded);
    for (const GemmStep *g : {&w1, &w3}) {
      INFO(g->name);
      CHECK(planned(*g).k_unpadded);
      CHECK(planned(*g).a_tma_rows());
      CHECK(planned(*g).b_tma_rows());
      CHECK(planned(gemm_writing(off.t.program, g->output)).k_unpadded == false);
    }
    // The copy is T k rows of d: the workspace is the larger of it and the
    // input gradient's per-pair rows, both T k x d bf16.
    const size_t rows_bytes = size_t(s.tokens) * s.topk * s.d * 2;
    CHECK(on.plan.workspace_after >= rows_bytes);
    CHECK(on.plan.workspace_after < rows_bytes + 8 * kMiB); // beside it the router's gradients (fine64: 6 MiB)
    CHECK(off.plan.workspace_after >= on.plan.workspace_after + size_t(s.experts) * 32 * s.d * 2);
    // Nothing else moves: the forward and the saved region are the same.
    CHECK(on.plan.saved.arena_bytes == off.plan.saved.arena_bytes);
    CHECK(on.plan.workspace_before == off.plan.workspace_before);
  }
}

TEST_CASE("sorted gathers: without sorted B operands the choice does nothing, and says so") {
  const ExampleShape s = testing::shape(200, 64, 128, 8, 2);
  Example ex = make_example("swiglu_moe", s);
  const Func out = ex.pipeline.func(ex.output);
  Schedule sch = default_schedule(ex.pipeline, {out});
  sch.sorted_saved(false).sorted_gathers(true);
  const TrainingProgram t = lower_training(ex.pipeline, out, sch);
  for (const TensorDecl &d : t.program.tensors)
    CHECK(d.layout != RowLayout::sorted);
  bool noted = false;
  for (const std::string &n : choices_not_taken(ex.pipeline, sch, {out}))
    noted |= n.rfind("sorted_gathers(true) is not applied", 0) == 0;
  CHECK(noted);
}

TEST_CASE("sorted gathers: the schedule text round-trips") {
  Schedule s("x");
  s.sorted_gathers(true);
  CHECK(s.to_text().find("sorted_gathers(true)") != std::string::npos);
  CHECK(Schedule::from_text(s.to_text()).sorted_gathers());
  CHECK_FALSE(Schedule::from_text(Schedule(s).sorted_gathers(false).to_text()).sorted_gathers());
}
