// runtime/memory_plan.h: tensors share memory by lifetime (reuse_memory).
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <vector>

#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "runtime/memory_plan.h"
#include "runtime/program_shapes.h"
#include "schedules/presets.h"

using namespace moeforge;

namespace {

ExampleShape shape_of(int64_t tokens) { return testing::shape(tokens, 64, 128, 8, 2); }

// Whether b is written over a's bytes at the step where a's life ends
// (PointwiseStep::in_place), or a over b's.
bool written_over(const MemoryPlan &plan, const std::string &a, const std::string &b) {
  auto over = [&](const std::string &out, const std::string &in) {
    auto it = plan.written_over.find(out);
    return it != plan.written_over.end() && it->second == in && plan.live.at(in).second == plan.live.at(out).first;
  };
  return over(a, b) || over(b, a);
}

// No two tensors whose lifetimes meet share a byte, but an output written
// over its input; offsets are aligned.
void check_disjoint(const MemoryPlan &plan) {
  for (const auto &[a, at_a] : plan.offset) {
    CHECK(at_a % 256 == 0);
    CHECK(at_a + plan.size.at(a) <= plan.arena_bytes);
    for (const auto &[b, at_b] : plan.offset) {
      if (a >= b)
        continue;
      const auto &[fa, la] = plan.live.at(a);
      const auto &[fb, lb] = plan.live.at(b);
      if (fa <= lb && fb <= la && !written_over(plan, a, b)) {
        INFO(a << " [" << fa << ", " << la << "] and " << b << " [" << fb << ", " << lb << "]");
        CHECK((at_a + plan.size.at(a) <= at_b || at_b + plan.size.at(b) <= at_a));
      }
    }
  }
}

} // namespace

TEST_CASE("memory plan: a training step's tensors share memory by lifetime; what outlives the run keeps its own") {
  for (const char *name : {"moe_mlp", "swiglu_moe"}) {
    INFO(name);
    ExampleShape s = shape_of(300);
    Example ex = make_example(name, s);
    Schedule sch = preset("scattermoe");
    sch.reuse_memory(true);
    TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), sch);
    CHECK(t.program.reuse_memory);
    ProgramShapes shapes(t.program, s.tokens);
    MemoryPlan plan = plan_memory(
        t.program, [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); },
        t.forward_steps);
    check_disjoint(plan);
    CHECK(plan.arena_bytes < plan.separate_bytes);
    // Inputs are the caller's: not planned.
    CHECK(plan.offset.count("x") == 0);
    // The outputs, the gradients and what the forward keeps for the backward
    // live to the last step, so a second backward and the caller read them.
    std::vector<std::string> kept = t.saved;
    kept.insert(kept.end(), t.outputs.begin(), t.outputs.end());
    kept.insert(kept.end(), t.gradients.begin(), t.gradients.end());
    for (const std::string &k : kept) {
      INFO(k);
      REQUIRE(plan.live.count(k));
      CHECK(plan.live.at(k).second == plan.last_step);
      CHECK(plan.outlives_run(k));
    }
    // Some backward intermediate is gone after the run (its bytes reused).
    bool reused = false;
    for (const auto &[n, at] : plan.offset)
      reused |= !plan.outlives_run(n);
    CHECK(reused);
  }
}

TEST_CASE("memory plan: a forward layer keeps its output and reuses its intermediates") {
  ExampleShape s = shape_of(200);
  Example ex = make_example("swiglu_moe", s);
  KernelProgram p = lower(ex.pipeline, preset("megablocks"));
  ProgramShapes shapes(p, s.tokens);
  MemoryPlan plan = plan_memory(
      p, [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); }, 0);
  check_disjoint(plan);
  CHECK(plan.outlives_run("y"));
  CHECK(plan.live.at("y").second == plan.last_step);
  CHECK(plan.arena_bytes <= plan.separate_bytes);
}

