// The auxiliary losses (dsl/losses.h), the extent(Dim) node they divide by
// and grad() of several outputs at once: each loss's reference value against
// a hand-written loop, and its reference gradients (alone, and with the
// layer's output y) against central finite differences in f64, skipping the
// perturbations that flip a top-k choice as tests/autodiff_check.h does.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "autodiff_check.h"
#include "examples/aux_loss_example.h"

using namespace moeforge;
using moeforge::testing::check_gradients;
using moeforge::testing::example_inputs;
using moeforge::testing::finite_difference_shape;
using moeforge::testing::GradCheck;
using moeforge::testing::only_buffers_of;

namespace {

// Most sampled elements checked; a flipped routing may skip a few, never most.
void check_coverage(const std::string &what, const GradCheck &r, size_t tensors) {
  MESSAGE(what << ": " << r.checked << " elements checked, " << r.skipped << " skipped (routing flipped), worst "
               << r.worst);
  CHECK(r.attempted >= 12 * static_cast<int>(tensors));
  CHECK(r.checked * 4 >= r.attempted * 3);
}

// The router by hand: logits = x wr, softmax over the experts, top-k with
// ties to the lower expert (as the reference chooses).
struct HandRouter {
  int64_t T, E, D, k;
  std::vector<std::vector<double>> logits, probs;
  std::vector<int64_t> load; // pairs routed to each expert

  HandRouter(const HostTensor &x, const HostTensor &wr, int64_t topk)
      : T(x.shape[0]), E(wr.shape[1]), D(x.shape[1]), k(topk), logits(T, std::vector<double>(E, 0.0)),
        probs(T, std::vector<double>(E, 0.0)), load(E, 0) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e)
        for (int64_t i = 0; i < D; ++i)
          logits[t][e] += x.at({t, i}) * wr.at({i, e});
      double mx = *std::max_element(logits[t].begin(), logits[t].end()), total = 0;
      for (int64_t e = 0; e < E; ++e)
        total += probs[t][e] = std::exp(logits[t][e] - mx);
      for (int64_t e = 0; e < E; ++e)
        probs[t][e] /= total;
      std::vector<int64_t> order(E);
      std::iota(order.begin(), order.end(), int64_t{0});
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return probs[t][a] > probs[t][b]; });
      for (int64_t s = 0; s < k; ++s)
        ++load[order[s]];
    }
  }
};

} // namespace

TEST_CASE("aux losses: extent(Dim) prints and evaluates to the bound extent") {
  Dim T = Dim::dynamic("T"), D("D", 3);
  Var t("t", T), i("i", D);
  Input a("a", {T, D}, DType::f32);
  Func mean("mean"), m2("m2");
  mean(i) = sum(t, a(t, i)) / extent(T);
  m2(t) = extent(D) + extent(T) + sum(i, a(t, i)) * 0.0;
  CHECK(to_string(mean) == "mean(i) = sum(t, a(t, i)) / extent(T)");
  std::mt19937_64 rng(5);
  HostTensor in = random_tensor({5, 3}, rng, -1, 1, false);
  EvalResult r = evaluate(Pipeline({mean, m2}), {{"a", in}}, Precision::f64);
  for (int64_t c = 0; c < 3; ++c) {
    double s = 0;
    for (int64_t row = 0; row < 5; ++row)
      s += in.at({row, c});
    CHECK(r["mean"].at({c}) == doctest::Approx(s / 5).epsilon(1e-14));
  }
  for (int64_t row = 0; row < 5; ++row)
    CHECK(r["m2"].at({row}) == 8.0);
  CHECK(r.extents.at("T") == 5);
  CHECK_THROWS_WITH_AS(extent(Dim()), doctest::Contains("extent() needs a Dim"), UserError);
}

TEST_CASE("aux losses: a mean over tokens differentiates with extent as a constant") {
  Dim T = Dim::dynamic("T"), D("D", 3);
  Var t("t", T), i("i", D);
  Input a("a", {T, D}, DType::f32);
  Func mean("mean");
  mean() = sum(t, sum(i, a(t, i) * a(t, i))) / extent(T);
  std::mt19937_64 rng(2);
  TensorMap in{{"a", random_tensor({4, 3}, rng, -1, 1, false)}};
  auto r = moeforge::testing::check_gradients(Pipeline({mean}), mean, in, {"a"});
  CHECK(r.checked == 12);
  Gradients g = grad(Pipeline({mean}), mean);
  CHECK(to_string(g["a"]) == "d_a(t, d) = d_mean() / extent(T) * a(t, d) + a(t, d) * d_mean() / extent(T)");
}

