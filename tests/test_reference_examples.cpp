// Every example layer evaluated by the reference, in float64 and float32,
// against plain loops written from the math (moe_loops.h): the router, top-k,
// the expert MLPs per routed pair and the gated combine, plus the routing.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "backends/reference/evaluate.h"
#include "examples/examples.h"
#include "moe_loops.h"

using namespace moeforge;

namespace {

double tolerance(Precision p) { return p == Precision::f64 ? 1e-10 : 1e-4; }

// Checks the route the reference chose against the loops' top-k.
void check_routing(const RoutingResult &got, const loops::Routing &want, int64_t T, int64_t E, int k) {
  CHECK(got.tokens == T);
  CHECK(got.experts == E);
  CHECK(got.k == k);
  REQUIRE(got.token.size() == static_cast<size_t>(T * k));
  REQUIRE(got.expert.size() == static_cast<size_t>(T * k));
  CHECK(got.token == want.token);
  CHECK(got.expert == want.expert);
  std::vector<int64_t> counts(static_cast<size_t>(E), 0);
  for (int32_t e : want.expert)
    ++counts[e];
  CHECK(got.expert_counts() == counts);
}

void check_moe(const std::string &name, const ExampleShape &s, uint64_t seed, Precision prec) {
  INFO(name << " T=" << s.tokens << " E=" << s.experts << " k=" << s.topk << " d=" << s.d << " f=" << s.f
            << " seed=" << seed << (prec == Precision::f64 ? " f64" : " f32"));
  bool swiglu = name == "swiglu_moe";
  Example ex = make_example(name, s);
  TensorMap in = ex.random_inputs(s, seed);
  EvalResult res = evaluate(ex.pipeline, in, prec);
  double tol = tolerance(prec);
  int k = static_cast<int>(s.topk);

  HostTensor logits = loops::matmul(in.at("x"), in.at("wr"));
  HostTensor probs = loops::softmax_rows(logits);
  loops::Routing route = loops::top_k(probs, k, swiglu);
  loops::MoeLoops m = loops::moe(in.at("x"), route, in.at("w1"), in.at("w2"), swiglu ? &in.at("w3") : nullptr);

  loops::check_close(res["logits"], logits, tol, "logits");
  loops::check_close(res["probs"], probs, tol, "probs");
  REQUIRE(res.routes.count("route") == 1);
  check_routing(res.routes.at("route"), route, s.tokens, s.experts, k);
  HostTensor gate({s.tokens * k});
  gate.data.assign(route.gate.begin(), route.gate.end());
  loops::check_close(res["route_gate"], gate, tol, "route_gate");
  if (swiglu) {
    HostTensor gate_sum({s.tokens});
    for (size_t r = 0; r < route.token.size(); ++r)
      gate_sum.data[route.token[r]] += probs.at({route.token[r], route.expert[r]});
    loops::check_close(res["route_gate_sum"], gate_sum, tol, "route_gate_sum");
    // Renormalised gates of a token add up to 1.
    for (int64_t t = 0; t < s.tokens; ++t) {
      double g = 0;
      for (int j = 0; j < k; ++j)
        g += res["route_gate"].data[t * k + j];
      CHECK(g == doctest::Approx(1.0).epsilon(tol));
    }
  }
  loops::check_close(res["h"], m.h, tol, "h");
  loops::check_close(res["o"], m.o, tol, "o");
  loops::check_close(res["y"], m.y, tol, "y");
  CHECK(res.extents.at("T") == s.tokens);
  CHECK(res.extents.at("route.pairs") == s.tokens * k);
  CHECK(res.extents.at("E") == s.experts);
}

void check_dense_mlp(const ExampleShape &s, uint64_t seed, Precision prec) {
  Example ex = make_example("dense_mlp", s);
  TensorMap in = ex.random_inputs(s, seed);
  EvalResult res = evaluate(ex.pipeline, in, prec);
  CHECK(res.routes.empty());
  HostTensor h = loops::matmul(in.at("x"), in.at("w1"));
  for (double &v : h.data)
    v = loops::gelu(v);
  HostTensor y = loops::matmul(h, in.at("w2"));
  loops::check_close(res["h"], h, tolerance(prec), "h");
  loops::check_close(res["y"], y, tolerance(prec), "y");
}

void check_attention(const ExampleShape &s, uint64_t seed, Precision prec) {
  Example ex = make_example("attention", s);
  TensorMap in = ex.random_inputs(s, seed);
  EvalResult res = evaluate(ex.pipeline, in, prec);
  const HostTensor &q = in.at("q"), &k = in.at("k"), &v = in.at("v");
  int64_t T = s.tokens, D = s.d;
  HostTensor scores({T, T});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t u = 0; u < T; ++u) {
      double acc = 0;
      for (int64_t i = 0; i < D; ++i)
        acc += q.at({t, i}) * k.at({u, i});
      scores.at({t, u}) = acc / std::sqrt(double(D));
    }
  HostTensor p = loops::softmax_rows(scores);
  HostTensor out = loops::matmul(p, v);
  loops::check_close(res["p"], p, tolerance(prec), "p");
  loops::check_close(res["out"], out, tolerance(prec), "out");
}

