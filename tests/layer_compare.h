// Shared by the compiled backends' tests (CPU and CUDA): the MoE edge cases
// and the comparison of a finished layer with the float64 Eigen reference,
// Func by Func, after its outputs were poisoned with NaN.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends/reference/evaluate.h"
#include "examples/biased_moe.h"
#include "lowering/kernel_program.h"

namespace moeforge::testing {

inline ExampleShape shape(int64_t tokens, int64_t d, int64_t f, int64_t experts, int64_t k) {
  ExampleShape s;
  s.tokens = tokens;
  s.d = d;
  s.f = f;
  s.experts = experts;
  s.topk = k;
  return s;
}

struct Outcome {
  double y_error = 0;
  double worst_error = 0;      // over every materialised Func
  int routing_mismatches = 0;  // pairs routed differently, not at a near-tie
  int near_ties = 0;           // pairs routed differently at a near-tie (then compared under the layer's routing)
  std::vector<int64_t> counts; // pairs per expert (the reference's routing)
};

// Every Func the program materialises against the reference (normalised max
// error <= tolerance), and the experts the layer chose against the
// reference's. Layer: cpu::CpuLayer or cuda::CudaLayer, after a run.
// Two selection scores within this fraction of the row's largest are a tie
// that rounding may break either way: bf16 keeps 8 bits (2^-8 = 0.4 %).
inline constexpr double kNearTie = 1e-2;

inline const RoutingNode &route_node(const Pipeline &p, const std::string &name) {
  for (const RoutingPtr &r : p.routes())
    if (r->name == name)
      return *r;
  FAIL("no route named " << name);
  throw std::logic_error("unreachable");
}

// How far each Func of `p` moves when every input element moves by bf16's
// rounding (its largest relative error 2^-9, random sign; two draws, the
// larger move kept), the routing held as `given`: the spread a correct bf16
// computation can honestly land in. A Func whose exact value is a cancellation (one token's
// gate-sum gradient, a difference of two nearly equal products) is small
// against its own terms, so its error relative to itself says nothing about
// the kernel; its error against this spread does. A wrong kernel (a missed
// term, a wrong sign or factor) is off by the terms' size, far outside it.
inline std::map<std::string, double> rounding_spread(const Pipeline &p, const TensorMap &inputs,
                                                     const EvalOptions &given, const EvalResult &ref) {
  std::map<std::string, double> spread;
  for (uint64_t draw = 1; draw <= 2; ++draw) {
    TensorMap moved = inputs;
    std::mt19937_64 rng(draw);
    for (auto &[name, t] : moved)
      for (double &v : t.data)
        v *= (rng() & 1) ? 1 + 0x1p-9 : 1 - 0x1p-9;
    EvalResult r = evaluate(p, moved, Precision::f64, given);
    for (const auto &[name, value] : ref.values) {
      const HostTensor &m = r.values.at(name);
      double worst = 0;
      for (size_t i = 0; i < value.data.size(); ++i)
        worst = std::max(worst, std::fabs(m.data[i] - value.data[i]));
      spread[name] = std::max(spread[name], worst);
    }
  }
  return spread;
}

// An error within this many times the rounding spread passes: a backend
// rounds at several stages (inputs, h, dy's copies, u), each up to 2^-9.
inline constexpr double kSpreadFactor = 4;

// `t` (Func `name`'s values) with the rows of pairs the route dropped at
// capacity zeroed: their values are the algebra's in the reference and
// whatever sits in the drop row in a layer, and nothing reads them.
inline HostTensor without_dropped(const Example &ex, const EvalResult &ref, const std::string &name, HostTensor t) {
  if (ex.route.empty())
    return t;
  const RoutingResult &rr = ref.routes.at(ex.route);
  const auto &args = ex.pipeline.func(name).args();
  if (rr.kept.empty() || args.empty() || !args[0].dim().same_as(route_node(ex.pipeline, ex.route).pairs))
    return t;
  const size_t row = t.data.size() / rr.kept.size();
  for (size_t r = 0; r < rr.kept.size(); ++r)
    if (!rr.kept[r])
      std::fill_n(t.data.begin() + static_cast<int64_t>(r * row), row, 0.0);
  return t;
}

template <typename Layer>
Outcome compare_with_reference(const Example &ex, const TensorMap &inputs, const KernelProgram &program,
                               const Layer &layer, const std::string &schedule_text, double tolerance,
                               double floor_fraction = 0, double capacity_factor = 0,
                               const std::map<std::string, Fp8Format> &fp8 = {}) {
  EvalOptions options; // the schedule's capacity, as the layer drops; its FP8 operands, as the layer rounds
  options.capacity_factor = capacity_factor;
  options.fp8 = fp8;
  EvalResult ref = evaluate(ex.pipeline, inputs, Precision::f64, options);
  // A Func whose exact value is zero (a gradient the algebra cancels, such as
  // the router's when renormalised gates make the output independent of it)
  // is compared against a floor: floor_fraction of the largest output.
  double floor = 0;
  for (const Func &o : ex.pipeline.outputs())
    for (double v : ref.values.at(o.name()).data)
      floor = std::max(floor, floor_fraction * std::fabs(v));
  Outcome out;
  EvalOptions given = options;          // the routing the comparison holds
  std::map<std::string, double> spread; // made when a Func first needs it
  if (!ex.route.empty()) {
    const RoutingResult &rr = ref.routes.at(ex.route);
    std::vector<int32_t> got = layer.routed_experts(ex.route);
    REQUIRE(got.size() == rr.expert.size());
    out.counts = rr.expert_counts();
    // A pair the layer routed elsewhere is a near-tie when the two experts'
    // selection scores are within what bf16 storage of the router's inputs
    // moves them (a normalised input, say); the layer is then checked
    // against the reference under its own routing. Any other is a mismatch.
    const RoutingNode &node = route_node(ex.pipeline, ex.route);
    const HostTensor &score = ref.values.at(node.probs->name);
    REQUIRE(score.rank() == 2);
    const int64_t E = score.shape[1];
    for (size_t p = 0; p < rr.expert.size(); ++p) {
      if (got[p] == rr.expert[p])
        continue;
      const int64_t t = rr.token[p];
      double row_max = 0;
      for (int64_t e = 0; e < E; ++e)
        row_max = std::max(row_max, std::fabs(score.data[t * E + e]));
      const bool in_range = got[p] >= 0 && got[p] < E;
      const double gap = in_range ? std::fabs(score.data[t * E + rr.expert[p]] - score.data[t * E + got[p]]) : 1e300;
      if (gap <= kNearTie * row_max)
        ++out.near_ties;
      else
        ++out.routing_mismatches;
    }
    given.given = {{ex.route, out.near_ties && !out.routing_mismatches ? got : rr.expert}};
    if (out.near_ties && !out.routing_mismatches) {
      INFO(out.near_ties << " pairs routed the other way at near-ties: comparing under the layer's routing");
      ref = evaluate(ex.pipeline, inputs, Precision::f64, given);
    }
  }
  for (const auto &[name, value] : ref.values) {
    if (!program.find(name))
      continue; // not materialised under this schedule (o when the gate is fused)
    const auto &outs = ex.pipeline.outputs();
    if (program.reuse_memory && std::none_of(outs.begin(), outs.end(), [&](const Func &o) { return o.name() == name; }))
      continue; // an intermediate whose memory later steps reuse: only outputs and gradients survive
    HostTensor got = layer.download(name);
    REQUIRE(got.shape == value.shape);
    double err = max_normalized_error(without_dropped(ex, ref, name, got), without_dropped(ex, ref, name, value));
    double scale = 0;
    for (double v : value.data)
      scale = std::max(scale, std::fabs(v));
    if (scale < floor)
      err *= scale / floor; // the error relative to the floor instead
    std::string spread_note;
    if (err > tolerance) {
      if (spread.empty())
        spread = rounding_spread(ex.pipeline, inputs, given, ref);
      const double abs_err = err * std::max(scale, floor);
      spread_note = "max |error| " + std::to_string(abs_err) + ", rounding spread " + std::to_string(spread.at(name));
      if (abs_err <= kSpreadFactor * spread.at(name))
        err = tolerance; // a cancellation judged by its spread; worst_error shows it at the bar
    }

    INFO("Func " << name << " under\n" << schedule_text);
    INFO(spread_note);
    CHECK(err <= tolerance);
    out.worst_error = std::max(out.worst_error, err);
    if (name == ex.output)
      out.y_error = err;
  }
  return out;
}

// The MoE edge cases every compiled backend runs, at widths d and f.
struct EdgeCase {
  const char *what;
  ExampleShape s;
  Bias bias;
  bool swiglu;
};

inline std::vector<EdgeCase> edge_cases(int64_t d, int64_t f) {
  return {
      {"an expert with no tokens", shape(256, d, f, 8, 2), Bias::last_empty, false},
      {"every token on one expert (k = 1)", shape(300, d, d, 8, 1), Bias::all_to_first, true},
      {"T not a multiple of the block", shape(333, d, f, 8, 2), Bias::none, true},
      {"T smaller than one block", shape(5, d, d, 8, 2), Bias::none, false},
      {"one token", shape(1, d, d, 8, 2), Bias::none, true},
      {"k = E", shape(100, d, d, 8, 8), Bias::none, true},
      {"skewed routing", shape(512, d, f, 16, 2), Bias::ramp, false},
  };
}

// What each edge case promises about the reference's routing.
inline void check_edge_routing(const EdgeCase &c, const Outcome &o) {
  if (c.bias == Bias::last_empty)
    CHECK(o.counts.back() == 0);
  if (c.bias == Bias::all_to_first)
    CHECK(o.counts.front() == c.s.tokens);
  if (c.bias == Bias::ramp)
    CHECK(*std::max_element(o.counts.begin(), o.counts.end()) >= 2 * c.s.tokens * c.s.topk / c.s.experts);
}

// Every edge case at widths d and f under every named preset, through
// `run(example, inputs, tokens, preset name) -> Outcome` of one backend.
template <typename Run> void check_edge_cases(int64_t d, int64_t f, const std::vector<std::string> &presets, Run run) {
  for (const EdgeCase &c : edge_cases(d, f))
    for (const std::string &p : presets) {
      Example ex = biased_moe(c.s, c.swiglu, c.bias, c.swiglu);
      TensorMap in = biased_inputs(ex, c.s, c.bias, 3);
      // Before the run, so its own checks name the case too; a string, since
      // doctest prints a captured const char * as an address.
      const std::string what = std::string(c.what) + " / " + p;
      INFO(what);
      Outcome o = run(ex, in, c.s.tokens, p);
      CHECK(o.routing_mismatches == 0);
      CHECK(o.y_error <= 1e-2);
      check_edge_routing(c, o);
    }
}

} // namespace moeforge::testing
