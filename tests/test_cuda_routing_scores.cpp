// A routing score that is NaN or infinite on the GPU
// (backends/cuda/runtime/routing_score_check.h): the top-k kernels keep
// every expert in range, make the token's gates NaN and report the lowest
// (route, token, expert); the layers raise it as a UserError at their next
// entry point, or after a synchronous call's wait. The key's encoding and
// the message are checked everywhere; the kernels and layers on a GPU.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backends/backends.h"
#include "backends/cuda/runtime/routing_kernels.h"
#include "backends/cuda/runtime/routing_score_check.h"
#include "backends/cuda/runtime/training_layer.h"
#include "examples/examples.h"
#include "gpu_test.h"
#include "host_softmax.h"
#include "lowering/default_schedule.h"
#include "runtime/routing_host.h"
#include "schedules/presets.h"
#include "training_compare.h"
#include "user_error.h"

using namespace moeforge;
using namespace moeforge::testing;

namespace {
bool contains(const std::string &s, const std::string &part) { return s.find(part) != std::string::npos; }
} // namespace

TEST_CASE("routing scores: the key the kernels keep names the route, the token and the expert") {
  const uint64_t key = cuda::routing_route_tag(2) | (uint64_t(1234567) << 8) | 255;
  const cuda::NonFiniteScore s = cuda::decode_non_finite_score(key);
  CHECK(s.route == 2);
  CHECK(s.token == 1234567);
  CHECK(s.expert == 255);
  // The lowest key is the first route's first token's lowest expert.
  CHECK(cuda::routing_route_tag(0) < cuda::routing_route_tag(1));
  CHECK((cuda::routing_route_tag(0) | (uint64_t(7) << 8) | 255) < (cuda::routing_route_tag(0) | (uint64_t(8) << 8)));
  const std::string m = cuda::non_finite_score_message(s, {"first", "second", "attention"}, "forward()");
  CHECK(contains(m, "top_k (route attention): the routing score of token 1234567, expert 255 is NaN or infinite"));
  CHECK(contains(m, "seen at forward()"));
  CHECK(contains(m, "the router's inputs or weights"));
  // A route index the layer does not have is left out, not printed wrong.
  CHECK(contains(cuda::non_finite_score_message(s, {}, "run()"), "top_k: the routing score of token 1234567"));
  CHECK_THROWS(cuda::routing_route_tag(256));
}

