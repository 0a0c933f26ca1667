// The backend interface (runtime/backend.h, backends/backends.h): every
// built backend, made by name, runs a forward and a training step that
// match the float64 reference Func by Func (outputs poisoned first, fresh
// random inputs), moves to another token count without compiling, and
// refuses bad input with the same words. The CUDA backend's cases are GPU
// tests and skip visibly without one.
#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "backends/backends.h"
#include "examples/examples.h"
#include "runtime/program_shapes.h"
#include "schedules/presets.h"
#include "training_compare.h"
#include "user_error.h"
#ifdef MOEFORGE_HAVE_CUDA
#include "gpu_test.h"
#endif

using namespace moeforge;
using namespace moeforge::testing;

namespace {

// The forward of swiglu_moe under `schedule`, through the interface.
void check_forward(Backend &backend, const std::string &schedule_name) {
  const ExampleShape s = shape(96, 32, 64, 8, 2);
  const Example ex = make_example("swiglu_moe", s);
  const TensorMap inputs = ex.random_inputs(s, 5);
  const Schedule schedule = preset(schedule_name);
  std::unique_ptr<Layer> layer = backend.layer(ex.pipeline, schedule, s.tokens);
  CHECK(layer->tokens() == s.tokens);
  layer->upload(inputs);
  layer->poison();
  const double ms = layer->run();
  CHECK(ms > 0);
  const Outcome o = compare_with_reference(ex, inputs, layer->program(), *layer, schedule.to_text(), 1e-2);
  CHECK(o.routing_mismatches == 0);
  CHECK(layer->dropped_pairs(ex.route) == 0);
  CHECK(layer->kept_pairs(ex.route) == std::vector<uint8_t>(s.tokens * s.topk, 1));
  // Each step once, named as the program names it.
  const StepTimes times = layer->profile();
  REQUIRE(times.size() == layer->program().steps.size());
  for (const auto &[name, step_ms] : times)
    CHECK(step_ms >= 0);
  // The same values as bytes in the storage type: the same output.
  const HostTensor y = layer->download(ex.output);
  const TensorDecl *w1 = layer->program().find("w1");
  REQUIRE(w1 != nullptr);
  layer->upload_bytes("w1", encode_values(inputs.at("w1").data, w1->dtype));
  layer->run();
  CHECK(max_abs_difference(layer->download(ex.output), y) == 0);
  CHECK(user_error_of([&] {
          layer->upload_bytes("w1", std::vector<uint8_t>(3));
        }).find("upload_bytes of 'w1': 3 bytes given, the layer holds") != std::string::npos);
  CHECK(user_error_of([&] { layer->upload("y", inputs.at("x")); }).find("'y' is not an Input or Param") !=
        std::string::npos);

  // The same program at another token count: its own memory and inputs.
  const ExampleShape s2 = shape(40, 32, 64, 8, 2);
  std::unique_ptr<Layer> other = layer->with_tokens(s2.tokens);
  CHECK(other->tokens() == s2.tokens);
  CHECK(&other->program() == &layer->program()); // one compiled program
  const TensorMap inputs2 = ex.random_inputs(s2, 6);
  CHECK(user_error_of([&] { other->run(); }).find("run() before upload()") != std::string::npos);
  other->upload(inputs2);
  other->poison();
  other->run();
  const Outcome o2 = compare_with_reference(ex, inputs2, other->program(), *other, schedule.to_text(), 1e-2);
  CHECK(o2.routing_mismatches == 0);
  CHECK(max_abs_difference(layer->download(ex.output), y) == 0); // the first layer untouched
}

// A training step of swiglu_moe, then the same program at another token
// count (with_tokens), each against the reference.
void check_training(Backend &backend) {
  const ExampleShape s = shape(80, 32, 64, 8, 2);
  const Example ex = make_example("swiglu_moe", s);
  const Schedule schedule = training_preset("scattermoe", /*recompute=*/false);
  std::unique_ptr<TrainingLayer> layer =
      backend.training_layer(ex.pipeline, {ex.pipeline.func(ex.output)}, schedule, s.tokens);
  const TrainingProgram &t = layer->training();
  auto step = [](TrainingLayer &l) {
    CHECK(l.forward() > 0);
    CHECK(l.backward() > 0);
  };
  const Outcome first = step_and_compare(ex, ex.random_inputs(s, 7), t.program, t.seeds.at(0), *layer, schedule, step);
  CHECK(first.routing_mismatches == 0);
  CHECK(layer->saved_bytes() > 0);
  CHECK(layer->profile_forward().size() + layer->profile_backward().size() > 0);

  // Before a forward at the new count, the backward is refused.
  const ExampleShape s2 = shape(40, 32, 64, 8, 2);
  std::unique_ptr<TrainingLayer> other = layer->with_tokens(s2.tokens);
  CHECK(other->tokens() == s2.tokens);
  CHECK(&other->training() == &layer->training()); // one compiled program
  const TensorMap inputs2 = ex.random_inputs(s2, 8);
  other->upload(inputs2);
  other->upload_upstream_gradient(upstream_gradient(ex, inputs2, 3));
  CHECK(user_error_of([&] { other->backward(); }).find("forward") != std::string::npos);
  const Outcome second = step_and_compare(ex, inputs2, t.program, t.seeds.at(0), *other, schedule, step);
  CHECK(second.routing_mismatches == 0);
  CHECK(user_error_of([&] { other->gradient("nope"); }).find("nope") != std::string::npos);
  CHECK(user_error_of([&] { other->upload_upstream_gradient("nope", HostTensor({1})); }).find("nope") !=
        std::string::npos);
}

} // namespace

