// lowering/in_place.h: an element-wise output written over the bytes of an
// input it reads only at its own element, once nothing reads that input
// later; runtime/memory_plan.h places the two at one offset.
#include <doctest/doctest.h>

#include <algorithm>

#include "backends/cuda/codegen/codegen_cuda.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/in_place.h"
#include "lowering/training.h"
#include "runtime/memory_plan.h"
#include "runtime/program_shapes.h"

using namespace moeforge;

namespace {

const ExampleShape kQwen3 = testing::shape(16384, 2048, 768, 128, 8);

TrainingProgram lowered(const ExampleShape &s) {
  Example ex = make_example("swiglu_moe", s);
  const Func out = ex.pipeline.func(ex.output);
  // The activation gradients and the gated h in one kernel, whose peak the
  // in-place output lowers by a whole T k x f tensor (split apart, the peak
  // moves to the input gradient's GEMM: test_split_for_memory.cpp). The
  // saved tensors stay the backward's to read (test_gradients_over_saved.cpp
  // writes over them), and dy's rows copied per pair, as measured then.
  return lower_training(ex.pipeline, out,
                        default_schedule(ex.pipeline, {out})
                            .split_pointwise_for_memory(false)
                            .gradients_over_saved(false)
                            .gather_upstream_in_gemms(false));
}

// Without scratch in the outputs (which would take dH and the gradients
// over it out of the workspace), so that the in-place outputs show.
StepMemoryPlan plan_of(const TrainingProgram &t, const ExampleShape &s) {
  ProgramShapes shapes(t.program, s.tokens);
  auto bytes = [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); };
  return plan_step_memory(t.program, bytes, t.forward_steps, 256, OutputScratch::off);
}

struct Mark {
  size_t step;
  std::string output, input;
};

std::vector<Mark> marks_of(const KernelProgram &p) {
  std::vector<Mark> m;
  for (size_t s = 0; s < p.steps.size(); ++s)
    if (const auto *pw = std::get_if<PointwiseStep>(&p.steps[s]))
      for (const auto &[out, in] : pw->in_place)
        m.push_back({s, out, in});
  return m;
}

} // namespace

TEST_CASE("in place: SwiGLU's backward writes an activation gradient over the gradient it is made from") {
  const TrainingProgram t = lowered(kQwen3);
  const std::vector<Mark> marks = marks_of(t.program);
  REQUIRE(!marks.empty());
  // The router's share of the input gradient lives in the input
  // gradient's own memory (the caller's: may_live_in_output); every other
  // mark is an intermediate over an intermediate.
  std::vector<Mark> in_output;
  for (const Mark &m : marks)
    if (may_live_in_output(t.program, m.step, m.output, m.input, t.forward_steps))
      in_output.push_back(m);
  REQUIRE(in_output.size() == 1);
  CHECK(in_output[0].output == t.gradients[0]); // d_x
  CHECK(in_output[0].input == "d_x_s3");
  CHECK_FALSE(
      may_write_in_place(t.program, in_output[0].step, in_output[0].output, in_output[0].input, t.forward_steps));
  std::vector<Mark> apart_marks;
  for (const Mark &m : marks)
    if (m.input != "d_x_s3")
      apart_marks.push_back(m);
  for (const Mark &m : apart_marks) {
    INFO(m.output << " over " << m.input);
    CHECK(m.step >= t.forward_steps);
    CHECK(may_write_in_place(t.program, m.step, m.output, m.input, t.forward_steps));
    // Neither is the caller's, nor kept for the backward.
    for (const std::string &n : {m.output, m.input}) {
      CHECK(std::count(t.saved.begin(), t.saved.end(), n) == 0);
      CHECK(std::count(t.program.outputs.begin(), t.program.outputs.end(), n) == 0);
      CHECK_FALSE(t.program.tensor(n).is_input);
    }
  }
  // The dH GEMM's result (dy W2^T, T k x f) is what SwiGLU's backward
  // reads last at the step that makes the pre-activations' gradients.
  CHECK(std::any_of(marks.begin(), marks.end(), [](const Mark &m) { return m.input == "d_h_ungated"; }));

  const StepMemoryPlan plan = plan_of(t, kQwen3);
  std::map<std::string, InOutput> element_wise; // the scratch ones: test_scratch_in_outputs.cpp
  for (const auto &[in, where] : plan.in_output)
    if (!where.scratch)
      element_wise[in] = where;
  CHECK(element_wise == std::map<std::string, InOutput>{{"d_x_s3", {t.gradients[0], 0, false}}});
  CHECK_FALSE(plan.workspace.offset.count("d_x_s3"));
  for (const Mark &m : apart_marks) {
    INFO(m.output << " over " << m.input);
    REQUIRE(plan.workspace.written_over.count(m.output));
    CHECK(plan.workspace.written_over.at(m.output) == m.input);
    CHECK(plan.workspace.offset.at(m.output) == plan.workspace.offset.at(m.input));
    CHECK(plan.workspace.live.at(m.input).second == m.step);
    CHECK(plan.workspace.live.at(m.output).first == m.step);
  }
  // Without the marks the backward's workspace is larger by one T k x f
  // bf16 tensor (qwen3moe: 216 MiB, padded rows).
  TrainingProgram unmarked = t;
  for (Step &s : unmarked.program.steps)
    if (auto *pw = std::get_if<PointwiseStep>(&s))
      pw->in_place.clear();
  const StepMemoryPlan apart = plan_of(unmarked, kQwen3);
  CHECK(apart.workspace.written_over.empty());
  const size_t tk_f = size_t(16384) * 8 * 768 * 2;
  CHECK(apart.workspace_after >= plan.workspace_after + tk_f);
  CHECK(apart.workspace_before == plan.workspace_before);
}

