// runtime/size_terms.h: a layer's saved region over any token count, in
// the forms torch.compile's fake kernels evaluate at a symbolic count. Each
// size the terms give equals the one the runtime lays out, at every count.
#include <doctest/doctest.h>

#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/training.h"
#include "runtime/memory_plan.h"
#include "runtime/program_shapes.h"
#include "runtime/routing_format.h"
#include "runtime/size_terms.h"
#include "schedules/presets.h"
#include "strided_params.h"

using namespace moeforge;

namespace {

// Counts around every block and tile boundary of small routes, and a few
// real sizes.
std::vector<int64_t> counts() {
  std::vector<int64_t> c;
  for (int64_t t = 1; t <= 300; ++t)
    c.push_back(t);
  for (int64_t t : {511, 512, 513, 4095, 4096, 4097, 16383, 16384, 65537})
    c.push_back(t);
  return c;
}

size_t cpu_tables(const RoutingShape &s) { return routing_table_bytes(s); }
std::optional<SizeTerms> cpu_table_terms(const RoutingShape &s) {
  return routing_table_terms(s, static_cast<int64_t>(kRegionAlignment));
}

} // namespace

TEST_CASE("size terms: a factor is ((a T + b) / d) m + c; a term rounds its sum up to its alignment") {
  const SizeFactor padded = SizeFactor::padded_rows(2, 128, 8);
  CHECK(padded.at(1) == (1 + 8) * 128);
  CHECK(padded.at(64) == (1 + 8) * 128);
  CHECK(padded.at(65) == (2 + 8) * 128);
  CHECK(SizeFactor::tiles(8, 128, 64).at(16384) == 16384 * 8 / 128 + 64);
  const SizeTerm t{{{2, {SizeFactor::tokens(3)}}, {5, {}}}, 256};
  CHECK(t.at(1) == 256);
  CHECK(t.at(100) == 768); // 605 rounded up
  CHECK(size_at({t, t}, 100) == 1536);
}

TEST_CASE("size terms: a routing's tables over any token count, as routing_table_bytes counts them") {
  for (int experts : {8, 64, 128, 256})
    for (int k : {1, 2, 8})
      for (int block : {64, 128, 256}) {
        RoutingShape s{1, experts, k, block};
        const std::optional<SizeTerms> terms = routing_table_terms(s, 1);
        REQUIRE(terms);
        for (int64_t t : counts()) {
          s.tokens = t;
          INFO(s.to_string());
          CHECK(size_at(*terms, t) == static_cast<int64_t>(routing_table_bytes(s)));
          // Every array over the count against the shape's own counts at
          // t, the window (not in the tables' block) too.
          const RoutingShape one{1, experts, k, block};
          auto count = [&](RoutingArray a) { return routing_array_count(a, one).at(t); };
          CHECK(count(RoutingArray::pair_pos) == s.pairs());
          CHECK(count(RoutingArray::sorted_pair) == s.max_padded_rows());
          CHECK(count(RoutingArray::tile_expert) == s.max_tiles());
          CHECK(count(RoutingArray::window) == s.max_tiles() + 1);
        }
      }
  // A capacity makes the rows follow cf T k / E, not a form of the terms.
  RoutingShape dropping{100, 8, 2, 128};
  dropping.capacity = 30;
  CHECK_FALSE(routing_table_terms(dropping, 1));
}

TEST_CASE("size terms: a training layer's saved region over any token count, as caller memory lays it out") {
  struct Case {
    Example ex;
    Schedule schedule;
  };
  const ExampleShape s = testing::shape(37, 64, 128, 8, 2);
  std::vector<Case> cases;
  for (const char *name : {"moe_mlp", "swiglu_moe", "deepseek_moe", "moa"}) {
    const Example ex = make_example(name, s);
    cases.push_back({ex, default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)})});
    cases.push_back({ex, preset("scattermoe")});
  }
  Schedule lean = preset("scattermoe");
  lean.padded_elementwise(true).recompute_elementwise(true).gate_gradient_from_dh(true);
  cases.push_back({make_example("swiglu_moe", s), lean});
  const Example strided = testing::gate_up_swiglu(s);
  cases.push_back({strided, default_schedule(strided.pipeline, {strided.pipeline.func(strided.output)})});
  for (const Case &c : cases) {
    INFO(c.ex.name << " / " << c.schedule.to_text());
    const TrainingProgram t = lower_training(c.ex.pipeline, c.ex.pipeline.func(c.ex.output), c.schedule);
    const std::optional<std::vector<SizeTerms>> terms =
        caller_saved_terms(t.program, ProgramShapes(t.program, s.tokens), t.forward_steps, cpu_table_terms);
    REQUIRE(terms);
    for (int64_t n : counts()) {
      INFO(n << " tokens");
      const CallerMemoryLayout l =
          caller_memory_layout(t.program, ProgramShapes(t.program, n), t.forward_steps, cpu_tables);
      REQUIRE(l.memory.saved.size() == terms->size());
      for (size_t i = 0; i < terms->size(); ++i)
        CHECK(size_at((*terms)[i], n) == static_cast<int64_t>(l.memory.saved[i]));
    }
  }
}

TEST_CASE("size terms: a dropping route's saved region has none (its rows follow the capacity)") {
  const ExampleShape s = testing::shape(37, 64, 128, 8, 2);
  const Example ex = make_example("swiglu_moe", s);
  Schedule sch = preset("scattermoe");
  sch.capacity(1.25);
  const TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), sch);
  CHECK_FALSE(caller_saved_terms(t.program, ProgramShapes(t.program, s.tokens), t.forward_steps, cpu_table_terms));
}
