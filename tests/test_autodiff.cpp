// Reverse-mode autodiff of the algebra (dsl/autodiff.h), checked on the
// reference against central finite differences in f64: every unary and
// binary rule, sums, softmax, reads with transposed and broadcast indices,
// the dense MLP and the routed MoE layers (gradients through the gates to the
// router). Also the printed gradient algebra and the unsupported cases.
#include <doctest/doctest.h>

#include <random>

#include "autodiff_check.h"
#include "examples/examples.h"

using namespace moeforge;
using moeforge::testing::check_gradients;
using moeforge::testing::example_inputs;

namespace {

constexpr int64_t kT = 4, kD = 3, kF = 5;

struct World {
  Dim T = Dim::dynamic("T"), D{"D", kD}, F{"F", kF};
  Var t{"t", T}, i{"i", D}, j{"j", F};
  Input a{"a", {T, D}, DType::f32}, b{"b", {T, D}, DType::f32}, u{"u", {T}, DType::f32};
  Param w{"w", {D, F}, DType::f32}, c{"c", {D}, DType::f32};
  TensorMap inputs;

  World() {
    std::mt19937_64 rng(3);
    inputs["a"] = random_tensor({kT, kD}, rng, -2.0, 2.0, false);
    inputs["b"] = random_tensor({kT, kD}, rng, 0.5, 2.0, false); // positive: a safe divisor and log argument
    inputs["u"] = random_tensor({kT}, rng, -1.0, 1.0, false);
    inputs["w"] = random_tensor({kD, kF}, rng, -1.0, 1.0, false);
    inputs["c"] = random_tensor({kD}, rng, -1.0, 1.0, false);
  }

  void check(const Func &f, const std::vector<std::string> &wrt) const {
    auto r = check_gradients(Pipeline({f}), f, inputs, wrt);
    CHECK(r.checked > 0);
    CHECK(r.skipped == 0);
  }
};

void check_example(const std::string &name, const std::vector<std::string> &wrt) {
  ExampleShape s = moeforge::testing::finite_difference_shape();
  Example ex = make_example(name, s);
  auto r = check_gradients(ex.pipeline, ex.pipeline.func(ex.output), example_inputs(ex, s, 11), wrt, 5, 24);
  MESSAGE(name << ": " << r.checked << " elements checked, " << r.skipped << " skipped (routing flipped), worst "
               << r.worst);
  // Every tensor sampled; a flipped routing may skip a few, never most.
  CHECK(r.attempted >= 12 * static_cast<int>(wrt.size()));
  CHECK(r.checked * 4 >= r.attempted * 3);
}

} // namespace

TEST_CASE("autodiff: unary ops against finite differences") {
  World w;
  struct Op {
    const char *name;
    Expr (*f)(const Expr &);
  };
  const Op ops[] = {{"neg", [](const Expr &x) { return -x; }},
                    {"exp", exp},
                    {"tanh", tanh},
                    {"sigmoid", sigmoid},
                    {"relu", relu},
                    {"gelu", gelu},
                    {"silu", silu}};
  for (const Op &op : ops) {
    CAPTURE(op.name);
    Func f(std::string("f_") + op.name);
    f(w.t, w.i) = op.f(w.a(w.t, w.i) * w.c(w.i));
    w.check(f, {"a", "c"});
  }
  Func g("g_log"); // log needs a positive argument
  g(w.t, w.i) = log(w.b(w.t, w.i));
  w.check(g, {"b"});
  Func s("g_sqrt"), r("g_rsqrt"); // so do sqrt and rsqrt
  s(w.t, w.i) = sqrt(w.b(w.t, w.i));
  w.check(s, {"b"});
  r(w.t, w.i) = rsqrt(w.b(w.t, w.i));
  w.check(r, {"b"});
}

TEST_CASE("autodiff: binary ops with broadcasting against finite differences") {
  World w;
  Func fa("fa"), fs("fs"), fm("fm"), fd("fd"), fx("fx");
  fa(w.t, w.i) = w.a(w.t, w.i) + w.c(w.i);
  fs(w.t, w.i) = w.c(w.i) - w.a(w.t, w.i);
  fm(w.t, w.i) = w.a(w.t, w.i) * w.b(w.t, w.i) * w.c(w.i);
  fd(w.t, w.i) = w.a(w.t, w.i) / (w.b(w.t, w.i) + w.c(w.i) * w.c(w.i));
  fx(w.t, w.i) = max(w.a(w.t, w.i), w.c(w.i)) + max(w.b(w.t, w.i), 1.0);
  w.check(fa, {"a", "c"});
  w.check(fs, {"a", "c"});
  w.check(fm, {"a", "b", "c"});
  w.check(fd, {"a", "b", "c"});
  w.check(fx, {"a", "b", "c"});
}

