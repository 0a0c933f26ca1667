// expert_choice_moe: each expert takes its top C tokens (expert_choice(),
// dsl/capacity.h). The reference against loops written from the math and
// float64 finite differences of every gradient (the compiled backends:
// test_cpu_capacity.cpp, test_cuda_capacity.cpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>

#include "autodiff_check.h"
#include "dsl/ops.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "moe_loops.h"
#include "user_error.h"

using namespace moeforge;

namespace {

// Expert e takes the C tokens of largest probs(t, e), ties to the earlier
// token, gate probs(t, e): the routing as the paper states it.
loops::Routing expert_choice_by_hand(const HostTensor &probs, int64_t capacity) {
  const int64_t T = probs.shape[0], E = probs.shape[1];
  loops::Routing r;
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> tokens(static_cast<size_t>(T));
    std::iota(tokens.begin(), tokens.end(), 0);
    std::stable_sort(tokens.begin(), tokens.end(), [&](int64_t a, int64_t b) {
      return probs.at({a, e}) > probs.at({b, e});
    });
    for (int64_t i = 0; i < std::min(capacity, T); ++i) {
      r.token.push_back(static_cast<int32_t>(tokens[i]));
      r.expert.push_back(static_cast<int32_t>(e));
      r.gate.push_back(probs.at({tokens[i], e}));
    }
  }
  return r;
}

} // namespace

TEST_CASE("expert_choice_moe: the reference matches loops written from the math") {
  for (int64_t cf : {1, 2}) {
    ExampleShape s = testing::shape(40, 16, 24, 4, cf);
    Example ex = make_example("expert_choice_moe", s);
    TensorMap in = ex.random_inputs(s, 21);
    EvalResult ref = evaluate(ex.pipeline, in, Precision::f64);
    const HostTensor probs = loops::softmax_rows(loops::matmul(in.at("x"), in.at("wr")));
    const int64_t C = (cf * s.tokens + s.experts - 1) / s.experts;
    loops::Routing r = expert_choice_by_hand(probs, C);
    loops::MoeLoops want = loops::moe(in.at("x"), r, in.at("w1"), in.at("w2"));
    loops::check_close(ref["y"], want.y, 1e-12, "y");
    // Every expert holds exactly C tokens; some token got none or several.
    const RoutingResult &rr = ref.routes.at(ex.route);
    CHECK(rr.expert_counts() == std::vector<int64_t>(4, C));
    CHECK(rr.dropped() == s.tokens * s.experts - s.experts * C);
    std::vector<int> per_token(static_cast<size_t>(s.tokens), 0);
    for (int32_t t : r.token)
      ++per_token[t];
    CHECK(*std::max_element(per_token.begin(), per_token.end()) >= 2);
    if (cf == 1)
      CHECK(*std::min_element(per_token.begin(), per_token.end()) == 0);
  }
}

TEST_CASE("expert_choice_moe: float64 finite differences of every gradient") {
  ExampleShape s = testing::finite_difference_shape(); // cf = topk = 2: C = 3 of 6 tokens
  Example ex = make_example("expert_choice_moe", s);
  auto r = testing::check_gradients(ex.pipeline, ex.pipeline.func(ex.output), testing::example_inputs(ex, s, 11),
                                    {"x", "wr", "w1", "w2"}, 5, 24);
  MESSAGE("expert_choice_moe: " << r.checked << " checked, " << r.skipped << " skipped (routing flipped)");
  CHECK(r.checked >= 3 * r.attempted / 4);
  CHECK(r.worst <= 1e-6);
}

TEST_CASE("expert_choice_moe: expert_choice() refuses a bad capacity factor; top_k over tokens points to it") {
  Dim T = Dim::dynamic("T"), E("E", 4);
  Var t("t", T), e("e", E);
  Input x("x", {T, E});
  Func p("p", DType::f32);
  p(t, e) = x(t, e);
  CHECK(testing::user_error_of([&] { expert_choice(p, e, 0.0); }).find("must be positive") != std::string::npos);
  CHECK(testing::user_error_of([&] { top_k(p, t, 2); }).find("expert_choice(probs, expert, capacity_factor)") !=
        std::string::npos);
}
