// Lowering without a backend: the passes are listed in order and
// MOEFORGE_DEBUG=lower prints the kernel program after each one.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <set>
#include <sstream>

#include "dsl/printer.h"
#include "examples/examples.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "schedules/presets.h"

using namespace moeforge;

TEST_CASE("lowering: MOEFORGE_DEBUG=lower prints the program after every pass in order") {
  ExampleShape s;
  s.tokens = 32;
  Example ex = make_example("swiglu_moe", s);
  std::ostringstream captured;
  std::streambuf *old = std::cerr.rdbuf(captured.rdbuf());
  ::setenv("MOEFORGE_DEBUG", "lower", 1);
  KernelProgram p = lower(ex.pipeline, preset("megablocks"));
  ::unsetenv("MOEFORGE_DEBUG");
  std::cerr.rdbuf(old);
  const std::string text = captured.str();
  size_t at = 0;
  for (const char *pass : {"build_steps", "fuse_gate_into_epilogue", "split_unfused_epilogues", "insert_permutation",
                           "assign_row_layouts", "resolve_row_maps", "materialize_transposes"}) {
    size_t found = text.find(std::string("=== after ") + pass + " ===", at);
    CHECK_MESSAGE(found != std::string::npos, "no dump after " << pass << " (in order)");
    if (found != std::string::npos)
      at = found;
  }
  // The last dump is the program lower() returned.
  std::ostringstream final_program;
  final_program << p;
  const std::string last = "=== after materialize_transposes ===\n";
  CHECK(text.substr(text.rfind(last) + last.size()) == final_program.str());
}

TEST_CASE("lowering: without MOEFORGE_DEBUG nothing is printed") {
  ::unsetenv("MOEFORGE_DEBUG");
  std::ostringstream captured;
  std::streambuf *old = std::cerr.rdbuf(captured.rdbuf());
  lower(make_example("moe_mlp", ExampleShape{}).pipeline, preset("scattermoe"));
  std::cerr.rdbuf(old);
  CHECK(captured.str().empty());
}

TEST_CASE("lowering: a pass that does not apply returns the program unchanged") {
  Example ex = make_example("moe_mlp", ExampleShape{});
  Schedule blocked = preset("megablocks"); // gate in the combine: nothing to fuse
  KernelProgram p = build_steps(ex.pipeline, blocked);
  std::ostringstream before, after;
  before << p;
  after << fuse_gate_into_epilogue(p, blocked);
  CHECK(before.str() == after.str());
  std::ostringstream scattered;
  scattered << insert_permutation(p, preset("scattermoe")); // gathers stay in the GEMM: no copy step
  CHECK(scattered.str() == before.str());
}

TEST_CASE("lowering: a training forward's element-wise steps run in its GEMMs' epilogues") {
  ExampleShape s;
  s.tokens = 32;
  Example ex = make_example("swiglu_moe", s);
  TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), preset("scattermoe"));
  // The forward: h_lhs = silu(h_silu_in) and h = h_lhs * h_rhs are written by
  // the GEMMs of h_silu_in and h_rhs, not by element-wise steps.
  std::vector<std::string> extras;
  for (size_t i = 0; i < t.forward_steps; ++i) {
    const Step &st = t.program.steps[i];
    if (auto *pw = std::get_if<PointwiseStep>(&st))
      CHECK_MESSAGE(pw->output != "h", "h is still an element-wise step");
    if (auto *g = std::get_if<GemmStep>(&st))
      for (const GemmStep::Extra &e : g->extra)
        extras.push_back(e.output);
  }
  CHECK(std::find(extras.begin(), extras.end(), "h_lhs") != extras.end());
  CHECK(std::find(extras.begin(), extras.end(), "h") != extras.end());
  // The backward keeps its element-wise steps (see lowering/training.cpp).
  bool backward_pointwise = false;
  for (size_t i = t.forward_steps; i < t.program.steps.size(); ++i)
    if (auto *pw = std::get_if<PointwiseStep>(&t.program.steps[i]))
      backward_pointwise |= pw->output == "d_x_s_a";
  CHECK(backward_pointwise);
  // Every tensor a step reads is written by an earlier step or is an input.
  std::set<std::string> ready;
  for (const TensorDecl &d : t.program.tensors)
    if (d.is_input)
      ready.insert(d.name);
  for (const Step &st : t.program.steps) {
    for (const std::string &r : step_reads(st))
      if (t.program.find(r))
        CHECK_MESSAGE(ready.count(r), step_name(st) << " reads " << r << " before it is written");
    for (const std::string &o : step_outputs(st))
      ready.insert(o);
  }
}