// Mixture-of-Attention from the math: shared keys and values of every
// token; for each routed pair a query with its head's W_q, a softmax over
// every token, the weighted values and the head's W_o; the gated sum of a
// token's heads.
void check_moa(const ExampleShape &s, uint64_t seed, Precision prec) {
  INFO("moa T=" << s.tokens << " E=" << s.experts << " k=" << s.topk << " d=" << s.d << " f=" << s.f);
  Example ex = make_example("moa", s);
  TensorMap in = ex.random_inputs(s, seed);
  EvalResult res = evaluate(ex.pipeline, in, prec);
  const HostTensor &x = in.at("x"), &wq = in.at("wq"), &wo = in.at("wo");
  const int64_t T = s.tokens, D = s.d, F = s.f;
  const int k = static_cast<int>(s.topk);
  loops::Routing route = loops::top_k(loops::softmax_rows(loops::matmul(x, in.at("wr"))), k, false);
  check_routing(res.routes.at("route"), route, T, s.experts, k);
  HostTensor key = loops::matmul(x, in.at("wk")), value = loops::matmul(x, in.at("wv"));
  HostTensor y({T, D});
  for (size_t r = 0; r < route.token.size(); ++r) {
    const int64_t t = route.token[r], e = route.expert[r];
    std::vector<double> q(static_cast<size_t>(F), 0.0), p(static_cast<size_t>(T)), z(static_cast<size_t>(F), 0.0);
    for (int64_t c = 0; c < F; ++c)
      for (int64_t i = 0; i < D; ++i)
        q[c] += x.at({t, i}) * wq.at({e, i, c});
    double mx = -INFINITY, total = 0;
    for (int64_t u = 0; u < T; ++u) {
      double a = 0;
      for (int64_t c = 0; c < F; ++c)
        a += q[c] * key.at({u, c});
      p[u] = a / std::sqrt(double(F));
      mx = std::max(mx, p[u]);
    }
    for (double &v : p)
      total += (v = std::exp(v - mx));
    for (int64_t u = 0; u < T; ++u)
      for (int64_t c = 0; c < F; ++c)
        z[c] += p[u] / total * value.at({u, c});
    for (int64_t i = 0; i < D; ++i) {
      double o = 0;
      for (int64_t c = 0; c < F; ++c)
        o += z[c] * wo.at({e, c, i});
      y.at({t, i}) += route.gate[r] * o;
    }
  }
  loops::check_close(res["key"], key, tolerance(prec), "key");
  loops::check_close(res["value"], value, tolerance(prec), "value");
  loops::check_close(res["y"], y, tolerance(prec), "y");
}

} // namespace

TEST_CASE("reference examples: moa (Mixture-of-Attention) f64 and f32 against loops") {
  check_moa(ExampleShape{13, 4, 2, 8, 6}, 1, Precision::f64);
  check_moa(ExampleShape{1, 3, 1, 5, 4}, 2, Precision::f64);
  check_moa(ExampleShape{24, 6, 3, 8, 8}, 3, Precision::f32);
}

TEST_CASE("reference examples: moe_mlp f64 against loops") {
  check_moe("moe_mlp", ExampleShape{13, 5, 2, 8, 6}, 1, Precision::f64);
  check_moe("moe_mlp", ExampleShape{32, 8, 1, 16, 24}, 2, Precision::f64);
  check_moe("moe_mlp", ExampleShape{9, 4, 3, 5, 7}, 3, Precision::f64);
}

TEST_CASE("reference examples: moe_mlp f32 against loops") {
  check_moe("moe_mlp", ExampleShape{13, 5, 2, 8, 6}, 1, Precision::f32);
  check_moe("moe_mlp", ExampleShape{64, 8, 2, 32, 48}, 4, Precision::f32);
}

