// The comparison every compiled backend's tests go through
// (layer_compare.h): a Func whose exact value is a cancellation is judged
// by how far bf16 rounding of the inputs moves it, and that spread stays far
// below the size of a real mistake.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "examples/examples.h"
#include "layer_compare.h"
#include "training_compare.h"

using namespace moeforge;

namespace {

// One token, renormalised top-2 gates, SwiGLU (the GPU edge case "one
// token"): the gate-sum gradient is one number, d_s(r) g(r) summed over
// the token's two pairs, small against the pairs' own gate gradients.
struct OneToken {
  ExampleShape s = testing::shape(1, 64, 64, 8, 2);
  Example ex = testing::training_example(biased_moe(s, true, Bias::none, true));
  TensorMap in;
  EvalResult ref;
  std::map<std::string, std::vector<int32_t>> given;
  explicit OneToken(uint64_t seed) {
    Example fwd = biased_moe(s, true, Bias::none, true);
    in = biased_inputs(fwd, s, Bias::none, seed);
    in["d_y"] = testing::upstream_gradient(fwd, in, 11);
    ref = evaluate(ex.pipeline, in, Precision::f64);
    given = {{ex.route, ref.routes.at(ex.route).expert}};
  }
};

double max_abs(const HostTensor &t) {
  double m = 0;
  for (double v : t.data)
    m = std::max(m, std::fabs(v));
  return m;
}

} // namespace

TEST_CASE("layer compare: a cancellation's rounding spread is nonzero and far below a mistake's size") {
  // Seed 26 gives a gate-sum gradient of ~2e-4 against gate gradients of
  // ~0.1: its own scale cannot judge a bf16 result, its spread can.
  for (uint64_t seed : {3, 26}) {
    OneToken c(seed);
    REQUIRE(c.in.count("d_y"));
    std::map<std::string, double> spread = testing::rounding_spread(c.ex.pipeline, c.in, c.given, c.ref);
    const double terms = max_abs(c.ref.values.at("d_route_gate"));
    const double sum = max_abs(c.ref.values.at("d_route_gate_sum"));
    INFO("seed " << seed << ": gate-sum gradient " << sum << ", gate gradients " << terms << ", spread "
                 << spread.at("d_route_gate_sum"));
    CHECK(spread.at("d_route_gate_sum") > 0);
    // The bar (kSpreadFactor x spread) stays under 5 % of the terms: dropping
    // one pair's term, a wrong sign or a factor of 2 lands outside it.
    CHECK(testing::kSpreadFactor * spread.at("d_route_gate_sum") < 0.05 * terms);
    // Every Func moves by rounding, and none by more than a few percent of its scale.
    for (const auto &[name, value] : c.ref.values) {
      INFO(name);
      CHECK(spread.at(name) <= 0.05 * std::max(max_abs(value), 1e-12) + 0.05 * terms);
    }
  }
}

TEST_CASE("layer compare: the upstream gradient takes the token count of the input over the output's tokens") {
  // Attention's tokens come in as q, k and v (no x): the gradient is (T, d).
  for (const char *name : {"attention", "swiglu_moe"}) {
    ExampleShape s = testing::shape(37, 64, 32, 8, 2);
    Example ex = make_example(name, s);
    HostTensor dy = testing::upstream_gradient(ex, ex.random_inputs(s, 1), 11);
    INFO(std::string(name));
    CHECK(dy.shape == std::vector<int64_t>{37, 64});
    CHECK(max_abs(dy) > 0);
  }
}
