// The CUDA backend's routing tables and a training layer's saved region
// over any token count (RoutingPlan::table_terms, caller_saved_terms,
// runtime/size_terms.h), as table_bytes and the layer's caller memory count
// them: the saved region's size at a symbolic count (host code, no GPU).
#include <doctest/doctest.h>

#include "backends/cuda/runtime/routing_kernels.h"
#include "backends/cuda/runtime/training_layer.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "runtime/memory_plan.h"
#include "runtime/program_shapes.h"
#include "runtime/size_terms.h"

using namespace moeforge;

TEST_CASE("cuda size terms: the routing tables over any token count, chunk counts at their bound") {
  for (int experts : {8, 64, 128, 256})
    for (int k : {1, 2, 8})
      for (int block : {64, 128, 256}) {
        RoutingShape s{1, experts, k, block};
        const std::optional<SizeTerms> terms = cuda::RoutingPlan::table_terms(s);
        REQUIRE(terms);
        for (int64_t t = 1; t <= 70000; t += t < 300 ? 1 : 997) {
          s.tokens = t;
          INFO(s.to_string());
          CHECK(size_at(*terms, t) == static_cast<int64_t>(cuda::RoutingPlan::table_bytes(s)));
          // Every count's chunks fit the table sized for the most.
          const int64_t chunk = cuda::routing_chunk_pairs(s);
          CHECK((s.pairs() + chunk - 1) / chunk <= cuda::routing_max_chunks(experts));
        }
      }
  RoutingShape dropping{100, 8, 2, 128};
  dropping.capacity = 30;
  CHECK_FALSE(cuda::RoutingPlan::table_terms(dropping));
}

TEST_CASE("cuda size terms: a training layer's saved parts over any token count, as the CUDA layer lays it out") {
  const ExampleShape s = testing::shape(37, 64, 128, 8, 2);
  for (const char *name : {"swiglu_moe", "moa"}) {
    INFO(name);
    const Example ex = make_example(name, s);
    const Func out = ex.pipeline.func(ex.output);
    const cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, out, default_schedule(ex.pipeline, {out}));
    const KernelProgram &p = c.training.program;
    const size_t boundary = c.training.forward_steps;
    const std::optional<std::vector<SizeTerms>> terms =
        caller_saved_terms(p, ProgramShapes(p, s.tokens), boundary, cuda::RoutingPlan::table_terms);
    REQUIRE(terms);
    for (int64_t n = 1; n <= 4200; n += n < 300 ? 1 : 293) {
      INFO(n << " tokens");
      const std::vector<size_t> parts =
          caller_memory_layout(p, ProgramShapes(p, n), boundary, cuda::RoutingPlan::table_bytes).memory.saved;
      REQUIRE(parts.size() == terms->size());
      for (size_t i = 0; i < parts.size(); ++i)
        CHECK(size_at((*terms)[i], n) == static_cast<int64_t>(parts[i]));
    }
  }
}