TEST_CASE("backend: make_backend refuses a name not built, naming those that are") {
  const std::string e = user_error_of([] { make_backend("tpu"); });
  CHECK(e.find("no backend 'tpu' in this build") != std::string::npos);
  for (const std::string &name : backend_names())
    CHECK(e.find("'" + name + "'") != std::string::npos);
  CHECK(user_error_of([] { make_backend("reference"); }).find("evaluate(pipeline, inputs)") != std::string::npos);
}

#ifdef MOEFORGE_HAVE_CPU_BACKEND
TEST_CASE("backend: cpu, by name, runs a forward that matches the reference") {
  std::unique_ptr<Backend> cpu = make_backend("cpu");
  CHECK(cpu->name() == "cpu");
  CHECK(cpu->description().rfind("cpu (LLVM JIT, ", 0) == 0);
  check_forward(*cpu, "scattermoe");
  check_forward(*cpu, "megablocks");
  // Each entry point names itself when called too early.
  const ExampleShape s = shape(16, 32, 64, 8, 2);
  const Example ex = make_example("moe_mlp", s);
  std::unique_ptr<Layer> early = cpu->layer(ex.pipeline, preset("scattermoe"), s.tokens);
  CHECK(user_error_of([&] { early->profile(); }).find("profile() before upload() of 'x'") != std::string::npos);
  CHECK(user_error_of([&] { early->run(); }).find("run() before upload() of 'x'") != std::string::npos);
  std::unique_ptr<TrainingLayer> train =
      cpu->training_layer(ex.pipeline, {ex.pipeline.func(ex.output)}, preset("scattermoe"), s.tokens);
  CHECK(user_error_of([&] { train->profile_forward(); }).find("profile_forward() before upload() of 'x'") !=
        std::string::npos);
  CHECK(user_error_of([&] { train->profile_backward(); }).find("backward() before forward()") != std::string::npos);
}

TEST_CASE("backend: cpu trains through the interface, at two token counts of one program") {
  check_training(*make_backend("cpu"));
}

TEST_CASE("backend: a layer outlives its backend and pipeline") {
  const ExampleShape s = shape(32, 32, 64, 8, 2);
  std::unique_ptr<Layer> layer;
  TensorMap inputs;
  {
    const Example ex = make_example("moe_mlp", s);
    inputs = ex.random_inputs(s, 2);
    layer = make_backend("cpu")->layer(ex.pipeline, preset("scattermoe"), s.tokens);
  }
  layer->upload(inputs);
  layer->poison();
  layer->run();
  const Example ex = make_example("moe_mlp", s); // the same algebra again, for the reference
  CHECK(max_normalized_error(layer->download("y"), evaluate(ex.pipeline, inputs, Precision::f64)["y"]) < 1e-2);
}
#endif

#ifdef MOEFORGE_HAVE_CUDA
TEST_CASE("backend: cuda on a machine without a GPU is a UserError that says why") {
  std::string why;
  if (cuda::gpu_available(&why))
    return; // the GPU suite's case below runs it
  const std::string e = user_error_of([] { make_backend("cuda"); });
  CHECK(e.find("the cuda backend needs a GPU: " + why) != std::string::npos);
  CHECK(e.find("the cpu backend runs anywhere") != std::string::npos);
}

TEST_SUITE("gpu") {
  TEST_CASE("cuda gpu: the backend interface, by name: a forward and a training step match the reference") {
    MOEFORGE_REQUIRE_GPU();
    std::unique_ptr<Backend> cuda = make_backend("cuda");
    CHECK(cuda->name() == "cuda");
    CHECK(cuda->description().rfind("cuda on ", 0) == 0);
    check_forward(*cuda, "scattermoe");
    check_forward(*cuda, "megablocks");
    check_training(*cuda);
  }
}
#endif
