// The skewed-routing inputs `moeforge tune` times each candidate under
// (examples/skewed_routing.h): the busiest expert at the asked multiple of
// the mean, made from the layer's own router, and a clear reason where the
// router is not one it can skew.
#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "examples/examples.h"
#include "examples/skewed_routing.h"
#include "layer_compare.h"

using namespace moeforge;

namespace {

// The busiest expert's pairs over the mean, top-k of x wr over every token.
double skew_of(const TensorMap &in, int64_t topk) {
  const HostTensor &x = in.at("x"), &wr = in.at("wr");
  const int64_t tokens = x.shape[0], d = x.shape[1], experts = wr.shape[1];
  std::vector<int64_t> count(experts, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<std::pair<double, int64_t>> l(experts);
    for (int64_t e = 0; e < experts; ++e) {
      double v = 0;
      for (int64_t i = 0; i < d; ++i)
        v += x.data[t * d + i] * wr.data[i * experts + e];
      l[e] = {-v, e};
    }
    std::sort(l.begin(), l.end());
    for (int64_t j = 0; j < topk; ++j)
      ++count[l[j].second];
  }
  return double(*std::max_element(count.begin(), count.end())) * double(experts) / double(tokens * topk);
}

} // namespace

TEST_CASE("skewed routing: a router bias ramp made from x and wr gives the busiest expert the skew asked for") {
  // 4096 tokens over 64 experts with k = 1: more tokens than a sample
  // would have held, and few pairs an expert (64), where a sample's noise
  // would have inflated the skew.
  for (const ExampleShape &s :
       {testing::shape(1024, 64, 64, 8, 1), testing::shape(1024, 64, 64, 8, 2), testing::shape(4096, 64, 64, 64, 1)}) {
    const int64_t topk = s.topk;
    INFO("T " << s.tokens << ", E " << s.experts << ", topk " << topk);
    const Example ex = make_example("moe_mlp", s);
    const TensorMap in = ex.random_inputs(s, 3);
    std::string why;
    const std::optional<SkewedInputs> skewed = skewed_router_inputs(in, topk, 2.5, &why);
    REQUIRE_MESSAGE(skewed.has_value(), why);
    CHECK(skewed->ramp > 0);
    // On every token, at the target within the bisection's step.
    TensorMap all = in;
    for (const auto &[name, t] : skewed->inputs)
      all.at(name) = t;
    CHECK(skewed->max_over_mean == doctest::Approx(skew_of(all, topk)));
    CHECK(skewed->max_over_mean >= 2.5);
    CHECK(skewed->max_over_mean < 3.0);
    CHECK(skew_of(in, topk) < 2.0); // the random router was not skewed to start with
    // Only x's feature 0 and wr's row 0 change.
    const HostTensor &x = skewed->inputs.at("x"), &wr = skewed->inputs.at("wr");
    for (int64_t t = 0; t < s.tokens; ++t) {
      CHECK(x.data[t * s.d] == 1.0);
      CHECK(x.data[t * s.d + 1] == in.at("x").data[t * s.d + 1]);
    }
    for (int64_t e = 0; e < s.experts; ++e)
      CHECK(wr.data[e] == doctest::Approx(skewed->ramp * double(e) / double(s.experts)));
    CHECK(skewed->inputs.size() == 2); // x and wr: the experts' weights are not copied
  }
}

TEST_CASE("skewed routing: a layer without the examples' router is refused with the reason") {
  const ExampleShape s = testing::shape(64, 64, 64, 8, 2);
  const Example dense = make_example("dense_mlp", s);
  std::string why;
  CHECK_FALSE(skewed_router_inputs(dense.random_inputs(s, 1), 2, 2.5, &why).has_value());
  CHECK(why == "the layer's router is not logits = x wr over x [T, d] and wr [d, E] with top-k below E");
  // top-k at E: every expert takes every token, nothing to skew.
  const Example moe = make_example("moe_mlp", s);
  CHECK_FALSE(skewed_router_inputs(moe.random_inputs(s, 1), 8, 2.5, &why).has_value());
}
