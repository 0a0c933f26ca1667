// The MoE edge cases on the reference, with a test-local layer whose router
// logits are an Input lg(T, E) so that each test decides the routing exactly:
// an expert with no tokens, every token on one expert, k = E, a single token,
// a ragged token count, ties. Each layer also computes per-expert reductions
// (expert_sum, the weight-gradient shape), checked against loops; an expert
// with no rows must reduce to exactly zero.
#include <doctest/doctest.h>

#include <algorithm>
#include <random>

#include "backends/reference/evaluate.h"
#include "dsl/moeforge.h"
#include "moe_loops.h"

using namespace moeforge;

namespace {

Route make_route(Func &probs, const Input &lg, const Var &t, const Var &e, int k, bool renorm) {
  probs(t, e) = softmax(e, lg(t, e));
  TopKOptions opts;
  opts.renormalize = renorm;
  return top_k(probs, e, k, opts);
}

// y(t, i) = combine(route, t, gate(r) * o(r, i)) with a GeLU expert MLP, and
// beside it the per-expert reductions
//   dw1(e, i, j) = expert_sum(route, e, x(token(r), i) * g(r, j))
//   dw2(e, j, i) = expert_sum(route, e, h(r, j) * dy(token(r), i))
//   gsum(e)      = expert_sum(route, e, gate(r))
//   bsum(e, i)   = expert_sum(route, e, b(expert(r), i))   (a count times b)
// with g(r, j) = gate(r) * dz(token(r), j).
struct Moe {
  Dim T, D, F, E;
  Var t, e, i, j;
  Input lg, x, dy, dz;
  Param w1, w2, b;
  Func probs{"probs", DType::f32};
  Route route;
  Pipeline pipeline;

  Moe(int64_t d, int64_t f, int64_t experts, int k, bool renorm = false)
      : T(Dim::dynamic("T")), D("D", d), F("F", f), E("E", experts), t("t", T), e("e", E), i("i", D), j("j", F),
        lg("lg", {T, E}, DType::f32), x("x", {T, D}, DType::f32), dy("dy", {T, D}, DType::f32),
        dz("dz", {T, F}, DType::f32), w1("w1", {E, D, F}, DType::f32), w2("w2", {E, F, D}, DType::f32),
        b("b", {E, D}, DType::f32), route(make_route(probs, lg, t, e, k, renorm)), pipeline(build()) {}

  Pipeline build() {
    Var r = route.pair();
    Func h("h"), o("o"), y("y"), g("g"), dw1("dw1"), dw2("dw2"), gsum("gsum"), bsum("bsum");
    h(r, j) = gelu(sum(i, x(route.token(r), i) * w1(route.expert(r), i, j)));
    o(r, i) = sum(j, h(r, j) * w2(route.expert(r), j, i));
    y(t, i) = combine(route, t, route.gate(r) * o(r, i));
    g(r, j) = route.gate(r) * dz(route.token(r), j);
    dw1(e, i, j) = expert_sum(route, e, x(route.token(r), i) * g(r, j));
    dw2(e, j, i) = expert_sum(route, e, h(r, j) * dy(route.token(r), i));
    gsum(e) = expert_sum(route, e, route.gate(r));
    bsum(e, i) = expert_sum(route, e, b(route.expert(r), i));
    return Pipeline({y, dw1, dw2, gsum, bsum});
  }

