// Schedule::bf16_boundary: the tensors a model passes to and from the layer
// (y, its upstream gradient dy, the input's gradient dx) stored in bf16.
// What the program becomes is checked here; the values on the CPU backend in
// test_cpu_training.cpp ("+boundary" presets), on the GPU in
// test_cuda_training.cpp and test_cuda_caller_memory.cpp, and through
// moeforge.torch in tests/python.
#include <doctest/doctest.h>

#include <string>

#include "examples/aux_loss_example.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/choices_without_effect.h"
#include "lowering/default_schedule.h"
#include "lowering/training.h"

using namespace moeforge;

namespace {

bool has_note(const std::vector<std::string> &notes, const std::string &start) {
  for (const std::string &n : notes)
    if (n.rfind(start, 0) == 0)
      return true;
  return false;
}

} // namespace

TEST_CASE("bf16 boundary: y, dy and dx are bf16 in the default; off, f32 as the Funcs are") {
  const ExampleShape s = testing::shape(256, 64, 128, 8, 2);
  for (const char *name : {"moe_mlp", "swiglu_moe"}) {
    INFO(name);
    Example ex = make_example(name, s);
    const Func out = ex.pipeline.func(ex.output);
    Schedule sch = default_schedule(ex.pipeline, {out});
    REQUIRE(sch.bf16_boundary()); // on in the default
    CHECK(Schedule::from_text(sch.to_text()).bf16_boundary());
    const TrainingProgram on = lower_training(ex.pipeline, out, sch);
    const TrainingProgram off = lower_training(ex.pipeline, out, Schedule(sch).bf16_boundary(false));
    for (const char *t : {"y", "d_y", "d_x"}) {
      INFO(t);
      CHECK(on.program.tensor(t).dtype == DType::bf16);
      CHECK(off.program.tensor(t).dtype == DType::f32);
    }
    // The Params' gradients are bf16_weight_gradients' to decide: the
    // router's stays f32 (its split-K slices add into it), the experts'
    // bf16 either way.
    CHECK(on.program.tensor("d_wr").dtype == DType::f32);
    CHECK(on.program.tensor("d_w1").dtype == off.program.tensor("d_w1").dtype);
    // Off, the f32 dy needs a bf16 copy for the GEMMs that gather its rows
    // (the default's gather_upstream_in_gemms); no other step differs.
    CHECK(on.program.find("d_y_bf16") == nullptr);
    CHECK(on.program.steps.size() + (off.program.find("d_y_bf16") ? 1 : 0) == off.program.steps.size());
    CHECK(choices_not_taken(ex.pipeline, sch, {out}).empty());
  }
}

TEST_CASE("bf16 boundary: the dH GEMM gathers dy itself, with no bf16 copy of it") {
  // Where dy's rows are gathered inside the GEMMs, an f32 dy needed a bf16
  // copy (T x d) for the GEMM to read; a bf16 dy is read as it is.
  const ExampleShape s = testing::shape(256, 64, 128, 8, 2);
  Example ex = make_example("swiglu_moe", s);
  const Func out = ex.pipeline.func(ex.output);
  Schedule sch = default_schedule(ex.pipeline, {out});
  REQUIRE(sch.gather_upstream_in_gemms()); // on in the default
  const TrainingProgram on = lower_training(ex.pipeline, out, sch);
  const TrainingProgram off = lower_training(ex.pipeline, out, Schedule(sch).bf16_boundary(false));
  CHECK(on.program.find("d_y_bf16") == nullptr);
  CHECK(off.program.find("d_y_bf16") != nullptr);
}

TEST_CASE("bf16 boundary: scalar losses, and outputs summed by atomic adds, stay f32") {
  const ExampleShape s = testing::shape(256, 64, 128, 8, 2);
  SUBCASE("the auxiliary losses and their seeds are 0-D") {
    AuxLossLayer a = make_aux_loss_example("swiglu_moe", s);
    Schedule sch = default_schedule(a.example.pipeline, a.output_funcs());
    REQUIRE(sch.bf16_boundary());
    const TrainingProgram t = lower_training(a.example.pipeline, a.output_funcs(), sch);
    for (const char *name : {"lb_loss", "z_loss", "d_lb_loss", "d_z_loss"}) {
      INFO(name);
      CHECK(t.program.tensor(name).dtype == DType::f32);
    }
    CHECK(t.program.tensor("y").dtype == DType::bf16);
    CHECK(t.program.tensor("d_y").dtype == DType::bf16);
  }
  SUBCASE("atomic_combine adds y and dx up in the GEMMs' epilogues") {
    Example ex = make_example("swiglu_moe", s);
    const Func out = ex.pipeline.func(ex.output);
    Schedule sch = default_schedule(ex.pipeline, {out});
    sch.atomic_combine(true);
    const TrainingProgram t = lower_training(ex.pipeline, out, sch);
    CHECK(t.program.tensor("y").dtype == DType::f32);
    CHECK(t.program.tensor("d_x").dtype == DType::f32);
    CHECK(t.program.tensor("d_y").dtype == DType::bf16); // read only: still bf16
    CHECK_FALSE(has_note(choices_not_taken(ex.pipeline, sch, {out}), "bf16_boundary(true)"));
  }
}
