// Schedule::fp8 on the CPU backend: a GEMM's operands rounded by dsl/fp8.h's
// block rule give the reference's FP8 values (EvalOptions::fp8) within bf16
// storage's error, and differ from the unrounded reference by FP8's; the
// weight gradients and the CUDA backend refuse the choice, naming it.
#include <doctest/doctest.h>

#include "backends/cpu/cpu_backend.h"
#include "cpu_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/gemm_plan.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "user_error.h"

using namespace moeforge;
using namespace moeforge::cpu_test;

TEST_SUITE("cpu") {
  TEST_CASE("cpu fp8: the forward's products round their operands as the reference does") {
    const std::unique_ptr<Backend> backend = cpu::make_backend();
    // Widths past one block and ragged (320 = 2.5 x 128, 200), and a strided
    // schedule: the megablocks preset copies x into the padded order, the
    // default gathers it in the GEMM.
    for (int64_t tokens : {1, 37, 200})
      for (const char *base : {"default", "megablocks"}) {
        CAPTURE(tokens);
        CAPTURE(base);
        const ExampleShape s = shape(tokens, 320, 200, 8, 2);
        const Example ex = make_example("swiglu_moe", s);
        Schedule schedule = std::string(base) == "default"
                                ? default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)}).only_funcs_of(ex.pipeline)
                                : preset(base);
        schedule.fp8("h", Fp8Format::e4m3).fp8("o", Fp8Format::e4m3);
        const TensorMap in = ex.random_inputs(s, 17);
        const Outcome o = run_and_compare(ex, in, tokens, schedule, 1e-2);
        CHECK(o.routing_mismatches == 0);

        // Against the reference without the rounding, the same layer is off
        // by FP8's error (2^-4 a value), several times bf16's.
        const std::unique_ptr<Layer> layer = backend->layer(ex.pipeline, schedule, tokens);
        layer->upload(in);
        layer->poison();
        layer->run();
        EvalOptions rounded;
        rounded.fp8 = schedule.fp8_funcs(ex.pipeline);
        rounded.given["route"] = layer->routed_experts("route");
        EvalOptions exact;
        exact.given = rounded.given;
        const HostTensor y = layer->download("y");
        const double to_fp8 = normalized_error(y, evaluate(ex.pipeline, in, Precision::f64, rounded)["y"]);
        const double to_exact = normalized_error(y, evaluate(ex.pipeline, in, Precision::f64, exact)["y"]);
        CHECK(to_fp8 < 1e-2);
        CHECK(to_exact > 3 * to_fp8);
      }
  }

  TEST_CASE("cpu fp8: the input gradient's products in FP8, the weight gradients refused by name") {
    const ExampleShape s = shape(37, 320, 200, 8, 2);
    const Example ex = make_example("swiglu_moe", s);
    const Func out = ex.pipeline.func(ex.output);
    const Schedule base = default_schedule(ex.pipeline, {out});
    // The forward's products and the input gradient's (dH = dy W2^T, then
    // dX over dH1 W1^T + dH3 W3^T and the router's share), against the
    // reference that rounds its own operands. The forward's output is like
    // for like. The backward is not quite: the schedule's exact rewrites
    // move where an FP8 rounding falls (the gate's gradient <dy, o> taken
    // as <h, dy W2^T>, the gate applied after dy W2^T instead of to dy), so
    // the two round different operands of equal exact value and the
    // gradients agree to FP8's error (2^-4 of a value), not bf16's.
    Schedule some = base;
    for (const char *f : {"h", "o", "d_h", "d_x"})
      some.fp8(f, Fp8Format::e4m3);
    for (int64_t tokens : {1, 37, 130}) {
      CAPTURE(tokens);
      const ExampleShape st = shape(tokens, 320, 200, 8, 2);
      const Example e = make_example("swiglu_moe", st);
      const Outcome o = cpu_train_and_compare(e, e.random_inputs(st, 23), tokens, some, 8e-2);
      CHECK(o.routing_mismatches == 0);
      CHECK(o.y_error < 1e-2);
    }
    // Every contraction: the weight gradients are among them.
    const std::string all = testing::user_error_of([&] {
      cpu::make_backend()->training_layer(ex.pipeline, {out}, Schedule(base).fp8("*", Fp8Format::e4m3), 37);
    });
    CHECK(all.find("fp8 operands of a weight gradient (a sum over each expert's pairs) are not built yet") !=
          std::string::npos);
  }

  TEST_CASE("cpu fp8: the CUDA backend's plan refuses FP8 operands, naming the Func and the choice") {
    const ExampleShape s = shape(64, 256, 256, 8, 2);
    const Example ex = make_example("swiglu_moe", s);
    Schedule schedule = default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)}).only_funcs_of(ex.pipeline);
    schedule.fp8("o", Fp8Format::e5m2);
    const KernelProgram p = lower(ex.pipeline, schedule);
    int refused = 0;
    for (const Step &st : p.steps)
      if (const auto *g = std::get_if<GemmStep>(&st)) {
        if (g->func != "o") {
          CHECK(g->plan_refusal.empty());
          continue;
        }
        ++refused;
        const std::string m = testing::user_error_of([&] { planned(*g); });
        CHECK(m.find("definition 'o': FP8 operands (fp8(\"o\", \"e5m2\")) are not built for the CUDA backend yet") !=
              std::string::npos);
      }
    CHECK(refused == 1);
  }
}