TEST_CASE("aux losses: the load-balancing loss against a hand-written loop") {
  for (const std::string name : {"moe_mlp", "swiglu_moe"}) {
    CAPTURE(name);
    ExampleShape s = finite_difference_shape();
    s.tokens = 9;
    AuxLossLayer a = make_aux_loss_example(name, s, {1.0, 1.0});
    for (uint64_t seed : {1, 2, 3}) {
      TensorMap in = example_inputs(a.example, s, seed);
      EvalResult r = evaluate(a.example.pipeline, in, Precision::f64);
      HandRouter h(in.at("x"), in.at("wr"), s.topk);
      CHECK(r.routes.at("route").expert_counts() == h.load);
      double loss = 0;
      for (int64_t e = 0; e < h.E; ++e) {
        double f = double(h.load[e]) / double(h.T * h.k), p = 0;
        for (int64_t t = 0; t < h.T; ++t)
          p += h.probs[t][e];
        loss += f * p / double(h.T);
        CHECK(r["lb_loss_fraction"].at({e}) == doctest::Approx(f).epsilon(1e-14));
      }
      loss *= double(h.E);
      REQUIRE(r["lb_loss"].shape.empty()); // a 0-D Func: a scalar
      CHECK(r["lb_loss"].data[0] == doctest::Approx(loss).epsilon(1e-12));
    }
  }
}

TEST_CASE("aux losses: the z-loss against a hand-written loop") {
  ExampleShape s = finite_difference_shape();
  s.tokens = 7;
  AuxLossLayer a = make_aux_loss_example("moe_mlp", s, {0.01, 0.5});
  for (uint64_t seed : {4, 5}) {
    TensorMap in = example_inputs(a.example, s, seed);
    for (double &v : in["wr"].data)
      v *= 8.0; // logits of a few units, where log-sum-exp differs from max
    EvalResult r = evaluate(a.example.pipeline, in, Precision::f64);
    HandRouter h(in.at("x"), in.at("wr"), s.topk);
    double loss = 0;
    for (int64_t t = 0; t < h.T; ++t) {
      double total = 0;
      for (int64_t e = 0; e < h.E; ++e)
        total += std::exp(h.logits[t][e]);
      CHECK(r["z_loss_lse"].at({t}) == doctest::Approx(std::log(total)).epsilon(1e-13));
      loss += std::log(total) * std::log(total);
    }
    loss = 0.5 * loss / double(h.T);
    REQUIRE(r["z_loss"].shape.empty());
    CHECK(r["z_loss"].data[0] == doctest::Approx(loss).epsilon(1e-12));
  }
}

TEST_CASE("aux losses: the layer's own output is unchanged by adding the losses") {
  ExampleShape s = finite_difference_shape();
  for (const std::string name : {"moe_mlp", "swiglu_moe"}) {
    CAPTURE(name);
    Example plain = make_example(name, s);
    AuxLossLayer a = make_aux_loss_example(name, s);
    CHECK(a.example.name == name + "_aux");
    CHECK(a.example.output == "y");
    CHECK(a.outputs == std::vector<std::string>{"y", "lb_loss", "z_loss"});
    TensorMap in = example_inputs(plain, s, 3);
    EvalResult r0 = evaluate(plain.pipeline, in), r1 = evaluate(a.example.pipeline, in);
    for (const Func &f : plain.pipeline.funcs())
      CHECK(r0[f.name()].data == r1[f.name()].data);
  }
  CHECK_THROWS_WITH_AS(make_aux_loss_example("dense_mlp", s), doctest::Contains("choose moe_mlp or swiglu_moe"),
                       UserError);
  CHECK_THROWS_WITH_AS(with_aux_losses(make_example("dense_mlp", s)), doctest::Contains("has no routing"), UserError);
}

TEST_CASE("aux losses: the losses print as math") {
  AuxLossLayer a = make_aux_loss_example("moe_mlp", finite_difference_shape());
  const Pipeline &p = a.example.pipeline;
  CHECK(to_string(p.func("lb_loss_fraction")) ==
        "lb_loss_fraction(e) = sum(r, [expert(r) == e]) / extent(route.pairs)");
  CHECK(to_string(p.func("lb_loss_mean_prob")) == "lb_loss_mean_prob(e) = sum(t, probs(t, e)) / extent(T)");
  CHECK(to_string(p.func("lb_loss")) == "lb_loss() = 0.04 * sum(e, lb_loss_fraction(e) * lb_loss_mean_prob(e))");
  CHECK(to_string(p.func("z_loss_lse")) == "z_loss_lse(t) = log(sum(e, exp(logits(t, e))))");
  CHECK(to_string(p.func("z_loss")) == "z_loss() = 0.001 * sum(t, z_loss_lse(t) * z_loss_lse(t)) / extent(T)");
}

