// Params stored inside a larger tensor (Param outer_stride): the algebra
// refuses strides that cannot be, prints them, and lowering gives a strided
// Param's gradient the same stride (it is written into the same place of the
// larger tensor's gradient) while copies of its own stay dense; the program's
// storage holds each index of the first dim at its stride. The values on each
// backend: test_cpu_outer_stride.cpp, test_cuda_outer_stride.cpp and
// tests/python (transformers' gate_up_proj in place).
#include <doctest/doctest.h>

#include <sstream>

#include "dsl/printer.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/training.h"
#include "runtime/program_shapes.h"
#include "schedules/presets.h"
#include "strided_params.h"
#include "user_error.h"

using namespace moeforge;

TEST_CASE("outer stride: the algebra refuses a stride its Param cannot have") {
  Dim T = Dim::dynamic("T"), E("E", 4), F("F", 16), D("D", 8);
  CHECK(testing::user_error_of([&] {
          (void)Param("w", {E}, DType::bf16, 16);
        }).find("so it needs two dims or more (it has 1)") != std::string::npos);
  CHECK(testing::user_error_of([&] {
          (void)Param("w", {E, T}, DType::bf16, 64);
        }).find("outer_stride needs static dims after the first (T is dynamic)") != std::string::npos);
  CHECK(testing::user_error_of([&] {
          (void)Param("w", {E, F, D}, DType::bf16, 120);
        }).find("outer_stride 120 is less than the 128 elements of one index of its first dim") != std::string::npos);
  CHECK(testing::user_error_of([&] {
          (void)Param("w", {E, F, D}, DType::bf16, 132);
        }).find("outer_stride 132 must be a multiple of 8 elements") != std::string::npos);
  CHECK(Param("w", {E, F, D}, DType::bf16, 256).outer_stride() == 256);
  CHECK(Param("w", {E, F, D}, DType::bf16, 128).outer_stride() == 0); // its dense stride: the plain Param
  CHECK(Param("w", {E, F, D}).outer_stride() == 0);
}

TEST_CASE("outer stride: printed with the layer") {
  const Example ex = testing::gate_up_swiglu(testing::shape(16, 64, 128, 8, 2));
  std::ostringstream os;
  os << ex.pipeline;
  const std::string text = os.str();
  CHECK(text.find("param w1(E, F, D) : bf16, E every 16384 elements") != std::string::npos);
  CHECK(text.find("param w2(E, D, F) : bf16\n") != std::string::npos);
}

TEST_CASE("outer stride: a strided Param's gradient takes its stride; copies of their own stay dense") {
  const ExampleShape s = testing::shape(37, 64, 128, 8, 2);
  const Example ex = testing::gate_up_swiglu(s);
  const Func out = ex.pipeline.func(ex.output);
  for (bool mma_sync : {false, true}) {
    Schedule sch = default_schedule(ex.pipeline, {out});
    if (mma_sync) // w1, w3 read transposed through a copy: the copy is a dense tensor of its own
      sch = preset("scattermoe");
    INFO("schedule " << sch.name());
    const TrainingProgram t = lower_training(ex.pipeline, out, sch);
    for (const char *w : {"w1", "w3"}) {
      CHECK(t.program.tensor(w).outer_stride == 2 * s.f * s.d);
      CHECK(t.program.tensor(t.gradient_of(w)).outer_stride == 2 * s.f * s.d);
    }
    CHECK(t.program.tensor("w2").outer_stride == 0);
    CHECK(t.program.tensor(t.gradient_of("w2")).outer_stride == 0);
    for (const TensorDecl &d : t.program.tensors)
      if (d.name != "w1" && d.name != "w3" && d.name != t.gradient_of("w1") && d.name != t.gradient_of("w3"))
        CHECK_MESSAGE(d.outer_stride == 0, d.name);
  }
}

TEST_CASE("outer stride: storage holds each index of the first dim at its stride, and the gaps are not its") {
  const ExampleShape s = testing::shape(5, 16, 8, 4, 2); // w1: [4, 8, 16], every 256 elements
  const Example ex = testing::gate_up_swiglu(s);
  const TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output),
                                           default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)}));
  const ProgramShapes shapes(t.program, s.tokens);
  const TensorDecl &w1 = t.program.tensor("w1");
  CHECK(shapes.elements(w1) == 3 * 256 + 128); // up to the last expert's own elements
  CHECK(shapes.shape(w1) == std::vector<int64_t>{4, 8, 16});
  const TensorMap inputs = ex.random_inputs(s, 3);
  const std::vector<uint8_t> bytes = shapes.encode_input(w1, inputs);
  REQUIRE(bytes.size() == size_t(3 * 256 + 128) * 2);
  for (size_t at = 128 * 2; at < 256 * 2; ++at) // between experts 0 and 1: w3's, left zero
    CHECK(bytes[at] == 0);
  const HostTensor back = shapes.decode(w1, bytes);
  const HostTensor &given = inputs.at("w1");
  REQUIRE(back.shape == given.shape);
  for (size_t k = 0; k < given.data.size(); ++k)
    CHECK(back.data[k] == given.data[k]); // bf16-exact values round-trip
}
