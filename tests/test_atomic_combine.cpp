// Schedule::atomic_combine: the combine's sum over a token's k > 1 pairs
// taken in the epilogue of the GEMM that makes the pairs' rows, added into
// the zeroed output. What lowering makes of it, where it declines, and the
// primitive's text and checks (the backends: test_cpu_atomic_combine.cpp,
// test_cuda_atomic_combine.cpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "atomic_combine_test.h"
#include "dsl/error.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/gemm_plan.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "schedules/presets.h"

using namespace moeforge;
using testing::atomic_schedule;
using testing::gemm_writing;
using testing::shape;

namespace {

bool has_step_writing(const KernelProgram &p, const std::string &name) {
  for (const Step &s : p.steps)
    for (const std::string &o : step_outputs(s))
      if (o == name)
        return true;
  return false;
}

} // namespace

TEST_CASE("atomic_combine: the combine becomes the expert GEMM's added output") {
  ExampleShape s = shape(150, 64, 192, 8, 2);
  for (const char *example : {"moe_mlp", "swiglu_moe"})
    for (Permutation perm : {Permutation::blocked, Permutation::scattered})
      for (GateFusion gate : {GateFusion::combine, GateFusion::epilogue}) {
        Example ex = make_example(example, s);
        Schedule sch = atomic_schedule(perm, gate);
        INFO(example << "\n" << sch.to_text());
        KernelProgram p = lower(ex.pipeline, sch);
        const GemmStep *g = gemm_writing(p, "y");
        REQUIRE(g != nullptr);
        CHECK(g->out_add);
        CHECK(g->out_rows == RowMap::gather_token);
        CHECK(g->route != nullptr);
        // o is neither stored nor read: the GEMM made it, y was its one reader.
        CHECK(p.find("o") == nullptr);
        int writers = 0;
        for (const Step &st : p.steps)
          for (const std::string &o : step_outputs(st))
            writers += o == "y";
        CHECK(writers == 1);
        std::ostringstream text;
        text << p;
        CHECK(text.str().find("added atomically into the zeroed output") != std::string::npos);
        CHECK(p.not_applied.empty());

        // Without the flag the combine stays a step of its own.
        KernelProgram plain = lower(ex.pipeline, Schedule(sch).atomic_combine(false));
        CHECK(gemm_writing(plain, "y") == nullptr);
        CHECK(has_step_writing(plain, "y"));
        CHECK(plain.tensors.size() == p.tensors.size() + 1); // the expert outputs, stored
      }
}

TEST_CASE("atomic_combine: k = 1 stays a store; training takes it where the backward leaves o unread") {
  // k = 1: the combine is a plain store in the epilogue already.
  {
    ExampleShape s = shape(100, 64, 128, 8, 1);
    Example ex = make_example("moe_mlp", s);
    KernelProgram p = lower(ex.pipeline, atomic_schedule(Permutation::scattered, GateFusion::epilogue));
    const GemmStep *g = gemm_writing(p, "y");
    REQUIRE(g != nullptr);
    CHECK_FALSE(g->out_add);
    // Said, not dropped unseen: every command prints these notes first.
    const std::vector<std::string> notes = not_applied_choices(p);
    CHECK(std::find(notes.begin(), notes.end(), kAtomicCombineNotApplied) != notes.end());
    CHECK(std::string(kAtomicCombineNotApplied).find("a k = 1 combine is a store in the epilogue already") !=
          std::string::npos);
  }
  // Training where the backward reads the expert outputs o (the gate's
  // gradient <dy, o>): o must be stored, so the combine stays a step; and
  // the backward's input gradient sums two GEMMs' rows per pair (SwiGLU's
  // dH1 W1^T and dH3 W3^T, one GEMM only under chain_summed_gemms), which
  // no one epilogue makes either.
  ExampleShape s = shape(150, 64, 192, 8, 2);
  Example ex = make_example("swiglu_moe", s);
  TrainingProgram keeps = lower_training(ex.pipeline, ex.pipeline.outputs().front(),
                                         atomic_schedule(Permutation::scattered, GateFusion::epilogue));
  CHECK(gemm_writing(keeps.program, "y") == nullptr);
  CHECK(has_step_writing(keeps.program, "y"));
  CHECK(gemm_writing(keeps.program, "d_x") == nullptr);
  CHECK(keeps.program.not_applied == std::vector<std::string>{kAtomicCombineNotApplied});
  // The lean mode on the wgmma loops (gate_gradient_from_dh reads the dH
  // GEMM's W2^T in place): the backward takes the gate's gradient from h,
  // so o has no reader but the combine, which goes into o's GEMM, a step
  // of the forward.
  for (const char *p : {"megablocks", "scattermoe"}) {
    Schedule lean = preset(p);
    lean.recompute_elementwise(true).gate_gradient_from_dh(true).atomic_combine(true);
    INFO(lean.to_text());
    TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.outputs().front(), lean);
    const GemmStep *g = gemm_writing(t.program, "y");
    REQUIRE(g != nullptr);
    CHECK(g->out_add);
    size_t at = t.program.steps.size();
    for (size_t i = 0; i < t.program.steps.size(); ++i)
      if (step_name(t.program.steps[i]) == g->name)
        at = i;
    CHECK(at < t.forward_steps);
    CHECK(t.program.not_applied.empty());
  }
}