TEST_CASE("aux losses: each loss alone against finite differences") {
  ExampleShape s = finite_difference_shape();
  for (const std::string name : {"moe_mlp", "swiglu_moe"}) {
    CAPTURE(name);
    AuxLossLayer a = make_aux_loss_example(name, s, {1.0, 1.0});
    TensorMap in = example_inputs(a.example, s, 11);
    for (const std::string &loss : {a.load_balancing_loss, a.z_loss}) {
      CAPTURE(loss);
      Func f = a.example.pipeline.func(loss);
      check_coverage(name + " " + loss,
                     moeforge::testing::check_gradients(a.example.pipeline, f, in, {"x", "wr"}, 5, 24), 2);
      // A loss reads only the router: no gradient reaches the experts, and
      // the routing counts are a constant (no d_lb_loss_fraction).
      Gradients g = grad(a.example.pipeline, f);
      CHECK(g.seed == "d_" + loss);
      CHECK_THROWS_WITH_AS(g["w1"], doctest::Contains("does not depend on it"), UserError);
      CHECK(g.of.count("lb_loss_fraction") == 0);
    }
  }
}

TEST_CASE("aux losses: y and both losses together against finite differences") {
  ExampleShape s = finite_difference_shape();
  for (const std::string name : {"moe_mlp", "swiglu_moe"}) {
    CAPTURE(name);
    // The example's coefficients, and large ones that make the losses'
    // share of the router gradient as large as y's.
    for (AuxLossCoefficients c : {AuxLossCoefficients{}, AuxLossCoefficients{2.0, 0.5}}) {
      AuxLossLayer a = make_aux_loss_example(name, s, c);
      std::vector<std::string> wrt{"x", "wr", "w1", "w2"};
      if (name == "swiglu_moe")
        wrt.push_back("w3");
      TensorMap in = example_inputs(a.example, s, 13);
      check_coverage(name + " y + losses", check_gradients(a.example.pipeline, a.output_funcs(), in, wrt, 3),
                     wrt.size());
    }
  }
}

TEST_CASE("aux losses: the gradient of several outputs is the sum of their gradients") {
  ExampleShape s = finite_difference_shape();
  AuxLossLayer a = make_aux_loss_example("swiglu_moe", s, {2.0, 0.5});
  const Pipeline &p = a.example.pipeline;
  TensorMap in = example_inputs(a.example, s, 17);
  std::mt19937_64 rng(1);
  EvalResult fwd = evaluate(p, in);
  std::vector<Func> outs = a.output_funcs();
  TensorMap with_seeds = in;
  Gradients all = grad(p, outs);
  CHECK(all.seeds == std::vector<std::string>{"d_y", "d_lb_loss", "d_z_loss"});
  CHECK(all.seed == "d_y");
  for (const std::string &seed : all.seeds)
    with_seeds[seed] = random_tensor(fwd[seed.substr(2)].shape, rng, -1, 1, false);
  EvalResult total = evaluate(all.pipeline, only_buffers_of(all.pipeline, with_seeds));
  for (const std::string name : {"x", "wr", "w1"}) {
    CAPTURE(name);
    HostTensor sum(in.at(name).shape);
    for (const Func &o : outs) {
      Gradients one = grad(p, o);
      if (!one.of.count(name))
        continue; // the losses do not reach the experts
      EvalResult r = evaluate(one.pipeline, only_buffers_of(one.pipeline, with_seeds));
      for (int64_t k = 0; k < sum.size(); ++k)
        sum.data[k] += r[one[name].name()].data[k];
    }
    const HostTensor &got = total[all[name].name()];
    for (int64_t k = 0; k < sum.size(); ++k)
      CHECK(got.data[k] == doctest::Approx(sum.data[k]).epsilon(1e-12));
  }
}

