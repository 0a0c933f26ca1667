// runtime/step_streams.h: steps that share no memory run on different
// streams; every pair that does stays ordered.
#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <sstream>

#include "benchmarks/train_schedule.h"
#include "examples/examples.h"
#include "lowering/training.h"
#include "runtime/memory_plan.h"
#include "runtime/program_shapes.h"
#include "runtime/step_streams.h"
#include "schedules/presets.h"

using namespace moeforge;

namespace {

// Tensor i of a test occupies bytes [1000 i, 1000 i + 1000).
ByteRange tensor(int i) { return {uint64_t(1000 * i), uint64_t(1000 * i + 1000)}; }

StepAccess step(std::vector<int> reads, std::vector<int> writes) {
  StepAccess a;
  for (int r : reads)
    a.reads.push_back(tensor(r));
  for (int w : writes)
    a.writes.push_back(tensor(w));
  return a;
}

// Every conflicting pair ordered, waits only on earlier steps of other
// streams that record, joins cover every stream's last step.
void check_plan(const std::vector<StepAccess> &steps, const StreamPlan &plan, int max_streams) {
  REQUIRE(plan.steps.size() == steps.size());
  CHECK(plan.streams >= 1);
  CHECK(plan.streams <= max_streams);
  for (size_t j = 0; j < steps.size(); ++j) {
    const StreamPlan::Placement &p = plan.steps[j];
    CHECK(p.stream >= 0);
    CHECK(p.stream < plan.streams);
    for (size_t w : p.waits) {
      CHECK(w < j);
      CHECK(plan.steps[w].stream != p.stream);
      CHECK(plan.steps[w].record);
    }
    for (size_t i = 0; i < j; ++i)
      if (steps_conflict(steps[i], steps[j])) {
        INFO("steps " << i << " and " << j);
        CHECK(ordered_before(plan, i, j));
      }
  }
  // After the joins the caller's stream has every step behind it: each other
  // stream's last step is joined or already ordered before stream 0's last.
  for (int s = 1; s < plan.streams; ++s) {
    size_t last = 0;
    for (size_t j = 0; j < steps.size(); ++j)
      if (plan.steps[j].stream == s)
        last = j;
    bool joined = std::find(plan.joins.begin(), plan.joins.end(), last) != plan.joins.end();
    size_t last0 = 0;
    for (size_t j = 0; j < steps.size(); ++j)
      if (plan.steps[j].stream == 0)
        last0 = j;
    INFO("stream " << s);
    CHECK((joined || ordered_before(plan, last, last0)));
  }
}

} // namespace

TEST_CASE("step streams: a chain stays on one stream; independent steps go side by side") {
  // 0 -> 1 -> 2, each reading the one before.
  std::vector<StepAccess> chain{step({}, {1}), step({1}, {2}), step({2}, {3})};
  StreamPlan p = plan_streams(chain, 4);
  check_plan(chain, p, 4);
  CHECK(p.streams == 1);
  CHECK(p.joins.empty());
  for (const auto &s : p.steps)
    CHECK(s.waits.empty());

  // A diamond: 1 and 2 both read 0's output, 3 reads both.
  std::vector<StepAccess> diamond{step({}, {1}), step({1}, {2}), step({1}, {3}), step({2, 3}, {4})};
  p = plan_streams(diamond, 4);
  check_plan(diamond, p, 4);
  CHECK(p.streams == 2);
  CHECK(p.steps[1].stream != p.steps[2].stream);
  CHECK(p.steps[3].waits.size() == 1);

  // One stream allowed: program order, no waits.
  p = plan_streams(diamond, 1);
  check_plan(diamond, p, 1);
  for (const auto &s : p.steps) {
    CHECK(s.stream == 0);
    CHECK(s.waits.empty());
  }
}

TEST_CASE("step streams: shared bytes, write-after-read and barriers order steps") {
  // Tensors 5 and 6 as two names for overlapping bytes (memory reused by
  // lifetime): a later write to one waits for a read of the other.
  StepAccess read_a = step({1}, {2});
  StepAccess write_b;
  write_b.writes.push_back({1500, 2500}); // overlaps tensor 1's bytes
  CHECK(steps_conflict(read_a, write_b));
  CHECK_FALSE(steps_conflict(step({1}, {2}), step({1}, {3}))); // two readers
  CHECK(steps_conflict(step({}, {2}), step({}, {2})));         // two writers
  // A barrier (a routing step) orders against steps that touch nothing it does.
  StepAccess barrier;
  barrier.barrier = true;
  std::vector<StepAccess> steps{step({}, {1}), barrier, step({}, {2}), step({}, {3})};
  StreamPlan p = plan_streams(steps, 3);
  check_plan(steps, p, 3);
  CHECK(ordered_before(p, 0, 1));
  CHECK(ordered_before(p, 1, 2));
  CHECK(ordered_before(p, 1, 3));
  CHECK(p.steps[2].stream != p.steps[3].stream); // after the barrier, independent again
  // Empty ranges touch nothing.
  StepAccess empty;
  empty.writes.push_back({1000, 1000});
  CHECK_FALSE(steps_conflict(step({1}, {}), empty));
}

