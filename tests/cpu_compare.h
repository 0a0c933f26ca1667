// Shared by the CPU-backend tests: run a layer under a schedule on the CPU
// with poisoned (NaN) outputs, evaluate the Eigen reference in f64 on the same
// inputs, and compare every Func the program materialises.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "backends/cpu/cpu_layer.h"
#include "backends/reference/evaluate.h"
#include "examples/biased_moe.h"
#include "schedules/presets.h"

namespace moeforge::cpu_test {

inline double normalized_error(const HostTensor &a, const HostTensor &b) {
  REQUIRE(a.shape == b.shape);
  return max_normalized_error(a, b);
}

struct Outcome {
  double y_error = 0;
  double worst_error = 0; // over every materialised Func
  int routing_mismatches = 0;
  std::vector<int64_t> counts; // pairs per expert (the reference's routing)
};

inline Outcome run_and_compare(const Example &ex, const TensorMap &inputs, int64_t tokens, const Schedule &schedule,
                               double tolerance = 1e-2) {
  cpu::CompiledCpuLayer compiled = cpu::compile_cpu_layer(ex.pipeline, schedule);
  cpu::CpuLayer layer(compiled, tokens);
  layer.upload(inputs);
  layer.poison();
  layer.run();
  EvalResult ref = evaluate(ex.pipeline, inputs, Precision::f64);
  Outcome out;
  if (!ex.route.empty()) {
    const RoutingResult &rr = ref.routes.at(ex.route);
    std::vector<int32_t> got = layer.routed_experts(ex.route);
    REQUIRE(got.size() == rr.expert.size());
    for (size_t p = 0; p < rr.expert.size(); ++p)
      out.routing_mismatches += got[p] != rr.expert[p];
    out.counts = rr.expert_counts();
  }
  for (const auto &[name, value] : ref.values) {
    if (!compiled.program.find(name))
      continue; // not materialised under this schedule (o when the gate is fused)
    double err = normalized_error(layer.download(name), value);
    INFO("Func " << name << " under\n" << schedule.to_text());
    CHECK(err <= tolerance);
    out.worst_error = std::max(out.worst_error, err);
    if (name == ex.output)
      out.y_error = err;
  }
  return out;
}

inline ExampleShape shape(int64_t tokens, int64_t d, int64_t f, int64_t experts, int64_t k) {
  ExampleShape s;
  s.tokens = tokens;
  s.d = d;
  s.f = f;
  s.experts = experts;
  s.topk = k;
  return s;
}

} // namespace moeforge::cpu_test
