// Schedule::sorted_saved on the CPU backend: the saved pre-activations and
// the gradients over them stored grouped by expert without padding give the
// padded layout's step bit for bit, and the float64 reference's within
// tolerance, edge cases (empty and busy experts, ragged tails) included.
#include <doctest/doctest.h>

#include "backends/cpu/cpu_backend.h"
#include "cpu_compare.h"
#include "lowering/default_schedule.h"
#include "same_step.h"

using namespace moeforge;
using namespace moeforge::cpu_test;

TEST_SUITE("cpu") {
  TEST_CASE("cpu sorted saved: the default's step equals the padded layout's, bit for bit, at odd token counts") {
    const std::unique_ptr<Backend> backend = cpu::make_backend();
    for (int64_t tokens : {1, 37, 200})
      for (const ExampleShape &s : {shape(tokens, 64, 128, 8, 2), shape(tokens, 64, 96, 16, 4)}) {
        INFO("T " << s.tokens << " E " << s.experts << " k " << s.topk);
        Example ex = make_example("swiglu_moe", s);
        const Func out = ex.pipeline.func(ex.output);
        const Schedule sorted = default_schedule(ex.pipeline, {out}).sorted_gathers(false);
        REQUIRE(sorted.sorted_saved());
        const TrainingProgram t = lower_training(ex.pipeline, out, sorted);
        REQUIRE(t.program.tensor("d_x_s_a").layout == RowLayout::sorted);
        testing::check_same_step(*backend, ex, ex.random_inputs(s, 41), s.tokens, sorted,
                                 Schedule(sorted).sorted_saved(false));
      }
  }

  TEST_CASE("cpu sorted saved: the MoE edge cases against the float64 reference") {
    // The layer's own default, where the pass applies (bf16 activations,
    // the gradients over the saved pre-activations, dW by TMA).
    int sorted_cases = 0; // the SwiGLU cases store their pre-activations sorted
    testing::check_edge_cases(64, 128, {"default"},
                              [&](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &) {
                                const Func out = ex.pipeline.func(ex.output);
                                const Schedule s = default_schedule(ex.pipeline, {out}).sorted_gathers(false);
                                for (const TensorDecl &t : lower_training(ex.pipeline, out, s).program.tensors)
                                  if (t.layout == RowLayout::sorted) {
                                    ++sorted_cases;
                                    break;
                                  }
                                return cpu_train_and_compare(ex, in, tokens, s);
                              });
    CHECK(sorted_cases >= 4);
  }

  TEST_CASE("cpu sorted gathers: x's rows without padding give the padded copy's step, bit for bit") {
    const std::unique_ptr<Backend> backend = cpu::make_backend();
    for (int64_t tokens : {1, 37, 200})
      for (const ExampleShape &s : {shape(tokens, 64, 128, 8, 2), shape(tokens, 64, 96, 16, 4)}) {
        INFO("T " << s.tokens << " E " << s.experts << " k " << s.topk);
        Example ex = make_example("swiglu_moe", s);
        const Func out = ex.pipeline.func(ex.output);
        const Schedule base = default_schedule(ex.pipeline, {out});
        const Schedule sorted = Schedule(base).sorted_gathers(true);
        const TrainingProgram t = lower_training(ex.pipeline, out, sorted);
        int copies = 0;
        for (const Step &st : t.program.steps)
          if (const auto *g = std::get_if<GatherStep>(&st))
            copies += t.program.tensor(g->dst).layout == RowLayout::sorted;
        REQUIRE(copies == 1);
        testing::check_same_step(*backend, ex, ex.random_inputs(s, 43), s.tokens, sorted,
                                 Schedule(base).sorted_gathers(false));
      }
  }

  TEST_CASE("cpu sorted gathers: the MoE edge cases against the float64 reference") {
    testing::check_edge_cases(64, 128, {"default"},
                              [&](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &) {
                                const Func out = ex.pipeline.func(ex.output);
                                const Schedule s = default_schedule(ex.pipeline, {out}).sorted_gathers(true);
                                return cpu_train_and_compare(ex, in, tokens, s);
                              });
  }
}