TEST_CASE("step streams: random programs keep every conflict ordered") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + int(rng() % 30), tensors = 2 + int(rng() % 10), max_streams = 1 + int(rng() % 4);
    std::vector<StepAccess> steps;
    for (int j = 0; j < n; ++j) {
      StepAccess a;
      for (int r = int(rng() % 3); r > 0; --r)
        a.reads.push_back(tensor(int(rng() % tensors)));
      for (int w = int(rng() % 3); w > 0; --w) {
        // Sometimes a range straddling two tensors (reused memory).
        const int t = int(rng() % tensors);
        a.writes.push_back(rng() % 5 ? tensor(t) : ByteRange{uint64_t(1000 * t + 500), uint64_t(1000 * t + 1500)});
      }
      a.barrier = rng() % 20 == 0;
      steps.push_back(std::move(a));
    }
    INFO("trial " << trial);
    check_plan(steps, plan_streams(steps, max_streams), max_streams);
  }
}

TEST_CASE("step streams: a SwiGLU training backward's weight gradients run beside its input gradient") {
  ExampleShape s;
  s.tokens = 300;
  s.d = 64;
  s.f = 128;
  s.experts = 8;
  s.topk = 2;
  Example ex = make_example("swiglu_moe", s);
  // The training benchmark's schedule (reuse_memory on), its lean mode, and
  // a preset with and without reuse_memory.
  for (int mode = 0; mode < 4; ++mode) {
    Schedule sch = mode < 2 ? bench::tuned_wide(true) : preset("scattermoe");
    if (mode == 1)
      sch.recompute_elementwise(true).gate_gradient_from_dh(true);
    sch.reuse_memory(mode != 3).concurrent_steps(true);
    INFO("mode " << mode);
    TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), sch);
    ProgramShapes shapes(t.program, s.tokens);
    auto bytes = [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); };
    // Addresses as the runtime hands them out: the memory plan's offsets
    // under reuse_memory, a range of its own for every other tensor.
    std::map<std::string, ByteRange> at;
    REQUIRE(t.program.concurrent_steps);
    CHECK(Schedule::from_text(sch.to_text()).concurrent_steps());
    // As the CUDA layer places memory: tensors of steps that may overlap
    // apart.
    StepOrder order(t.program, {t.forward_steps}, kMaxStepStreams);
    MemoryPlan plan = plan_memory(t.program, bytes, t.forward_steps, 256, &order);
    MemoryPlan sequential = plan_memory(t.program, bytes, t.forward_steps);
    // Less sharing than in program order, still less than none.
    CHECK(plan.arena_bytes >= sequential.arena_bytes);
    CHECK(plan.arena_bytes <= plan.separate_bytes);
    uint64_t next = uint64_t(1) << 40;
    for (const TensorDecl &d : t.program.tensors) {
      if (t.program.reuse_memory && plan.offset.count(d.name)) {
        at[d.name] = {plan.offset.at(d.name), plan.offset.at(d.name) + bytes(d)};
      } else {
        at[d.name] = {next, next + bytes(d)};
        next += bytes(d) + 256;
      }
    }
    std::vector<StepAccess> acc = step_accesses(t.program, t.forward_steps, t.program.steps.size(),
                                                [&](const std::string &n) { return at.at(n); });
    StreamPlan p = plan_streams(acc, kMaxStepStreams);
    check_plan(acc, p, kMaxStepStreams);
    std::ostringstream placed;
    for (size_t i = 0; i < acc.size(); ++i) {
      placed << step_name(t.program.steps[t.forward_steps + i]) << ": stream " << p.steps[i].stream << " deps";
      for (size_t q = 0; q < i; ++q)
        if (steps_conflict(acc[q], acc[i]))
          placed << " " << step_name(t.program.steps[t.forward_steps + q]);
      placed << "\n";
    }
    INFO(placed.str());
    auto index_of = [&](const std::string &out) {
      for (size_t i = t.forward_steps; i < t.program.steps.size(); ++i)
        if (step_output(t.program.steps[i]) == out)
          return i - t.forward_steps;
      FAIL("no step writes " << out);
      return size_t(0);
    };
    // The expert weights' gradients need no part of x's, nor x's theirs: the
    // GEMMs making them can fill each other's last waves.
    const size_t dx = index_of(t.gradient_of("x"));
    for (const char *w : {"w1", "w2", "w3"}) {
      INFO(w);
      const size_t dw = index_of(t.gradient_of(w));
      CHECK_FALSE(ordered_before(p, dw, dx));
      CHECK_FALSE(ordered_before(p, dx, dw));
    }
  }
}