  // Random weights and activations for T tokens; the caller sets lg.
  TensorMap inputs(int64_t tokens, const HostTensor &logits, uint64_t seed) const {
    std::mt19937_64 rng(seed);
    int64_t d = D.extent(), f = F.extent(), ne = E.extent();
    TensorMap in;
    in["lg"] = logits;
    in["x"] = random_tensor({tokens, d}, rng, -1, 1, false);
    in["dy"] = random_tensor({tokens, d}, rng, -1, 1, false);
    in["dz"] = random_tensor({tokens, f}, rng, -1, 1, false);
    in["w1"] = random_tensor({ne, d, f}, rng, -0.5, 0.5, false);
    in["w2"] = random_tensor({ne, f, d}, rng, -0.5, 0.5, false);
    in["b"] = random_tensor({ne, d}, rng, -1, 1, false);
    return in;
  }
};

// Random logits, with a column or a row overridden by the caller afterwards.
HostTensor random_logits(int64_t tokens, int64_t experts, uint64_t seed) {
  std::mt19937_64 rng(seed);
  return random_tensor({tokens, experts}, rng, -1, 1, false);
}

// Evaluates the layer and checks every output against loops; returns the
// routing the reference chose.
RoutingResult check_layer(const Moe &m, const TensorMap &in, int k, bool renorm, Precision prec = Precision::f64) {
  double tol = prec == Precision::f64 ? 1e-10 : 1e-4;
  EvalResult res = evaluate(m.pipeline, in, prec);
  HostTensor probs = loops::softmax_rows(in.at("lg"));
  loops::Routing route = loops::top_k(probs, k, renorm);
  loops::MoeLoops ml = loops::moe(in.at("x"), route, in.at("w1"), in.at("w2"));
  const RoutingResult &got = res.routes.at("route");
  CHECK(got.token == route.token);
  CHECK(got.expert == route.expert);
  loops::check_close(res["probs"], probs, tol, "probs");
  loops::check_close(res["h"], ml.h, tol, "h");
  loops::check_close(res["o"], ml.o, tol, "o");
  loops::check_close(res["y"], ml.y, tol, "y");

  int64_t T = in.at("x").shape[0], D = m.D.extent(), F = m.F.extent(), E = m.E.extent();
  HostTensor dw1({E, D, F}), dw2({E, F, D}), gsum({E}), bsum({E, D});
  const HostTensor &x = in.at("x"), &dy = in.at("dy"), &dz = in.at("dz"), &b = in.at("b");
  for (size_t r = 0; r < route.token.size(); ++r) {
    int64_t t = route.token[r], e = route.expert[r];
    double gate = route.gate[r];
    gsum.at({e}) += gate;
    for (int64_t i = 0; i < D; ++i) {
      bsum.at({e, i}) += b.at({e, i});
      for (int64_t j = 0; j < F; ++j) {
        dw1.at({e, i, j}) += x.at({t, i}) * gate * dz.at({t, j});
        dw2.at({e, j, i}) += ml.h.at({static_cast<int64_t>(r), j}) * dy.at({t, i});
      }
    }
  }
  loops::check_close(res["dw1"], dw1, tol, "dw1");
  loops::check_close(res["dw2"], dw2, tol, "dw2");
  loops::check_close(res["gsum"], gsum, tol, "gsum");
  loops::check_close(res["bsum"], bsum, tol, "bsum");
  CHECK(res.extents.at("T") == T);
  CHECK(res.extents.at("route.pairs") == T * k);
  return got;
}

// Every value of e's slice of t (leading index e) is exactly zero.
bool slice_is_zero(const HostTensor &t, int64_t e) {
  int64_t row = t.size() / t.shape[0];
  for (int64_t q = 0; q < row; ++q)
    if (t.data[static_cast<size_t>(e * row + q)] != 0.0)
      return false;
  return true;
}

} // namespace

TEST_CASE("reference edge cases: an expert that receives no tokens") {
  Moe m(6, 5, 4, 2);
  HostTensor lg = random_logits(9, 4, 1);
  for (int64_t t = 0; t < 9; ++t)
    lg.at({t, 2}) = -20.0; // expert 2 is never among the top 2
  TensorMap in = m.inputs(9, lg, 2);
  RoutingResult r = check_layer(m, in, 2, false);
  std::vector<int64_t> counts = r.expert_counts();
  CHECK(counts[2] == 0);
  CHECK(counts[0] + counts[1] + counts[3] == 18);
  EvalResult res = evaluate(m.pipeline, in);
  CHECK(slice_is_zero(res["dw1"], 2));
  CHECK(slice_is_zero(res["dw2"], 2));
  CHECK(slice_is_zero(res["bsum"], 2));
  CHECK(res["gsum"].data[2] == 0.0);
  CHECK_FALSE(slice_is_zero(res["dw1"], 0));
  // Also in f32.
  check_layer(m, in, 2, false, Precision::f32);
  EvalResult res32 = evaluate(m.pipeline, in, Precision::f32);
  CHECK(slice_is_zero(res32["dw1"], 2));
}

