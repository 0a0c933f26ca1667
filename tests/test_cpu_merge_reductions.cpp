// Schedule::merge_weight_gradients on the CPU backend: the merged dW1 and
// dW3 reduction (two B operands, one pass over A's rows) gives the two
// reductions' step bit for bit, and the float64 reference's within
// tolerance on the MoE edge cases.
#include <doctest/doctest.h>

#include "backends/cpu/cpu_backend.h"
#include "cpu_compare.h"
#include "lowering/default_schedule.h"
#include "same_step.h"

using namespace moeforge;
using namespace moeforge::cpu_test;

TEST_SUITE("cpu") {
  TEST_CASE("cpu merge weight gradients: the merged step equals the two reductions', bit for bit") {
    const std::unique_ptr<Backend> backend = cpu::make_backend();
    for (int64_t tokens : {1, 37, 200})
      for (const ExampleShape &s : {shape(tokens, 64, 128, 8, 2), shape(tokens, 64, 192, 16, 4)}) {
        INFO("T " << s.tokens << " E " << s.experts << " k " << s.topk);
        Example ex = make_example("swiglu_moe", s);
        const Func out = ex.pipeline.func(ex.output);
        const Schedule merged = default_schedule(ex.pipeline, {out}); // the default merges them
        REQUIRE(merged.merge_weight_gradients());
        const Schedule apart = Schedule(merged).merge_weight_gradients(false);
        int reductions = 0; // d_w1's and d_w3's, one step
        for (const Step &st : lower_training(ex.pipeline, out, merged).program.steps)
          if (const auto *g = std::get_if<GemmStep>(&st); g && g->expert_k)
            reductions += static_cast<int>(g->b.size()) == 2;
        REQUIRE(reductions == 1);
        testing::check_same_step(*backend, ex, ex.random_inputs(s, 47), s.tokens, merged, apart);
      }
  }

  TEST_CASE("cpu merge weight gradients: the MoE edge cases against the float64 reference") {
    testing::check_edge_cases(64, 128, {"default"},
                              [&](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &) {
                                const Func out = ex.pipeline.func(ex.output);
                                const Schedule s = default_schedule(ex.pipeline, {out}).merge_weight_gradients(true);
                                return cpu_train_and_compare(ex, in, tokens, s);
                              });
  }
}
