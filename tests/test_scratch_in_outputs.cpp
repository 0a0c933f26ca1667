// Scratch in the caller's outputs (runtime/memory_plan.h, InOutput::scratch):
// an intermediate whose whole lifetime ends before any step touches an
// output of the same entry point lives in that output's memory, and the
// workspace the caller gives each step loses it. mixtral's backward: dH
// (476 MiB) in d_w1's memory before the weight gradients are written. The
// values: every caller-memory test of both backends runs with it
// (test_cpu_caller_memory.cpp checks its shapes use it).
#include <doctest/doctest.h>

#include <algorithm>

#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "planned_step.h"
#include "schedules/presets.h"
#include "strided_params.h"

using namespace moeforge;
using testing::kMiB;
using testing::shape;

namespace {

// The first and last step that touch a tensor (a read or a write).
std::pair<size_t, size_t> touches(const KernelProgram &p, const std::string &name) {
  size_t first = p.steps.size(), last = 0;
  for (size_t s = 0; s < p.steps.size(); ++s) {
    const std::vector<std::string> reads = step_reads(p.steps[s]), writes = step_outputs(p.steps[s]);
    if (std::count(reads.begin(), reads.end(), name) + std::count(writes.begin(), writes.end(), name) > 0) {
      first = std::min(first, s);
      last = s;
    }
  }
  return {first, last};
}

// What the plan promises of each scratch placement, checked from the
// program itself: the tensor is an intermediate, its lifetime lies in the
// output's entry point and ends before the output's memory is first
// touched (by the output, or by an intermediate living in it element by
// element), it fits, at an aligned offset, and two placed in one output
// whose lifetimes meet do not share bytes. Returns how many there are.
int check_scratch(const KernelProgram &p, const StepMemoryPlan &plan, size_t boundary,
                  const std::function<size_t(const TensorDecl &)> &bytes) {
  int scratch = 0;
  for (const auto &[name, where] : plan.in_output) {
    if (!where.scratch)
      continue;
    INFO(name << " in " << where.output);
    ++scratch;
    const TensorDecl &t = p.tensor(name), &out = p.tensor(where.output);
    CHECK_FALSE(t.is_input);
    CHECK_FALSE(is_output(p, name));
    CHECK(is_output(p, where.output));
    CHECK(out.outer_stride == 0);
    CHECK_FALSE(plan.workspace.offset.count(name));
    CHECK_FALSE(plan.saved.offset.count(name));
    size_t busy_from = touches(p, where.output).first;
    for (const auto &[other, w] : plan.in_output)
      if (w.output == where.output && !w.scratch)
        busy_from = std::min(busy_from, touches(p, other).first);
    const auto [from, to] = touches(p, name);
    CHECK(to < busy_from);
    CHECK((from >= boundary) == (busy_from >= boundary)); // one entry point
    CHECK(where.offset % 256 == 0);
    CHECK(where.offset + bytes(t) <= bytes(out));
    for (const auto &[other, w] : plan.in_output) {
      if (other == name || !w.scratch || w.output != where.output)
        continue;
      const auto [o_from, o_to] = touches(p, other);
      const bool meet = o_from <= to && from <= o_to;
      const bool overlap = w.offset < where.offset + bytes(t) && where.offset < w.offset + bytes(p.tensor(other));
      // Tensors one written over the other (in place) share bytes by design.
      const bool in_place = plan.workspace.written_over.count(name) || plan.workspace.written_over.count(other);
      CHECK((!meet || !overlap || in_place));
    }
  }
  return scratch;
}

} // namespace

TEST_CASE("scratch in outputs: mixtral's dH lives in a weight gradient before it is written") {
  const ExampleShape s = shape(8192, 4096, 14336, 8, 2); // mixtral
  Example ex = make_example("swiglu_moe", s);
  const Schedule def = default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)});
  const testing::PlannedStep on = testing::planned_step(ex, s.tokens, def);
  const testing::PlannedStep off = testing::planned_step(ex, s.tokens, def, OutputScratch::off);
  REQUIRE(on.plan.in_output.count("d_h_ungated"));
  const InOutput &dh = on.plan.in_output.at("d_h_ungated");
  CHECK(dh.scratch);
  CHECK((dh.output == "d_w1" || dh.output == "d_w3"));
  // 476 MiB (dH, and the gated h over it) out of the backward's workspace:
  // what is left is the input gradient's per-pair rows, T k x d bf16.
  CHECK(off.plan.workspace_after >= 476 * kMiB);
  CHECK(on.plan.workspace_after <= 129 * kMiB);
  CHECK(on.plan.workspace_after >= size_t(8192) * 2 * 4096 * 2);
  // The saved region and the outputs are what they were.
  CHECK(on.plan.saved.arena_bytes == off.plan.saved.arena_bytes);
  ProgramShapes shapes(on.t.program, s.tokens);
  auto bytes = [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); };
  CHECK(check_scratch(on.t.program, on.plan, on.t.forward_steps, bytes) >= 2);
}

TEST_CASE("scratch in outputs: every placement keeps to its output's free steps and bytes") {
  for (const char *name : {"moe_mlp", "swiglu_moe", "deepseek_moe", "shared_expert_moe"})
    for (const ExampleShape &s : {shape(37, 64, 128, 8, 2), shape(300, 64, 128, 8, 2), shape(8192, 2880, 2880, 128, 4),
                                  shape(16384, 2048, 768, 128, 8), shape(16384, 2048, 1408, 64, 8)}) {
      INFO(name << " T " << s.tokens << " d " << s.d << " f " << s.f << " E " << s.experts);
      Example ex = make_example(name, s);
      const Func out = ex.pipeline.func(ex.output);
      for (bool lean : {true, false}) {
        Schedule sch = lean ? default_schedule(ex.pipeline, {out}) : preset("scattermoe");
        const testing::PlannedStep l = testing::planned_step(ex, s.tokens, sch);
        ProgramShapes shapes(l.t.program, s.tokens);
        auto bytes = [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); };
        CHECK(check_scratch(l.t.program, l.plan, l.t.forward_steps, bytes) > 0);
        // Never more workspace than without it.
        const testing::PlannedStep off = testing::planned_step(ex, s.tokens, sch, OutputScratch::off);
        CHECK(l.plan.workspace_after <= off.plan.workspace_after);
        CHECK(l.plan.workspace_before <= off.plan.workspace_before);
      }
    }
}

TEST_CASE("scratch in outputs: a gradient stored inside a larger tensor takes none") {
  // w1's and w3's gradients are the halves of one gate_up_proj gradient: the
  // bytes between one's rows are the other's, so neither is scratch.
  const ExampleShape s = shape(37, 64, 128, 8, 2);
  const Example ex = testing::gate_up_swiglu(s);
  const testing::PlannedStep l =
      testing::planned_step(ex, s.tokens, default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)}));
  int strided = 0;
  for (const TensorDecl &t : l.t.program.tensors)
    strided += is_output(l.t.program, t.name) && t.outer_stride != 0;
  CHECK(strided == 2);
  for (const auto &[name, where] : l.plan.in_output) {
    INFO(name << " in " << where.output);
    CHECK(l.t.program.tensor(where.output).outer_stride == 0);
  }
  ProgramShapes shapes(l.t.program, s.tokens);
  auto bytes = [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); };
  CHECK(check_scratch(l.t.program, l.plan, l.t.forward_steps, bytes) > 0); // d_w2's and d_x's memory still serve
}
