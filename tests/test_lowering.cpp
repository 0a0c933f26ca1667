// Lowering without a backend: the passes are listed in order and
// MOEFORGE_DEBUG=lower prints the kernel program after each one.
#include <doctest/doctest.h>

#include <cstdlib>
#include <iostream>
#include <sstream>

#include "dsl/printer.h"
#include "examples/examples.h"
#include "lowering/lower.h"
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
