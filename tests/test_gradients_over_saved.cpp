// Schedule::gradients_over_saved: the backward writes an activation's
// gradient over the saved activation it is made from, where the kernel that
// makes it reads that tensor last. What the program and the memory plan
// become is checked here; the values on caller memory (where the bytes are
// shared) in test_cuda_caller_memory.cpp and tests/python/test_torch.py, and
// the refusal of a second backward there too.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <string>

#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/in_place.h"
#include "lowering/training.h"
#include "planned_step.h"
#include "program_order.h"
#include "runtime/memory_report.h"

using namespace moeforge;

namespace {

using Lowered = testing::PlannedStep;

Lowered lowered(const std::string &example, const ExampleShape &s, bool over_saved) {
  Example ex = make_example(example, s);
  Schedule sch = default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)});
  REQUIRE(sch.gradients_over_saved()); // on in the default
  // Without scratch in the outputs, so that the choice's own effect shows.
  return testing::planned_step(ex, s.tokens, sch.gradients_over_saved(over_saved), OutputScratch::off);
}

constexpr size_t kMiB = size_t(1) << 20;

} // namespace

TEST_CASE("gradients over saved: mixtral's dH1 and dH3 take the two saved pre-activations' bytes") {
  const ExampleShape s = testing::shape(8192, 4096, 14336, 8, 2); // mixtral
  const Lowered on = lowered("swiglu_moe", s, true), off = lowered("swiglu_moe", s, false);
  CHECK(testing::reads_follow_writes(on.t.program));
  const std::map<std::string, std::string> want{{"d_x_s_a", "h_rhs"}, {"d_x_s_a2", "h_silu_in"}};
  CHECK(on.t.written_over_saved == want);
  CHECK(off.t.written_over_saved.empty());
  // The words every runtime refuses a second backward with.
  const std::string why = on.t.one_backward_reason();
  CHECK(why.find("d_x_s_a over h_rhs, d_x_s_a2 over h_silu_in") != std::string::npos);
  CHECK(why.find("run the forward again") != std::string::npos);
  CHECK(why.find("gradients_over_saved(false)") != std::string::npos);
  CHECK(off.t.one_backward_reason().empty());
  // The saved pre-activations are stored as their gradients are, grouped by
  // expert (sorted_saved, on in the default: test_sorted_saved.cpp); off,
  // they are saved in pair order (test_pair_order.cpp). Both are T k rows.
  for (const char *name : {"h_rhs", "h_silu_in"}) {
    INFO(name);
    CHECK(on.t.program.tensor(name).layout == RowLayout::sorted);
    CHECK(off.t.program.tensor(name).layout == RowLayout::pair);
  }
  // In the plan, each gradient sits at its saved tensor's offset in the
  // saved region, and nowhere in the workspace.
  for (const auto &[out, in] : want) {
    INFO(out);
    CHECK(on.plan.saved.offset.at(out) == on.plan.saved.offset.at(in));
    CHECK(on.plan.saved.written_over.at(out) == in);
    CHECK_FALSE(on.plan.workspace.offset.count(out));
    CHECK(off.plan.workspace.offset.count(out));
  }
  // The saved region stays 896 MiB (952 with the padded order that
  // sorted_saved(false) leaves); the backward's workspace loses both T k x f
  // gradients (1224 -> 612 MiB). What a layer holds at its backward falls
  // ~610 MiB.
  CHECK(on.plan.saved.arena_bytes < off.plan.saved.arena_bytes + kMiB);
  CHECK(off.plan.workspace_after > 1200 * kMiB);
  CHECK(on.plan.workspace_after < 620 * kMiB);
  CHECK(on.plan.saved.arena_bytes + on.plan.workspace_after + 500 * kMiB <
        off.plan.saved.arena_bytes + off.plan.workspace_after);
  // The forward is the same but for where its GEMM stores the pre-activations.
  CHECK(on.t.forward_steps == off.t.forward_steps);
}