TEST_SUITE("gpu") {

  TEST_CASE("cuda gpu: a NaN or infinite routing score is reported, its gates NaN, every expert in range") {
    MOEFORGE_REQUIRE_GPU();
    cuda::Device device;
    cuda::DeviceRouting routing(device);
    cuda::Stream stream;
    cuda::RoutingScoreCheck check;
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    // One shape per top-k kernel (E <= 32, 64, 128, 256), one group-limited,
    // and two of a few tokens, routed in one block (a warp per token: with
    // 8 or 64 experts a lane holds 1 or 2 columns, fewer than k = 2 or 8).
    struct Case {
      RoutingShape shape;
      bool softmax;
    };
    const std::vector<Case> cases = {{{300, 8, 2, 64}, true},         {{300, 64, 8, 128}, false},
                                     {{1000, 128, 8, 128}, true},     {{257, 256, 4, 128}, false},
                                     {{200, 16, 4, 64, 4, 2}, false}, {{16, 8, 2, 64}, true},
                                     {{16, 64, 8, 128}, false}};
    for (const Case &c : cases) {
      const RoutingShape &s = c.shape;
      CAPTURE(s.to_string());
      CAPTURE(c.softmax);
      std::vector<float> scores(static_cast<size_t>(s.tokens * s.experts));
      for (float &v : scores)
        v = normal(rng);
      // Token 37's expert E-1 is NaN; token 11's expert 3 is +inf (its
      // softmax is NaN there); the lower token is the one reported. Every
      // score of a third token is NaN (a NaN in the router's input).
      const int64_t first_token = std::min<int64_t>(11, s.tokens / 4);
      const int64_t second_token = std::min<int64_t>(37, s.tokens / 2), all_nan_token = s.tokens * 3 / 4;
      scores[static_cast<size_t>(second_token * s.experts + s.experts - 1)] = nan;
      scores[static_cast<size_t>(first_token * s.experts + 3)] = inf;
      for (int e = 0; e < s.experts; ++e)
        scores[static_cast<size_t>(all_nan_token * s.experts + e)] = nan;
      if (!c.softmax) // a raw score of -inf chooses nothing either (a softmax makes it a probability of 0)
        scores[static_cast<size_t>((s.tokens - 1) * s.experts)] = -inf;
      cuda::DeviceBuffer d_scores = cuda::DeviceBuffer::from(scores);
      cuda::DeviceBuffer d_gate(static_cast<size_t>(s.pairs()) * sizeof(float));
      cuda::RoutingPlan plan(s);
      CHECK(plan.one_block == (s.tokens <= 16));
      plan.poison(cuda::kPoisonNaN);
      d_gate.fill32(cuda::kPoisonNaN);
      CHECK_FALSE(check.raised());
      routing.run(d_scores.ptr(), plan, stream, c.softmax, d_gate.ptr(), false,
                  {check.first_bad(), check.seen(), cuda::routing_route_tag(1)});
      stream.synchronize();
      const RoutingTables tables = plan.download();
      for (int32_t e : tables.expert)
        CHECK((e >= 0 && e < s.experts));
      CHECK(verify_routing_tables(s, tables).empty());
      // The bad tokens' gates are NaN; every other token routes as the host
      // does (its own row is finite) with its gates.
      std::vector<float> clean = scores;
      std::vector<bool> bad(static_cast<size_t>(s.tokens), false);
      bad[first_token] = bad[second_token] = bad[all_nan_token] = true;
      if (!c.softmax)
        bad[static_cast<size_t>(s.tokens - 1)] = true;
      for (int64_t t = 0; t < s.tokens; ++t)
        if (bad[static_cast<size_t>(t)])
          for (int e = 0; e < s.experts; ++e)
            clean[static_cast<size_t>(t * s.experts + e)] = 0.0f;
      const HostTopK want = top_k_on_host(s, c.softmax ? host_softmax(clean, s) : clean);
      const std::vector<float> gate = d_gate.download<float>();
      int wrong = 0;
      for (int64_t r = 0; r < s.pairs(); ++r) {
        const size_t i = static_cast<size_t>(r);
        if (bad[static_cast<size_t>(r / s.k)])
          wrong += !std::isnan(gate[i]);
        else
          wrong += tables.expert[i] != want.expert[i] ||
                   !(std::fabs(gate[i] - want.gate[i]) <= 1e-5f + 1e-5f * std::fabs(want.gate[i]));
      }
      CHECK(wrong == 0);
      // Reported: the lowest key, then cleared.
      REQUIRE(check.raised());
      const std::string m = user_error_of([&] { check.throw_if_raised(stream, {"r0", "router"}, "a test"); });
      CHECK_MESSAGE(contains(m, "(route router): the routing score of token " + std::to_string(first_token) +
                                    ", expert 3 is NaN or infinite"),
                    m);
      CHECK_FALSE(check.raised());
      // A finite routing reports nothing.
      for (int64_t t = 0; t < s.tokens; ++t)
        for (int e = 0; e < s.experts; ++e)
          if (!std::isfinite(scores[static_cast<size_t>(t * s.experts + e)]))
            scores[static_cast<size_t>(t * s.experts + e)] = 0.5f;
      d_scores = cuda::DeviceBuffer::from(scores);
      routing.run(d_scores.ptr(), plan, stream, c.softmax, d_gate.ptr(), false,
                  {check.first_bad(), check.seen(), cuda::routing_route_tag(1)});
      stream.synchronize();
      CHECK_FALSE(check.raised());
    }
  }

  TEST_CASE("cuda gpu: a layer raises a NaN routing score at run() and at the next forward(), then runs clean") {
    MOEFORGE_REQUIRE_GPU();
    std::unique_ptr<Backend> backend = make_backend("cuda");
    const ExampleShape s = shape(96, 32, 64, 8, 2);
    const Example ex = make_example("swiglu_moe", s);
    TensorMap inputs = ex.random_inputs(s, 3);
    TensorMap poisoned = inputs;
    HostTensor &x = poisoned.at("x");
    x.data[static_cast<size_t>(7 * 32 + 5)] = std::numeric_limits<double>::quiet_NaN(); // token 7's logits: all NaN

    // The backend's run() waits for its work, so it raises at once.
    std::unique_ptr<Layer> layer = backend->layer(ex.pipeline, preset("scattermoe"), s.tokens);
    layer->upload(poisoned);
    const std::string m = user_error_of([&] { layer->run(); });
    CHECK_MESSAGE(contains(m, "the routing score of token 7, expert 0 is NaN or infinite"), m);
    CHECK_MESSAGE(contains(m, "seen at run()"), m);
    // Cleared: the same layer on clean input matches the reference.
    layer->upload(inputs);
    layer->poison();
    layer->run();
    CHECK(compare_with_reference(ex, inputs, layer->program(), *layer, "scattermoe", 1e-2).routing_mismatches == 0);

    // A training layer queues its forward without waiting: the next entry
    // point raises what the last one routed.
    cuda::Device device;
    const cuda::CompiledTraining compiled =
        cuda::compile_training(ex.pipeline, {ex.pipeline.func(ex.output)}, default_schedule(ex.pipeline));
    cuda::TrainingLayer training(device, compiled, s.tokens);
    training.upload(poisoned);
    cuda::Stream stream;
    training.forward(stream); // queued; nothing seen yet
    stream.synchronize();
    const std::string f = user_error_of([&] { training.forward(stream); });
    CHECK_MESSAGE(contains(f, "token 7, expert 0"), f);
    CHECK_MESSAGE(contains(f, "seen at forward()"), f);
    training.upload(inputs);
    training.forward(stream);
    stream.synchronize();
    training.check_routing_scores(stream, "a test"); // nothing: clean
  }

  TEST_CASE("cuda gpu: a NaN in DeepSeek's selection-only bias is raised, not routed around") {
    MOEFORGE_REQUIRE_GPU();
    std::unique_ptr<Backend> backend = make_backend("cuda");
    const ExampleShape s = shape(64, 32, 64, 16, 4);
    const Example ex = make_example("deepseek_moe", s);
    TensorMap inputs = ex.random_inputs(s, 4);
    inputs.at("bias").data[5] = std::numeric_limits<double>::quiet_NaN();
    std::unique_ptr<Layer> layer = backend->layer(ex.pipeline, preset("scattermoe"), s.tokens);
    layer->upload(inputs);
    const std::string m = user_error_of([&] { layer->run(); });
    CHECK_MESSAGE(contains(m, "the routing score of token 0, expert 5 is NaN or infinite"), m);
  }
}