TEST_CASE("step memory plan: the saved region holds exactly what the forward keeps; the rest lives within a call") {
  for (const char *name : {"moe_mlp", "swiglu_moe"})
    for (bool lean : {false, true}) {
      INFO(name << (lean ? " lean" : ""));
      ExampleShape s = shape_of(300);
      Example ex = make_example(name, s);
      Schedule sch = preset("scattermoe");
      if (lean)
        sch.padded_elementwise(true).recompute_elementwise(true).gate_gradient_from_dh(true);
      TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), sch);
      ProgramShapes shapes(t.program, s.tokens);
      auto bytes = [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); };
      StepMemoryPlan plan = plan_step_memory(t.program, bytes, t.forward_steps);
      // The saved region is TrainingProgram::saved, one tensor after another.
      std::vector<std::string> saved;
      size_t saved_bytes = 0;
      for (const auto &[n, at] : plan.saved.offset) {
        saved.push_back(n);
        saved_bytes += plan.saved.size.at(n);
        CHECK(!plan.saved.shares(n));
      }
      std::vector<std::string> want = t.saved;
      std::sort(want.begin(), want.end());
      CHECK(saved == want);
      CHECK(plan.saved.arena_bytes == saved_bytes);
      // Neither region holds an Input or an output: those are the caller's.
      for (const TensorDecl &d : t.program.tensors) {
        const bool output =
            std::find(t.program.outputs.begin(), t.program.outputs.end(), d.name) != t.program.outputs.end();
        INFO(d.name);
        CHECK((plan.saved.offset.count(d.name) + plan.workspace.offset.count(d.name) + plan.in_output.count(d.name)) ==
              (d.is_input || output ? 0u : 1u));
        CHECK(plan.places(d.name) == !(d.is_input || output));
      }
      check_disjoint(plan.workspace);
      // Each call's part of the workspace: no tensor of the forward reaches
      // into the backward's, and both fit the region.
      CHECK(plan.workspace_before <= plan.workspace.arena_bytes);
      CHECK(plan.workspace_after <= plan.workspace.arena_bytes);
      CHECK(std::max(plan.workspace_before, plan.workspace_after) == plan.workspace.arena_bytes);
      for (const auto &[n, range] : plan.workspace.live) {
        INFO(n);
        CHECK((range.second < t.forward_steps || range.first >= t.forward_steps));
        const size_t top = plan.workspace.offset.at(n) + plan.workspace.size.at(n);
        CHECK(top <= (range.first < t.forward_steps ? plan.workspace_before : plan.workspace_after));
      }
      // The whole step's memory: less than the owned arena (which keeps every
      // output and gradient too).
      Schedule owned = sch;
      owned.reuse_memory(true);
      TrainingProgram o = lower_training(ex.pipeline, ex.pipeline.func(ex.output), owned);
      MemoryPlan arena = plan_memory(o.program, bytes, o.forward_steps);
      CHECK(plan.saved.arena_bytes + plan.workspace.arena_bytes <= arena.arena_bytes);
    }
}

TEST_CASE("step memory plan: a forward-only program keeps nothing; its workspace is all before no boundary") {
  ExampleShape s = shape_of(200);
  Example ex = make_example("swiglu_moe", s);
  KernelProgram p = lower(ex.pipeline, preset("scattermoe"));
  ProgramShapes shapes(p, s.tokens);
  StepMemoryPlan plan = plan_step_memory(
      p, [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); }, 0);
  CHECK(plan.saved.offset.empty());
  CHECK(plan.saved.arena_bytes == 0);
  CHECK(plan.workspace_before == 0);
  CHECK(plan.workspace_after == plan.workspace.arena_bytes);
  CHECK(plan.workspace.offset.count("y") == 0);
  check_disjoint(plan.workspace);
}

TEST_CASE("caller memory layout: the activations in one saved part, the few values a row and the tables in another") {
  // mixtral's shape at 8192 tokens: the two saved activations (h_rhs and
  // h_silu_in, T k f each) add up to one expert weight's gradient (E d f),
  // the blocks a model's freed gradients leave free at its next forward.
  const ExampleShape s = testing::shape(8192, 4096, 14336, 8, 2);
  const Example ex = make_example("swiglu_moe", s);
  const Func out = ex.pipeline.func(ex.output);
  const TrainingProgram t = lower_training(ex.pipeline, out, default_schedule(ex.pipeline, {out}));
  const ProgramShapes shapes(t.program, s.tokens);
  const CallerMemoryLayout l =
      caller_memory_layout(t.program, shapes, t.forward_steps, [](const RoutingShape &) { return size_t{5000}; });
  REQUIRE(l.memory.saved.size() == 2);
  CHECK(l.memory.saved[0] == size_t{8} * 4096 * 14336 * 2);
  CHECK(l.memory.saved[1] < (size_t{1} << 20)); // the allocator's small blocks
  // Every saved tensor (and a gradient written over one) within its part;
  // two tensors of one part overlap only where one is written over the other.
  std::map<size_t, std::vector<std::pair<size_t, size_t>>> spans;
  for (const auto &[name, at] : l.saved_at) {
    REQUIRE(at.first < 2);
    const size_t bytes = l.plan.saved.size.at(name);
    CHECK(at.second + bytes <= l.memory.saved[at.first]);
    CHECK((at.first == 0) == (bytes >= (size_t{1} << 20)));
    if (!l.plan.saved.written_over.count(name))
      spans[at.first].push_back({at.second, at.second + bytes});
  }
  for (auto &[part, list] : spans) {
    std::sort(list.begin(), list.end());
    for (size_t i = 1; i < list.size(); ++i)
      CHECK(list[i - 1].second <= list[i].first);
  }
  for (const auto &[over, under] : l.plan.saved.written_over)
    CHECK(l.saved_at.at(over) == l.saved_at.at(under));
  // The tables after the tail's tensors, in the last part.
  for (const auto &[r, offset] : l.table_offset)
    CHECK(offset + 5000 <= l.memory.saved[1]);
  // A forward alone saves nothing: the tables' part only.
  const KernelProgram forward = lower(ex.pipeline, preset("scattermoe"));
  const CallerMemoryLayout f = caller_memory_layout(forward, ProgramShapes(forward, s.tokens), 0,
                                                    [](const RoutingShape &) { return size_t{5000}; });
  CHECK(f.memory.saved == std::vector<size_t>{5120});
}