TEST_CASE("in place: refused where the input is read later, kept for a backward, or the caller's") {
  const ExampleShape s = testing::shape(300, 64, 128, 8, 2);
  const TrainingProgram t = lowered(s);
  const std::vector<Mark> marks = marks_of(t.program);
  REQUIRE(!marks.empty());
  const Mark m = marks.front();
  REQUIRE(may_write_in_place(t.program, m.step, m.output, m.input, t.forward_steps));

  SUBCASE("a later step reads the input") {
    TrainingProgram late = t;
    const auto &pw = std::get<PointwiseStep>(late.program.steps[m.step]);
    PointwiseStep reader = pw;
    reader.name = "reads_again";
    reader.output = m.input + "_again";
    reader.extra.clear();
    reader.in_place.clear();
    reader.body = tensor_read(m.input, late.program.tensor(m.input).dtype, {pw.vars[0], pw.vars[1]});
    TensorDecl again = late.program.tensor(m.input);
    again.name = reader.output;
    late.program.tensors.push_back(again);
    late.program.outputs.push_back(again.name);
    late.program.steps.push_back(reader);
    CHECK_FALSE(may_write_in_place(late.program, m.step, m.output, m.input, late.forward_steps));
    // The plan checks the mark again and places the two apart.
    const StepMemoryPlan plan = plan_of(late, s);
    CHECK(plan.workspace.written_over.count(m.output) == 0);
    CHECK(plan.workspace.offset.at(m.output) != plan.workspace.offset.at(m.input));
  }
  SUBCASE("the input is kept across the boundary") {
    // With the boundary after the input's writer, the input is what a
    // forward keeps for a backward that may run twice.
    size_t writer = 0;
    for (size_t i = 0; i < m.step; ++i) {
      const std::vector<std::string> w = step_outputs(t.program.steps[i]);
      if (std::count(w.begin(), w.end(), m.input))
        writer = i;
    }
    CHECK_FALSE(may_write_in_place(t.program, m.step, m.output, m.input, writer + 1));
  }
  SUBCASE("the output is the caller's") {
    TrainingProgram out = t;
    out.program.outputs.push_back(m.output);
    CHECK_FALSE(may_write_in_place(out.program, m.step, m.output, m.input, out.forward_steps));
  }
  SUBCASE("the input is read at another element") {
    TrainingProgram shifted = t;
    auto &pw = std::get<PointwiseStep>(shifted.program.steps[m.step]);
    const Var other("other", pw.vars[1].dim());
    pw.body = Binary::make(
        BinaryOp::add, pw.body,
        Sum::make(other, tensor_read(m.input, shifted.program.tensor(m.input).dtype, {pw.vars[0], other})));
    CHECK_FALSE(may_write_in_place(shifted.program, m.step, m.output, m.input, shifted.forward_steps));
  }
}

TEST_CASE("in place: the step's kernel does not mark the two pointers __restrict__; the others keep it") {
  const ExampleShape s = testing::shape(300, 64, 128, 8, 2);
  const TrainingProgram t = lowered(s);
  const std::vector<Mark> marks = marks_of(t.program);
  REQUIRE(!marks.empty());
  const CudaModuleSource gen = generate_cuda(t.program);
  for (const Mark &m : marks) {
    const std::string step = step_name(t.program.steps[m.step]);
    INFO(step);
    const auto k =
        std::find_if(gen.kernels.begin(), gen.kernels.end(), [&](const GeneratedKernel &g) { return g.step == step; });
    REQUIRE(k != gen.kernels.end());
    const size_t head = k->source.find(" " + k->name + "(");
    REQUIRE(head != std::string::npos);
    const std::string signature = k->source.substr(head, k->source.find(") {", head) - head);
    // Each parameter on a line of its own: ",\n    " between them.
    const std::string params = signature + ",";
    for (const std::string &n : {m.output, m.input}) {
      INFO(n);
      CHECK(params.find(" *g_" + n + ",") != std::string::npos);
      CHECK(params.find("*__restrict__ g_" + n + ",") == std::string::npos);
    }
    CHECK(signature.find("__restrict__") != std::string::npos); // the step's other tensors
  }
}
