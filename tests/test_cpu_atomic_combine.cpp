// Schedule::atomic_combine on the LLVM CPU backend, which walks such a
// GEMM's tiles in order and rounds each addition as the GPU's atomic adds
// do: the forward under every permutation and gate placement, dropped
// pairs and the MoE edge cases against the float64 reference, and the lean
// training step (whose backward takes the gate's gradient from h, so the
// forward's combine goes into o's GEMM).
#include <doctest/doctest.h>

#include "atomic_combine_test.h"
#include "cpu_compare.h"

using namespace moeforge;
using testing::atomic_schedule;
using namespace moeforge::cpu_test;

TEST_SUITE("cpu") {
  TEST_CASE("cpu atomic_combine: every permutation, gate placement and example matches the reference") {
    // T = 150 is a multiple of no block; k = 2 and k = 4.
    for (int64_t k : {2, 4}) {
      ExampleShape s = shape(150, 64, 192, 8, k);
      for (const char *example : {"moe_mlp", "swiglu_moe"}) {
        Example ex = make_example(example, s);
        TensorMap in = ex.random_inputs(s, 23);
        for (Permutation perm : {Permutation::blocked, Permutation::scattered})
          for (GateFusion gate : {GateFusion::combine, GateFusion::epilogue}) {
            Schedule sch = atomic_schedule(perm, gate);
            INFO(example << " k=" << k << "\n" << sch.to_text());
            Outcome o = run_and_compare(ex, in, s.tokens, sch);
            CHECK(o.routing_mismatches == 0);
            CHECK(o.y_error <= 1e-2);
          }
      }
    }
  }

  TEST_CASE("cpu atomic_combine: dropped pairs add nothing, and the MoE edge cases") {
    // Capacity 0.5: about half the pairs dropped, some tokens keep none (their
    // rows must come out zero, from the zeroing alone).
    ExampleShape s = shape(200, 64, 128, 8, 2);
    Example ex = make_example("swiglu_moe", s);
    Schedule sch = atomic_schedule(Permutation::scattered, GateFusion::epilogue);
    sch.capacity(0.5);
    Outcome o = run_and_compare(ex, ex.random_inputs(s, 5), s.tokens, sch);
    CHECK(o.routing_mismatches == 0);
    CHECK(o.y_error <= 1e-2);
    Schedule edge = atomic_schedule(Permutation::blocked, GateFusion::combine);
    testing::check_edge_cases(64, 128, {"atomic"},
                              [&](const Example &e, const TensorMap &in, int64_t tokens, const std::string &) {
                                return run_and_compare(e, in, tokens, edge);
                              });
  }

  TEST_CASE("cpu atomic_combine: the lean training step, the combine in o's epilogue") {
    testing::check_edge_cases(64, 128, {"scattermoe+padded+lean+atomic", "megablocks+lean+atomic"},
                              [](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &p) {
                                return cpu_train_and_compare(ex, in, tokens, testing::training_preset(p, false));
                              });
  }
}