TEST_CASE("gradients over saved: what a layer holds at its backward falls at every bench shape, SwiGLU or GeLU") {
  for (const char *example : {"moe_mlp", "swiglu_moe"})
    for (const ExampleShape &s : {testing::shape(16384, 2048, 1408, 64, 8), testing::shape(16384, 2048, 768, 128, 8),
                                  testing::shape(8192, 2880, 2880, 128, 4), testing::shape(16384, 1024, 4096, 64, 1)}) {
      INFO(std::string(example) << " T " << s.tokens << " f " << s.f << " E " << s.experts);
      const Lowered on = lowered(example, s, true), off = lowered(example, s, false);
      CHECK(testing::reads_follow_writes(on.t.program));
      // One T k x f gradient over each pre-activation: GeLU has one, SwiGLU two.
      CHECK(on.t.written_over_saved.size() == (std::string(example) == "swiglu_moe" ? 2u : 1u));
      for (const auto &[out, in] : on.t.written_over_saved) {
        INFO(out << " over " << in);
        CHECK(std::count(on.t.saved.begin(), on.t.saved.end(), in) == 1);
        CHECK(on.plan.saved.offset.at(out) == on.plan.saved.offset.at(in));
      }
      const size_t pre = size_t(s.tokens) * size_t(s.topk) * size_t(s.f) * 2; // one T k x f bf16 tensor
      CHECK(on.plan.workspace_after <= off.plan.workspace_after);
      // By a third of one T k x f tensor at least: where the gradients' step
      // stops being the fullest, the next one (the gated h beside dy's rows)
      // sets the peak (gptoss SwiGLU: 1174 -> 1084 MiB; mixtral 2120 -> 1564).
      CHECK(on.plan.saved.arena_bytes + on.plan.workspace_after + pre / 3 <=
            off.plan.saved.arena_bytes + off.plan.workspace_after);
    }
}

TEST_CASE("gradients over saved: a saved tensor a later step reads again is not written over") {
  // Lowered without recompute_elementwise, the forward saves h as well and
  // dW2 reads it after the activation gradients exist; the pre-activations
  // are still read last by the gradients' kernel and are taken.
  const ExampleShape s = testing::shape(256, 64, 128, 8, 2);
  Example ex = make_example("swiglu_moe", s);
  const Func out = ex.pipeline.func(ex.output);
  for (bool lean : {true, false}) {
    INFO("lean " << lean);
    Schedule sch = default_schedule(ex.pipeline, {out});
    sch.recompute_elementwise(lean).gate_gradient_from_dh(lean);
    const TrainingProgram t = lower_training(ex.pipeline, out, sch);
    for (const auto &[o, in] : t.written_over_saved) {
      INFO(o << " over " << in);
      // The input's last reader is the step writing over it.
      size_t writer = 0, last_reader = 0;
      for (size_t i = 0; i < t.program.steps.size(); ++i) {
        for (const std::string &r : step_reads(t.program.steps[i]))
          if (r == in)
            last_reader = i;
        for (const std::string &w : step_outputs(t.program.steps[i]))
          if (w == o)
            writer = i;
      }
      CHECK(writer == last_reader);
      CHECK(writer >= t.forward_steps);
    }
    CHECK_FALSE(t.written_over_saved.empty());
  }
}

TEST_CASE("gradients over saved: the schedule text round-trips, and emit --memory names the gradients") {
  Schedule s("x");
  s.gradients_over_saved(true);
  CHECK(s.to_text().find("gradients_over_saved(true)") != std::string::npos);
  CHECK(Schedule::from_text(s.to_text()).gradients_over_saved());
  CHECK_FALSE(Schedule::from_text(Schedule(s).gradients_over_saved(false).to_text()).gradients_over_saved());
  const ExampleShape shape = testing::shape(256, 64, 128, 8, 2);
  const Lowered on = lowered("swiglu_moe", shape, true);
  const std::string report = memory_report(on.t.program, on.t.forward_steps, shape.tokens);
  CHECK(report.find("h_rhs") != std::string::npos);
  CHECK(report.find(", then d_x_s_a\n") != std::string::npos);
  CHECK(report.find(", then d_x_s_a2\n") != std::string::npos);
}