TEST_CASE("atomic_combine: the schedule text round-trips and refuses expert parallelism") {
  Schedule s = atomic_schedule(Permutation::scattered, GateFusion::epilogue);
  CHECK(s.to_text().find("atomic_combine(true)") != std::string::npos);
  CHECK(Schedule::from_text(s.to_text()).atomic_combine());
  CHECK_FALSE(Schedule::from_text(Schedule(s).atomic_combine(false).to_text()).atomic_combine());
  ExampleShape sh = shape(64, 64, 128, 8, 2);
  Example ex = make_example("moe_mlp", sh);
  s.validate(ex.pipeline);
  Schedule ep = Schedule(s).expert_parallel(2);
  CHECK_THROWS_WITH_AS(ep.validate(ex.pipeline),
                       doctest::Contains("atomic_combine(true) with expert_parallel(2): the combine runs on the "
                                         "token's GPU once its rows come back, where no GEMM epilogue makes them; "
                                         "drop one of the two"),
                       UserError);
}

TEST_CASE("atomic_combine: a training backward's input gradient adds each pair's row onto the router's share") {
  // d_x(t) = sum over t's pairs of dA(r) W^T + the router's d_logits Wr^T: the
  // router's dense GEMM writes d_x, the experts' GEMM adds onto it, and
  // neither the per-pair rows (T k x d) nor the router's share is stored.
  ExampleShape s = shape(150, 64, 192, 8, 2);
  for (const char *example : {"moe_mlp", "swiglu_moe"}) {
    INFO(example);
    Example ex = make_example(example, s);
    // SwiGLU's two products per pair are one GEMM under the default's
    // chain_summed_gemms.
    const Func out = ex.pipeline.outputs().front();
    Schedule sch = example == std::string("moe_mlp") ? preset("scattermoe") : default_schedule(ex.pipeline, {out});
    sch.atomic_combine(true);
    TrainingProgram t = lower_training(ex.pipeline, out, sch);
    std::vector<size_t> writers;
    for (size_t i = t.forward_steps; i < t.program.steps.size(); ++i)
      for (const std::string &o : step_outputs(t.program.steps[i]))
        if (o == "d_x")
          writers.push_back(i);
    REQUIRE(writers.size() == 2);
    const auto *router = std::get_if<GemmStep>(&t.program.steps[writers[0]]);
    const auto *experts = std::get_if<GemmStep>(&t.program.steps[writers[1]]);
    REQUIRE(router != nullptr);
    REQUIRE(experts != nullptr);
    CHECK(router->route == nullptr);
    CHECK_FALSE(router->out_add);
    CHECK(experts->route != nullptr);
    CHECK(experts->out_add);
    CHECK(experts->out_add_onto_written);
    CHECK(experts->out_rows == RowMap::gather_token);
    std::ostringstream text;
    text << t.program;
    CHECK(text.str().find("added atomically onto the output's values") != std::string::npos);
    // Without the flag the input gradient is a step of its own, which reads
    // the pairs' rows and the router's share: tensors the flag does not make.
    TrainingProgram plain = lower_training(ex.pipeline, out, Schedule(sch).atomic_combine(false));
    CHECK(gemm_writing(plain.program, "d_x") == nullptr);
    const PointwiseStep *sum = nullptr;
    for (const Step &st : plain.program.steps)
      if (const auto *pw = std::get_if<PointwiseStep>(&st); pw && pw->output == "d_x")
        sum = pw;
    REQUIRE(sum != nullptr);
    const std::vector<std::string> read = step_reads(*sum);
    CHECK(read.size() >= 2);
    for (const std::string &r : read) {
      INFO(r);
      CHECK(t.program.find(r) == nullptr);
    }
  }
}