TEST_CASE("reference edge cases: every token routed to one expert") {
  Moe m(5, 4, 4, 1);
  HostTensor lg = random_logits(8, 4, 3);
  for (int64_t t = 0; t < 8; ++t)
    lg.at({t, 3}) = 20.0;
  TensorMap in = m.inputs(8, lg, 4);
  RoutingResult r = check_layer(m, in, 1, false);
  CHECK(r.expert_counts() == std::vector<int64_t>{0, 0, 0, 8});
  EvalResult res = evaluate(m.pipeline, in);
  for (int64_t e = 0; e < 3; ++e) {
    CHECK(slice_is_zero(res["dw1"], e));
    CHECK(slice_is_zero(res["dw2"], e));
    CHECK(res["gsum"].data[e] == 0.0);
  }
  // bsum(3, i) = 8 * b(3, i): a body that reads only expert(r).
  for (int64_t i = 0; i < 5; ++i)
    CHECK(res["bsum"].at({3, i}) == doctest::Approx(8 * in.at("b").at({3, i})));

  // The same with k = 2: every token's first choice is expert 3.
  Moe m2(5, 4, 4, 2);
  RoutingResult r2 = check_layer(m2, in, 2, false);
  for (size_t p = 0; p < r2.expert.size(); p += 2)
    CHECK(r2.expert[p] == 3);
}

TEST_CASE("reference edge cases: k equals the number of experts") {
  Moe m(4, 6, 3, 3);
  HostTensor lg = random_logits(7, 3, 5);
  TensorMap in = m.inputs(7, lg, 6);
  RoutingResult r = check_layer(m, in, 3, false);
  CHECK(r.expert_counts() == std::vector<int64_t>{7, 7, 7});
  // Every token visits every expert once, so y is the probability-weighted
  // sum of all experts: sum over e of probs(t, e) * expert_e(x(t)).
  EvalResult res = evaluate(m.pipeline, in);
  for (int64_t t = 0; t < 7; ++t) {
    std::vector<int32_t> seen(r.expert.begin() + t * 3, r.expert.begin() + t * 3 + 3);
    std::sort(seen.begin(), seen.end());
    CHECK(seen == std::vector<int32_t>{0, 1, 2});
  }
  double gates = 0;
  for (double g : res["gsum"].data)
    gates += g;
  CHECK(gates == doctest::Approx(7.0)); // each token's probabilities add to 1

  // Renormalised gates with k = E equal the probabilities.
  Moe mr(4, 6, 3, 3, true);
  check_layer(mr, in, 3, true);
  EvalResult rr = evaluate(mr.pipeline, in);
  loops::check_close(rr["y"], res["y"], 1e-12, "renormalised y with k = E");
}

TEST_CASE("reference edge cases: a single token") {
  Moe m(6, 5, 4, 2);
  HostTensor lg = random_logits(1, 4, 7);
  TensorMap in = m.inputs(1, lg, 8);
  RoutingResult r = check_layer(m, in, 2, false);
  CHECK(r.tokens == 1);
  CHECK(r.token == std::vector<int32_t>{0, 0});
  std::vector<int64_t> counts = r.expert_counts();
  CHECK(std::count(counts.begin(), counts.end(), int64_t{0}) == 2); // two empty experts
  check_layer(m, in, 2, false, Precision::f32);
  Moe mr(6, 5, 4, 2, true);
  check_layer(mr, in, 2, true);
}

TEST_CASE("reference edge cases: a ragged token count") {
  // 7 tokens: not a multiple of anything a kernel would like.
  Moe m(5, 3, 5, 2);
  HostTensor lg = random_logits(7, 5, 9);
  TensorMap in = m.inputs(7, lg, 10);
  check_layer(m, in, 2, false);
  check_layer(m, in, 2, false, Precision::f32);
  Moe mr(5, 3, 5, 2, true);
  check_layer(mr, in, 2, true);
  // 13 tokens, k = 3.
  Moe m3(5, 3, 5, 3);
  TensorMap in13 = m3.inputs(13, random_logits(13, 5, 11), 12);
  check_layer(m3, in13, 3, false);
}