TEST_CASE("reference examples: swiglu_moe f64 against loops") {
  check_moe("swiglu_moe", ExampleShape{13, 5, 2, 8, 6}, 1, Precision::f64);
  check_moe("swiglu_moe", ExampleShape{20, 8, 4, 12, 10}, 5, Precision::f64);
  check_moe("swiglu_moe", ExampleShape{6, 3, 1, 4, 4}, 6, Precision::f64);
}

TEST_CASE("reference examples: swiglu_moe f32 against loops") {
  check_moe("swiglu_moe", ExampleShape{13, 5, 2, 8, 6}, 1, Precision::f32);
  check_moe("swiglu_moe", ExampleShape{64, 8, 2, 32, 48}, 7, Precision::f32);
}

TEST_CASE("reference examples: dense_mlp f64 against loops") {
  check_dense_mlp(ExampleShape{13, 1, 1, 8, 6}, 1, Precision::f64);
  check_dense_mlp(ExampleShape{1, 1, 1, 3, 2}, 2, Precision::f64);
}

TEST_CASE("reference examples: dense_mlp f32 against loops") {
  check_dense_mlp(ExampleShape{13, 1, 1, 8, 6}, 1, Precision::f32);
  check_dense_mlp(ExampleShape{50, 1, 1, 32, 40}, 3, Precision::f32);
}

TEST_CASE("reference examples: attention f64 against loops") {
  check_attention(ExampleShape{11, 1, 1, 8, 1}, 1, Precision::f64);
  check_attention(ExampleShape{1, 1, 1, 4, 1}, 2, Precision::f64);
}

TEST_CASE("reference examples: attention f32 against loops") {
  check_attention(ExampleShape{11, 1, 1, 8, 1}, 1, Precision::f32);
  check_attention(ExampleShape{40, 1, 1, 16, 1}, 3, Precision::f32);
}

TEST_CASE("reference examples: routing is largest first with k distinct experts per token") {
  ExampleShape s{40, 6, 3, 8, 4};
  Example ex = make_example("moe_mlp", s);
  TensorMap in = ex.random_inputs(s, 11);
  EvalResult res = evaluate(ex.pipeline, in);
  const RoutingResult &r = res.routes.at("route");
  const HostTensor &probs = res["probs"];
  for (int64_t t = 0; t < s.tokens; ++t) {
    std::vector<int32_t> chosen;
    for (int slot = 0; slot < 3; ++slot) {
      size_t p = static_cast<size_t>(t * 3 + slot);
      CHECK(r.token[p] == t); // pair r = t * k + slot
      chosen.push_back(r.expert[p]);
      if (slot > 0)
        CHECK(probs.at({t, r.expert[p - 1]}) >= probs.at({t, r.expert[p]}));
    }
    std::sort(chosen.begin(), chosen.end());
    CHECK(std::unique(chosen.begin(), chosen.end()) == chosen.end());
    // Every unchosen expert has a probability no larger than the k-th.
    double kth = probs.at({t, r.expert[static_cast<size_t>(t * 3 + 2)]});
    for (int32_t e = 0; e < 6; ++e)
      if (!std::binary_search(chosen.begin(), chosen.end(), e))
        CHECK(probs.at({t, e}) <= kth);
  }
  // f32 and f64 route these inputs the same way.
  EvalResult res32 = evaluate(ex.pipeline, in, Precision::f32);
  CHECK(res32.routes.at("route").expert == r.expert);
}

TEST_CASE("reference examples: random_inputs are bf16-exact seeded and scaled") {
  ExampleShape s{7, 4, 2, 16, 9};
  Example ex = make_example("moe_mlp", s);
  TensorMap a = ex.random_inputs(s, 5), b = ex.random_inputs(s, 5), c = ex.random_inputs(s, 6);
  CHECK(a.at("x").data == b.at("x").data);
  CHECK(a.at("x").data != c.at("x").data);
  CHECK(a.at("x").shape == std::vector<int64_t>{7, 16});
  CHECK(a.at("w1").shape == std::vector<int64_t>{4, 16, 9});
  CHECK(a.at("w2").shape == std::vector<int64_t>{4, 9, 16});
  for (const auto &[name, t] : a) {
    double bound = ex.init_scale.at(name);
    for (double v : t.data) {
      CHECK(round_to_bf16(v) == v);
      CHECK(std::fabs(v) <= bound * (1 + 1e-2)); // bf16 rounding may step just past the bound
    }
  }
}