TEST_CASE("autodiff: a contraction and a plain reduction") {
  World w;
  Func f("f");
  f(w.t, w.j) = sum(w.i, w.a(w.t, w.i) * w.w(w.i, w.j));
  w.check(f, {"a", "w"});
  // u(t) is read inside a sum over i that it does not use: its gradient
  // counts every term (the one_D broadcast).
  Func g("g");
  g(w.t) = sum(w.i, w.a(w.t, w.i) * w.c(w.i) + w.u(w.t) * w.u(w.t));
  w.check(g, {"a", "c", "u"});
}

TEST_CASE("autodiff: softmax, stored and recomputed") {
  World w;
  Func p("p");
  p(w.t, w.i) = softmax(w.i, w.a(w.t, w.i) * w.c(w.i));
  w.check(p, {"a", "c"});
  Func q("q"); // softmax inside a larger expression: recomputed, not read back
  q(w.t, w.i) = softmax(w.i, w.a(w.t, w.i)) * w.b(w.t, w.i);
  w.check(q, {"a", "b"});
}

TEST_CASE("autodiff: chains of Funcs with transposed reads accumulate") {
  World w;
  Func g("g"), h("h"), f("f");
  g(w.t, w.i) = tanh(w.a(w.t, w.i));
  h(w.i, w.t) = g(w.t, w.i) * w.b(w.t, w.i); // transposed definition
  f(w.t, w.j) = sum(w.i, (h(w.i, w.t) + g(w.t, w.i)) * w.w(w.i, w.j));
  w.check(f, {"a", "b", "w"});
}

TEST_CASE("autodiff: dense_mlp example against finite differences") { check_example("dense_mlp", {"x", "w1", "w2"}); }

TEST_CASE("autodiff: attention example against finite differences") { check_example("attention", {"q", "k", "v"}); }

TEST_CASE("autodiff: moe_mlp gradients reach x, the router and the experts") {
  check_example("moe_mlp", {"x", "wr", "w1", "w2"});
}

TEST_CASE("autodiff: swiglu_moe gradients through renormalised gates") {
  check_example("swiglu_moe", {"x", "wr", "w1", "w2", "w3"});
}

TEST_CASE("autodiff: shared_expert_moe gradients reach the shared expert and its sigmoid gate") {
  check_example("shared_expert_moe", {"x", "wr", "w1", "w3", "w2", "ws1", "ws3", "ws2", "wsg"});
}

TEST_CASE("autodiff: deepseek_moe gradients through sigmoid scores and normalised, scaled gates") {
  // The selection bias only selects, and selection is a constant: no
  // gradient reaches it (grad() says so for a request of one).
  check_example("deepseek_moe", {"x", "wr", "w1", "w3", "w2"});
}

TEST_CASE("autodiff: moa (Mixture-of-Attention) gradients reach the heads, the shared keys and values and x") {
  check_example("moa", {"x", "wr", "wq", "wk", "wv", "wo"});
}

TEST_CASE("autodiff: rmsnorm_moe gradients reach the norm's scale and x through both of its paths") {
  check_example("rmsnorm_moe", {"x", "g", "wr", "w1", "w2"});
}

TEST_CASE("autodiff: the gradient algebra prints as math") {
  World w;
  Func f("f");
  f(w.t, w.j) = sum(w.i, w.a(w.t, w.i) * w.w(w.i, w.j));
  Gradients g = grad(Pipeline({f}), f);
  CHECK(g.seed == "d_f");
  CHECK(to_string(g["a"]) == "d_a(t, d) = sum(j, d_f(t, j) * w(d, j))");
  CHECK(to_string(g["w"]) == "d_w(d, f) = sum(t, a(t, d) * d_f(t, f))");
}

TEST_CASE("autodiff: the routed gradients print with combine, expert_sum and the gate scatter") {
  ExampleShape s;
  s.tokens = 4;
  s.experts = 4;
  s.topk = 2;
  s.d = 3;
  s.f = 4;
  Example ex = make_example("moe_mlp", s);
  Gradients g = grad(ex.pipeline, ex.pipeline.func("y"));
  CHECK(to_string(g["w2"]) == "d_w2(e, f, d) = expert_sum(route, e, h(r, f) * d_o(r, d))");
  CHECK(to_string(g["probs"]) == "d_probs(t, e) = combine(route, t, d_route_gate(r) * [expert(r) == e])");
  CHECK(to_string(g["route_gate"]) == "d_route_gate(r) = sum(i, d_y(token(r), i) * o(r, i))");
}

