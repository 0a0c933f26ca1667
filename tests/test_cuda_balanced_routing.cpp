// The benchmarks' balanced routing (benchmarks/moe_shapes.h): the inputs it
// uploads make the router choose, for every token, exactly its balanced
// experts, so every expert gets T k / E rows. Checked on the host by
// computing the router's logits from what was uploaded. (test_cuda_: the
// benchmarks' header includes the CUDA backend's; no GPU is needed.)
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "benchmarks/moe_shapes.h"

using namespace moeforge;

namespace {

// What a device layer would receive: the last upload of each tensor
// (a repeated pattern is kept as given; the test reads x and wr only).
struct RecordingLayer {
  std::map<std::string, HostTensor> uploaded;
  void upload(const std::string &name, const HostTensor &t) { uploaded.insert_or_assign(name, t); }
  void upload_repeated(const std::string &name, const HostTensor &t) { uploaded.insert_or_assign(name, t); }
};

} // namespace

TEST_CASE("bench balanced routing: every token's top-k are its balanced experts, every expert T k / E rows") {
  for (int64_t k : {1, 2, 4}) {
    CAPTURE(k);
    const bench::MoeShape shape{"tiny", 96, 128, 32, 16, k, false, 0.0};
    REQUIRE(bench::balanced_routing_fits(shape));
    const Example ex = biased_moe(shape.example(), false, Bias::none);
    RecordingLayer layer;
    bench::upload_balanced_inputs(layer, ex, shape);
    const HostTensor &x = layer.uploaded.at("x"), &wr = layer.uploaded.at("wr");
    REQUIRE(x.shape == std::vector<int64_t>{shape.tokens, shape.d});
    // x past the routing columns is random, not a constant (the GEMMs'
    // power depends on the operands' bits).
    CHECK(x.at({0, shape.experts}) != x.at({1, shape.experts}));
    std::vector<int64_t> rows(shape.experts, 0);
    for (int64_t t = 0; t < shape.tokens; ++t) {
      std::vector<double> logit(shape.experts, 0.0);
      for (int64_t e = 0; e < shape.experts; ++e)
        for (int64_t i = 0; i < shape.d; ++i)
          logit[e] += x.at({t, i}) * wr.at({i, e});
      std::vector<int64_t> order(shape.experts);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int64_t a, int64_t b) { return logit[a] > logit[b]; });
      std::vector<int64_t> chosen(order.begin(), order.begin() + k), want;
      for (int64_t i = 0; i < k; ++i)
        want.push_back(bench::balanced_expert(t, i, k, shape.experts));
      std::sort(chosen.begin(), chosen.end());
      std::sort(want.begin(), want.end());
      CHECK(chosen == want);
      // The chosen logits clear the rest by a wide margin: no near-ties
      // for the GPU's bf16 logits to resolve otherwise.
      CHECK(logit[order[k - 1]] - (k < shape.experts ? logit[order[k]] : 0.0) > 32.0);
      for (int64_t e : chosen)
        ++rows[e];
    }
    for (int64_t e = 0; e < shape.experts; ++e)
      CHECK(rows[e] == shape.tokens * k / shape.experts);
  }
}