TEST_CASE("reference edge cases: ties go to the lower expert index") {
  Moe m(3, 2, 4, 2);
  HostTensor lg({4, 4}, 0.0); // token 0: all equal
  // token 1: experts 1 and 3 tie for first, 0 and 2 tie below
  lg.at({1, 0}) = -1.0, lg.at({1, 1}) = 2.0, lg.at({1, 2}) = -1.0, lg.at({1, 3}) = 2.0;
  // token 2: expert 3 first, experts 0 and 2 tie for second
  lg.at({2, 0}) = 1.0, lg.at({2, 1}) = -3.0, lg.at({2, 2}) = 1.0, lg.at({2, 3}) = 4.0;
  // token 3: a strict order 2 > 0 > 3 > 1
  lg.at({3, 0}) = 0.5, lg.at({3, 1}) = -0.5, lg.at({3, 2}) = 1.5, lg.at({3, 3}) = 0.25;
  TensorMap in = m.inputs(4, lg, 13);
  RoutingResult r = check_layer(m, in, 2, false);
  CHECK(r.expert == std::vector<int32_t>{0, 1, 1, 3, 3, 0, 2, 0});
  EvalResult res32 = evaluate(m.pipeline, in, Precision::f32);
  CHECK(res32.routes.at("route").expert == r.expert);
}

TEST_CASE("reference edge cases: expert_sum against loops with random routing") {
  Moe m(7, 6, 6, 2);
  HostTensor lg = random_logits(11, 6, 14);
  for (int64_t t = 0; t < 11; ++t)
    lg.at({t, 5}) = -50.0; // and one empty expert
  TensorMap in = m.inputs(11, lg, 15);
  RoutingResult r = check_layer(m, in, 2, false);
  CHECK(r.expert_counts()[5] == 0);
  EvalResult res = evaluate(m.pipeline, in);
  CHECK(slice_is_zero(res["dw1"], 5));
  CHECK(slice_is_zero(res["dw2"], 5));
  CHECK(res["dw1"].shape == std::vector<int64_t>{6, 7, 6});
  CHECK(res["dw2"].shape == std::vector<int64_t>{6, 6, 7});
  // The per-expert sums add up to the plain sum over all pairs.
  double total = 0, direct = 0;
  for (double v : res["dw1"].data)
    total += v;
  const HostTensor &x = in.at("x"), &dz = in.at("dz");
  const HostTensor &gate = res["route_gate"];
  for (size_t p = 0; p < r.token.size(); ++p)
    for (int64_t i = 0; i < 7; ++i)
      for (int64_t j = 0; j < 6; ++j)
        direct += x.at({r.token[p], i}) * gate.data[p] * dz.at({r.token[p], j});
  CHECK(total == doctest::Approx(direct).epsilon(1e-12));
  check_layer(m, in, 2, false, Precision::f32);
}

TEST_CASE("reference edge cases: router probabilities indexed expert first") {
  // probs(e, t) instead of probs(t, e): top_k finds the expert index by
  // identity, and the gates must read probs in its own argument order.
  Dim T = Dim::dynamic("T"), D("D", 3), E("E", 4);
  Var t("t", T), e("e", E), i("i", D);
  Input lgt("lgt", {E, T}, DType::f32);
  Input x("x", {T, D}, DType::f32);
  Func probs("probs", DType::f32);
  probs(e, t) = softmax(e, lgt(e, t));
  for (bool renorm : {false, true}) {
    INFO("renormalize " << renorm);
    TopKOptions opts;
    opts.renormalize = renorm;
    Route route = top_k(probs, e, 2, opts);
    Var r = route.pair();
    Func y("y", DType::f32);
    y(t, i) = combine(route, t, route.gate(r) * x(route.token(r), i));
    Pipeline p({y});
    std::mt19937_64 rng(21);
    TensorMap in;
    in["lgt"] = random_tensor({4, 6}, rng, -2, 2, false);
    in["x"] = random_tensor({6, 3}, rng, -1, 1, false);
    HostTensor lg({6, 4});
    for (int64_t tt = 0; tt < 6; ++tt)
      for (int64_t ee = 0; ee < 4; ++ee)
        lg.at({tt, ee}) = in["lgt"].at({ee, tt});
    loops::Routing want = loops::top_k(loops::softmax_rows(lg), 2, renorm);
    EvalResult res = evaluate(p, in);
    CHECK(res.routes.at("route").expert == want.expert);
    HostTensor y_want({6, 3});
    for (size_t q = 0; q < want.token.size(); ++q)
      for (int64_t ii = 0; ii < 3; ++ii)
        y_want.at({want.token[q], ii}) += want.gate[q] * in["x"].at({want.token[q], ii});
    loops::check_close(res["y"], y_want, 1e-12, "y");
  }
}
