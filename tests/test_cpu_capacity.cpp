// Capacity dropping (Schedule::capacity) and expert-choice routing on the
// LLVM CPU backend: forward and training against the float64 reference under
// the same capacity, every intermediate poisoned first.
#include <doctest/doctest.h>

#include "backends/cpu/cpu_training.h"
#include "cpu_compare.h"
#include "examples/examples.h"
#include "lowering/training.h"
#include "runtime/program_shapes.h"
#include "training_compare.h"

using namespace moeforge;

TEST_CASE("capacity: the CPU backend's forward matches the reference under both permutations") {
  for (const char *name : {"moe_mlp", "swiglu_moe"})
    for (const char *p : {"megablocks", "scattermoe"})
      for (double factor : {0.5, 1.0, 1.25}) {
        ExampleShape s = testing::shape(150, 64, 128, 8, 2);
        Example ex = make_example(name, s);
        TensorMap in = ex.random_inputs(s, 3);
        Schedule schedule = preset(p);
        schedule.capacity(factor);
        cpu::CompiledCpuLayer compiled = cpu::compile_cpu_layer(ex.pipeline, schedule);
        cpu::CpuLayer layer(compiled, s.tokens);
        layer.upload(in);
        layer.poison();
        layer.run();
        EvalOptions cap;
        cap.capacity_factor = factor;
        const int64_t want = evaluate(ex.pipeline, in, Precision::f64, cap).routes.at(ex.route).dropped();
        INFO(name << " / " << p << " / capacity " << factor);
        CHECK(layer.dropped_pairs(ex.route) == want);
        CHECK(want > 0);
        testing::Outcome o =
            testing::compare_with_reference(ex, in, compiled.program, layer, schedule.to_text(), 1e-2, 0, factor);
        CHECK(o.routing_mismatches == 0);
        CHECK(o.y_error <= 1e-2);
      }
}

TEST_CASE("capacity: CPU training under a capacity matches the reference, every gradient") {
  for (const char *name : {"moe_mlp", "swiglu_moe"})
    for (const char *p : {"megablocks", "scattermoe+padded+lean"}) {
      ExampleShape s = testing::shape(150, 64, 128, 8, 2);
      Example ex = make_example(name, s);
      TensorMap in = ex.random_inputs(s, 5);
      Schedule schedule = testing::training_preset(p, false);
      schedule.capacity(1.0);
      INFO(name << " / " << p);
      testing::Outcome o = cpu_test::cpu_train_and_compare(ex, in, s.tokens, schedule);
      CHECK(o.routing_mismatches == 0);
      CHECK(o.worst_error <= 2e-2);
    }
}

TEST_CASE("expert_choice_moe: the CPU backend's forward and training match the reference") {
  for (const char *p : {"megablocks", "scattermoe"}) {
    ExampleShape s = testing::shape(150, 64, 128, 8, 2);
    Example ex = make_example("expert_choice_moe", s);
    TensorMap in = ex.random_inputs(s, 3);
    INFO(p);
    testing::Outcome f = cpu_test::run_and_compare(ex, in, s.tokens, preset(p));
    CHECK(f.routing_mismatches == 0);
    CHECK(f.y_error <= 1e-2);
  }
  for (const char *p : {"megablocks", "scattermoe+padded+lean"}) {
    ExampleShape s = testing::shape(150, 64, 128, 8, 2);
    Example ex = make_example("expert_choice_moe", s);
    TensorMap in = ex.random_inputs(s, 5);
    Schedule schedule = testing::training_preset(p, false);
    INFO(p);
    testing::Outcome o = cpu_test::cpu_train_and_compare(ex, in, s.tokens, schedule);
    CHECK(o.routing_mismatches == 0);
    CHECK(o.worst_error <= 2e-2);
  }
}

TEST_CASE("capacity: fewer padded rows than pairs (the bound by the kept pairs) on the CPU backend") {
  // Expert choice with cf 1 at T = 1000, E = 8: 8000 offered pairs, 125 kept
  // an expert, so the padded layout holds (1000 / 128 + 8) * 128 = 2048
  // rows; a top-2 route at capacity 0.25 keeps 1000 of 2000 pairs.
  struct Case {
    const char *example;
    int64_t tokens, topk;
    double capacity;
  };
  for (const Case &c : {Case{"expert_choice_moe", 1000, 1, 0}, Case{"moe_mlp", 1000, 2, 0.25}})
    for (const char *p : {"megablocks", "scattermoe+padded+lean"}) {
      ExampleShape s = testing::shape(c.tokens, 64, 128, 8, c.topk);
      Example ex = make_example(c.example, s);
      TensorMap in = ex.random_inputs(s, 6);
      Schedule schedule = testing::training_preset(p, false);
      if (c.capacity > 0)
        schedule.capacity(c.capacity);
      const KernelProgram program = lower_training(ex.pipeline, ex.pipeline.func(ex.output), schedule).program;
      const ProgramShapes shapes(program, s.tokens);
      const RoutingShape &rs = shapes.routing(program.routes.at(0));
      INFO(c.example << " / " << p << ": " << rs.to_string() << ", " << rs.max_padded_rows() << " padded rows");
      CHECK(rs.max_padded_rows() < rs.pairs());
      testing::Outcome o = cpu_test::cpu_train_and_compare(ex, in, s.tokens, schedule);
      CHECK(o.routing_mismatches == 0);
      CHECK(o.worst_error <= 2e-2);
    }
}