TEST_CASE("autodiff: unsupported constructs and bad requests are named") {
  World w;
  Param s("s", {w.D, w.D}, DType::f32);
  Func f("f");
  f(w.i) = s(w.i, w.i);
  CHECK_THROWS_WITH_AS(grad(Pipeline({f}), f), doctest::Contains("diagonal read"), UserError);
  Func g("g");
  g(w.t, w.i) = w.a(w.t, w.i) * 2.0;
  Func other("other");
  other(w.t, w.i) = w.b(w.t, w.i);
  CHECK_THROWS_WITH_AS(grad(Pipeline({g}), other), doctest::Contains("not a Func of this pipeline"), UserError);
  CHECK_THROWS_WITH_AS(grad(Pipeline({g}), g, "a"), doctest::Contains("already an Input or Param"), UserError);
  Gradients gr = grad(Pipeline({g}), g);
  CHECK_THROWS_WITH_AS(gr["b"], doctest::Contains("does not depend on it"), UserError);
}

TEST_CASE("step and index comparison: print, check and evaluate") {
  World w;
  Var i2("i2", w.D);
  Func st("st"), eye("eye");
  st(w.t, w.i) = step(w.a(w.t, w.i));
  eye(w.i, i2) = index_eq(w.i, i2) * 2.0;
  CHECK(to_string(st) == "st(t, i) = step(a(t, i))");
  CHECK(to_string(eye) == "eye(i, i2) = [i == i2] * 2");
  EvalResult r = evaluate(Pipeline({st, eye}), {{"a", w.inputs.at("a")}}, Precision::f64);
  for (int64_t k = 0; k < w.inputs.at("a").size(); ++k)
    CHECK(r["st"].data[k] == (w.inputs.at("a").data[k] > 0 ? 1.0 : 0.0));
  for (int64_t x = 0; x < kD; ++x)
    for (int64_t y = 0; y < kD; ++y)
      CHECK(r["eye"].at({x, y}) == (x == y ? 2.0 : 0.0));
  CHECK_THROWS_WITH_AS(index_eq(w.i, w.j), doctest::Contains("over one Dim"), UserError);
  Func bad("bad");
  CHECK_THROWS_WITH_AS(bad(w.i) = index_eq(w.i, i2), doctest::Contains("'i2' is used on the right side"), UserError);
}

TEST_CASE("index comparison through a route: a one-hot of the chosen experts") {
  Dim T = Dim::dynamic("T"), E("E", 4);
  Var t("t", T), e("e", E);
  Input logits_in("z", {T, E}, DType::f32);
  Func probs("probs");
  probs(t, e) = softmax(e, logits_in(t, e));
  Route route = top_k(probs, e, 2);
  Var r = route.pair();
  Func chosen("chosen");
  chosen(t, e) = combine(route, t, index_eq(route.expert(r), e));
  std::mt19937_64 rng(1);
  EvalResult res = evaluate(Pipeline({chosen}), {{"z", random_tensor({5, 4}, rng, -1, 1, false)}}, Precision::f64);
  const RoutingResult &rr = res.routes.at("route");
  for (int64_t tok = 0; tok < 5; ++tok) {
    double row = 0;
    for (int64_t ex = 0; ex < 4; ++ex) {
      bool picked = rr.expert[tok * 2] == ex || rr.expert[tok * 2 + 1] == ex;
      CHECK(res["chosen"].at({tok, ex}) == (picked ? 1.0 : 0.0));
      row += res["chosen"].at({tok, ex});
    }
    CHECK(row == 2.0);
  }
}

TEST_CASE("autodiff: the router gradient of top-1, and perturbations that flip the choice are skipped") {
  Dim T = Dim::dynamic("T"), E("E", 3), D("D", 2);
  Var t("t", T), e("e", E), i("i", D);
  Input z("z", {T, E}, DType::f32), v("v", {T, D}, DType::f32);
  Func probs("probs");
  probs(t, e) = softmax(e, z(t, e));
  Route route = top_k(probs, e, 1);
  Var r = route.pair();
  Func y("y");
  y(t, i) = combine(route, t, route.gate(r) * v(route.token(r), i));
  std::mt19937_64 rng(9);
  TensorMap in{{"z", random_tensor({3, 3}, rng, -1, 1, false)}, {"v", random_tensor({3, 2}, rng, -1, 1, false)}};
  // Token 0's two best experts tie to within the finite-difference step.
  in["z"].at({0, 0}) = 0.5;
  in["z"].at({0, 1}) = 0.5 + 1e-9;
  in["z"].at({0, 2}) = -1.0;
  auto res = check_gradients(Pipeline({y}), y, in, {"z", "v"});
  CHECK(res.skipped >= 1);
  CHECK(res.checked == res.attempted - res.skipped);
  CHECK(res.checked >= 10);
}