TEST_CASE("aux losses: an output that another output reads gets its seed plus their terms") {
  Dim T = Dim::dynamic("T"), D("D", 3);
  Var t("t", T), i("i", D);
  Input a("a", {T, D}, DType::f32);
  Param w("w", {D}, DType::f32);
  Func g("g"), f("f");
  g(t, i) = tanh(a(t, i) * w(i));
  f(t) = sum(i, g(t, i) * g(t, i));
  Pipeline p({f, g});
  Gradients gr = grad(p, {f, g}, {"", "seed_g"});
  CHECK(gr.seeds == std::vector<std::string>{"d_f", "seed_g"});
  CHECK(gr["g"].name() == "seed_g_total");
  CHECK(to_string(gr["g"]) == "seed_g_total(t, i) = seed_g(t, i) + d_f(t) * g(t, i) + g(t, i) * d_f(t)");
  std::mt19937_64 rng(4);
  TensorMap in{{"a", random_tensor({5, 3}, rng, -1, 1, false)}, {"w", random_tensor({3}, rng, -1, 1, false)}};
  auto r = check_gradients(p, {f, g}, in, {"a", "w"});
  CHECK(r.checked == 18);
  // A single output in the list is the single-output grad.
  CHECK(to_string(grad(p, {f})["a"]) == to_string(grad(p, f)["a"]));
}

TEST_CASE("aux losses: perturbations that flip the routing are skipped") {
  Dim T = Dim::dynamic("T"), E("E", 3);
  Var t("t", T), e("e", E);
  Input z("z", {T, E}, DType::f32);
  Func logits("logits"), probs("probs");
  logits(t, e) = z(t, e) * 1.0;
  probs(t, e) = softmax(e, logits(t, e));
  Route route = top_k(probs, e, 1);
  Func lb = load_balancing_loss(route, probs, e);
  Func zl = z_loss(logits, e);
  std::mt19937_64 rng(9);
  TensorMap in{{"z", random_tensor({4, 3}, rng, -1, 1, false)}};
  // Token 0's two best experts tie to within the finite-difference step.
  in["z"].at({0, 0}) = 0.5;
  in["z"].at({0, 1}) = 0.5 + 1e-9;
  in["z"].at({0, 2}) = -1.0;
  Pipeline p({lb, zl});
  auto r = check_gradients(p, {lb, zl}, in, {"z"});
  CHECK(r.skipped >= 1);
  CHECK(r.checked == r.attempted - r.skipped);
  CHECK(r.checked >= 8);
}

TEST_CASE("aux losses: bad arguments are named with their fix") {
  Dim T = Dim::dynamic("T"), E("E", 4), E2("E2", 4), D("D", 2);
  Var t("t", T), e("e", E), e2("e2", E2), i("i", D);
  Input z("z", {T, E}, DType::f32), z2("z2", {T, E2}, DType::f32), v("v", {T}, DType::f32);
  Func probs("probs"), other("other"), flat("flat"), undefined("undefined");
  probs(t, e) = softmax(e, z(t, e));
  other(t, e2) = softmax(e2, z2(t, e2));
  flat(t) = v(t);
  Route route = top_k(probs, e, 2);
  CHECK_THROWS_WITH_AS(load_balancing_loss(route, other, e2),
                       doctest::Contains("ranges over E2 but route 'route' chooses among E"), UserError);
  CHECK_THROWS_WITH_AS(load_balancing_loss(route, probs, e2),
                       doctest::Contains("'e2' is not an index of 'probs(t, e)'"), UserError);
  CHECK_THROWS_WITH_AS(load_balancing_loss(route, undefined, e), doctest::Contains("'undefined' is not defined yet"),
                       UserError);
  CHECK_THROWS_WITH_AS(z_loss(flat, t), doctest::Contains("must be a Func of (token, expert)"), UserError);
  CHECK_THROWS_WITH_AS(z_loss(probs, e, {"zl", NAN}), doctest::Contains("give a finite weight"), UserError);

  Func lb = load_balancing_loss(route, probs, e);
  Pipeline p({lb});
  CHECK_THROWS_WITH_AS(grad(p, std::vector<Func>{}), doctest::Contains("no output Func given"), UserError);
  CHECK_THROWS_WITH_AS(grad(p, {lb, lb}), doctest::Contains("given twice"), UserError);
  CHECK_THROWS_WITH_AS(grad(p, {lb, probs}, {"s"}), doctest::Contains("give one seed name per output"), UserError);
  CHECK_THROWS_WITH_AS(grad(p, {lb, probs}, {"s", "s"}), doctest::Contains("given for two outputs"), UserError);
  CHECK_THROWS_WITH_AS(grad(p, {lb}, {"probs"}), doctest::Contains("already a Func of the pipeline"), UserError);
  // The fraction reads only the routing: a constant, nothing to differentiate.
  CHECK_THROWS_WITH_AS(grad(p, p.func("lb_loss_fraction")), doctest::Contains("reads no Input or Param"), UserError);
}
