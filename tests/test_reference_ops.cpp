// The reference evaluator on single operations: every unary and binary op
// against the std:: formula, broadcasting between operands with different
// index sets, sums that are contractions and sums that are plain reductions,
// nested sums and softmax.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>

#include "backends/reference/evaluate.h"
#include "dsl/moeforge.h"
#include "moe_loops.h"

using namespace moeforge;

namespace {

constexpr int64_t kT = 5, kD = 4, kF = 3;

struct World {
  Dim T = Dim::dynamic("T"), D{"D", kD}, F{"F", kF};
  Var t{"t", T}, i{"i", D}, j{"j", F}, i2{"i2", D};
  Input a{"a", {T, D}, DType::f32}, b{"b", {T, D}, DType::f32};
  Param w{"w", {D, F}, DType::f32}, c{"c", {F}, DType::f32};
  TensorMap inputs;

  World(double lo = -2.0, double hi = 2.0) {
    std::mt19937_64 rng(42);
    inputs["a"] = random_tensor({kT, kD}, rng, lo, hi, false);
    inputs["b"] = random_tensor({kT, kD}, rng, 0.5, 2.0, false); // a safe divisor
    inputs["w"] = random_tensor({kD, kF}, rng, -1.0, 1.0, false);
    inputs["c"] = random_tensor({kF}, rng, -1.0, 1.0, false);
  }

  // Evaluates a pipeline of the one Func f, keeping only the inputs it reads.
  HostTensor run(const Func &f, Precision prec = Precision::f64) const {
    Pipeline p({f});
    TensorMap in;
    for (const BufferPtr &buf : p.buffers())
      in[buf->name] = inputs.at(buf->name);
    return evaluate(p, in, prec)[f.name()];
  }
  double A(int64_t t_, int64_t i_) const { return inputs.at("a").at({t_, i_}); }
  double B(int64_t t_, int64_t i_) const { return inputs.at("b").at({t_, i_}); }
  double W(int64_t i_, int64_t j_) const { return inputs.at("w").at({i_, j_}); }
  double C(int64_t j_) const { return inputs.at("c").at({j_}); }
};

// A (T, D) tensor of want(t, i).
HostTensor table(const std::function<double(int64_t, int64_t)> &want) {
  HostTensor out({kT, kD});
  for (int64_t t = 0; t < kT; ++t)
    for (int64_t i = 0; i < kD; ++i)
      out.at({t, i}) = want(t, i);
  return out;
}

} // namespace

TEST_CASE("reference ops: unary ops against std formulas") {
  World w;
  struct Case {
    const char *name;
    std::function<Expr(const Expr &)> make;
    std::function<double(double)> want;
    bool positive; // log needs positive arguments
  };
  const Case cases[] = {
      {"neg", [](const Expr &x) { return -x; }, [](double x) { return -x; }, false},
      {"exp", [](const Expr &x) { return exp(x); }, [](double x) { return std::exp(x); }, false},
      {"log", [](const Expr &x) { return log(x); }, [](double x) { return std::log(x); }, true},
      {"tanh", [](const Expr &x) { return tanh(x); }, [](double x) { return std::tanh(x); }, false},
      {"sigmoid", [](const Expr &x) { return sigmoid(x); }, [](double x) { return 1.0 / (1.0 + std::exp(-x)); }, false},
      {"relu", [](const Expr &x) { return relu(x); }, [](double x) { return x > 0 ? x : 0.0; }, false},
      {"gelu", [](const Expr &x) { return gelu(x); },
       [](double x) {
         return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / 3.14159265358979323846) * (x + 0.044715 * x * x * x)));
       },
       false},
      {"silu", [](const Expr &x) { return silu(x); }, [](double x) { return x * (1.0 / (1.0 + std::exp(-x))); }, false},
      {"sqrt", [](const Expr &x) { return sqrt(x); }, [](double x) { return std::sqrt(x); }, true},
      {"rsqrt", [](const Expr &x) { return rsqrt(x); }, [](double x) { return 1.0 / std::sqrt(x); }, true},
  };
  for (const Case &c : cases) {
    INFO("op " << c.name);
    Func f(c.name, DType::f32);
    Expr arg = c.positive ? w.b(w.t, w.i) : w.a(w.t, w.i);
    f(w.t, w.i) = c.make(arg);
    HostTensor want = table([&](int64_t t, int64_t i) { return c.want(c.positive ? w.B(t, i) : w.A(t, i)); });
    loops::check_close(w.run(f), want, 1e-14, c.name);
    loops::check_close(w.run(f, Precision::f32), want, 2e-6, c.name);
  }
  // relu really clamps: some inputs are negative.
  CHECK(std::any_of(w.inputs["a"].data.begin(), w.inputs["a"].data.end(), [](double v) { return v < 0; }));
}

TEST_CASE("reference ops: binary ops against std formulas") {
  World w;
  struct Case {
    const char *name;
    std::function<Expr(const Expr &, const Expr &)> make;
    std::function<double(double, double)> want;
  };
  const Case cases[] = {
      {"add", [](const Expr &x, const Expr &y) { return x + y; }, [](double x, double y) { return x + y; }},
      {"sub", [](const Expr &x, const Expr &y) { return x - y; }, [](double x, double y) { return x - y; }},
      {"mul", [](const Expr &x, const Expr &y) { return x * y; }, [](double x, double y) { return x * y; }},
      {"div", [](const Expr &x, const Expr &y) { return x / y; }, [](double x, double y) { return x / y; }},
      {"max", [](const Expr &x, const Expr &y) { return max(x, y); },
       [](double x, double y) { return std::max(x, y); }},
  };
  for (const Case &c : cases) {
    INFO("op " << c.name);
    Func f(c.name, DType::f32);
    f(w.t, w.i) = c.make(w.a(w.t, w.i), w.b(w.t, w.i));
    HostTensor want = table([&](int64_t t, int64_t i) { return c.want(w.A(t, i), w.B(t, i)); });
    loops::check_close(w.run(f), want, 1e-15, c.name);
    loops::check_close(w.run(f, Precision::f32), want, 1e-6, c.name);
    // Operand order matters for sub, div (and is checked for all).
    Func g(std::string(c.name) + "_swapped", DType::f32);
    g(w.t, w.i) = c.make(w.b(w.t, w.i), w.a(w.t, w.i));
    HostTensor want_g = table([&](int64_t t, int64_t i) { return c.want(w.B(t, i), w.A(t, i)); });
    loops::check_close(w.run(g), want_g, 1e-15, c.name);
  }
  // Constants on either side.
  Func k("k", DType::f32);
  k(w.t, w.i) = 1.5 - w.a(w.t, w.i) / 4.0 + max(w.a(w.t, w.i), 0.25) * -2.0;
  HostTensor want_k =
      table([&](int64_t t, int64_t i) { return 1.5 - w.A(t, i) / 4.0 + std::max(w.A(t, i), 0.25) * -2.0; });
  loops::check_close(w.run(k), want_k, 1e-15, "constants");
}

TEST_CASE("reference ops: broadcasting operands with different index sets") {
  World w;
  // a(t, i) * c(j): an outer product over the free indices, in LHS order.
  Func outer("outer", DType::f32);
  outer(w.t, w.i, w.j) = w.a(w.t, w.i) * w.c(w.j);
  HostTensor got = w.run(outer);
  REQUIRE(got.shape == std::vector<int64_t>{kT, kD, kF});
  HostTensor want({kT, kD, kF});
  for (int64_t t = 0; t < kT; ++t)
    for (int64_t i = 0; i < kD; ++i)
      for (int64_t j = 0; j < kF; ++j)
        want.at({t, i, j}) = w.A(t, i) * w.C(j);
  loops::check_close(got, want, 1e-15, "outer");

  // The same values with the LHS permuted: the result follows the LHS order.
  Func perm("perm", DType::f32);
  perm(w.j, w.t, w.i) = w.c(w.j) + w.a(w.t, w.i) * w.w(w.i, w.j);
  got = w.run(perm);
  REQUIRE(got.shape == std::vector<int64_t>{kF, kT, kD});
  for (int64_t t = 0; t < kT; ++t)
    for (int64_t i = 0; i < kD; ++i)
      for (int64_t j = 0; j < kF; ++j)
        CHECK(got.at({j, t, i}) == doctest::Approx(w.C(j) + w.A(t, i) * w.W(i, j)).epsilon(1e-14));

  // An LHS index the right side does not use: copies along it.
  Func rep("rep", DType::f32);
  rep(w.t, w.j, w.i) = w.a(w.t, w.i);
  got = w.run(rep);
  REQUIRE(got.shape == std::vector<int64_t>{kT, kF, kD});
  for (int64_t t = 0; t < kT; ++t)
    for (int64_t i = 0; i < kD; ++i)
      for (int64_t j = 0; j < kF; ++j)
        CHECK(got.at({t, j, i}) == w.A(t, i));

  // The same index on both sides of a product (element-wise, no sum) and a
  // transposed read a(t, i) - w(i, j).
  Func mixed("mixed", DType::f32);
  mixed(w.i, w.j, w.t) = w.a(w.t, w.i) * w.b(w.t, w.i) - w.w(w.i, w.j);
  got = w.run(mixed);
  for (int64_t t = 0; t < kT; ++t)
    for (int64_t i = 0; i < kD; ++i)
      for (int64_t j = 0; j < kF; ++j)
        CHECK(got.at({i, j, t}) == doctest::Approx(w.A(t, i) * w.B(t, i) - w.W(i, j)).epsilon(1e-14));
}

TEST_CASE("reference ops: sums that are contractions") {
  World w;
  // A matrix product.
  Func mm("mm", DType::f32);
  mm(w.t, w.j) = sum(w.i, w.a(w.t, w.i) * w.w(w.i, w.j));
  HostTensor want({kT, kF});
  for (int64_t t = 0; t < kT; ++t)
    for (int64_t j = 0; j < kF; ++j)
      for (int64_t i = 0; i < kD; ++i)
        want.at({t, j}) += w.A(t, i) * w.W(i, j);
  loops::check_close(w.run(mm), want, 1e-13, "matmul");
  loops::check_close(w.run(mm, Precision::f32), want, 1e-5, "matmul f32");

  // Transposed output order and operands swapped.
  Func mt("mt", DType::f32);
  mt(w.j, w.t) = sum(w.i, w.w(w.i, w.j) * w.a(w.t, w.i));
  HostTensor got = w.run(mt);
  for (int64_t t = 0; t < kT; ++t)
    for (int64_t j = 0; j < kF; ++j)
      CHECK(got.at({j, t}) == doctest::Approx(want.at({t, j})).epsilon(1e-13));

  // A batched contraction: t is on both sides and stays (a row-wise dot).
  Func dot("dot", DType::f32);
  dot(w.t) = sum(w.i, w.a(w.t, w.i) * w.b(w.t, w.i));
  got = w.run(dot);
  for (int64_t t = 0; t < kT; ++t) {
    double acc = 0;
    for (int64_t i = 0; i < kD; ++i)
      acc += w.A(t, i) * w.B(t, i);
    CHECK(got.at({t}) == doctest::Approx(acc).epsilon(1e-13));
  }

  // A full contraction to a scalar: a Func of no indices.
  Func all("all", DType::f32);
  all() = sum(w.t, sum(w.i, w.a(w.t, w.i) * w.b(w.t, w.i)));
  got = w.run(all);
  REQUIRE(got.size() == 1);
  double total = 0;
  for (int64_t t = 0; t < kT; ++t)
    for (int64_t i = 0; i < kD; ++i)
      total += w.A(t, i) * w.B(t, i);
  CHECK(got.data[0] == doctest::Approx(total).epsilon(1e-13));
}

TEST_CASE("reference ops: sums that are plain reductions") {
  World w;
  Func rs("rs", DType::f32);
  rs(w.t) = sum(w.i, w.a(w.t, w.i));
  Func es("es", DType::f32);
  es(w.i) = sum(w.t, exp(w.a(w.t, w.i)) + 1.0);
  // The summed index on one side of a product only: sum(i, a) * c(j).
  Func one_side("one_side", DType::f32);
  one_side(w.t, w.j) = sum(w.i, w.a(w.t, w.i) * w.c(w.j));
  Func other_side("other_side", DType::f32);
  other_side(w.t, w.j) = sum(w.i, w.c(w.j) * w.a(w.t, w.i));
  HostTensor got_rs = w.run(rs), got_es = w.run(es), got_one = w.run(one_side), got_other = w.run(other_side);
  for (int64_t t = 0; t < kT; ++t) {
    double row = 0;
    for (int64_t i = 0; i < kD; ++i)
      row += w.A(t, i);
    CHECK(got_rs.at({t}) == doctest::Approx(row).epsilon(1e-14));
    for (int64_t j = 0; j < kF; ++j) {
      CHECK(got_one.at({t, j}) == doctest::Approx(row * w.C(j)).epsilon(1e-14));
      CHECK(got_other.at({t, j}) == doctest::Approx(row * w.C(j)).epsilon(1e-14));
    }
  }
  for (int64_t i = 0; i < kD; ++i) {
    double col = 0;
    for (int64_t t = 0; t < kT; ++t)
      col += std::exp(w.A(t, i)) + 1.0;
    CHECK(got_es.at({i}) == doctest::Approx(col).epsilon(1e-14));
  }
}

TEST_CASE("reference ops: nested sums") {
  World w;
  // sum(j, relu(sum(i, a w)) * c(j)): a contraction inside a contraction.
  Func nest("nest", DType::f32);
  nest(w.t) = sum(w.j, relu(sum(w.i, w.a(w.t, w.i) * w.w(w.i, w.j))) * w.c(w.j));
  // A double sum over two indices of one Dim: sum(i, sum(i2, a(t,i) b(t,i2) ...)).
  Func pairs("pairs", DType::f32);
  pairs(w.t) = sum(w.i, sum(w.i2, w.a(w.t, w.i) * w.b(w.t, w.i2) - w.a(w.t, w.i2)));
  HostTensor got_nest = w.run(nest), got_pairs = w.run(pairs);
  for (int64_t t = 0; t < kT; ++t) {
    double want = 0;
    for (int64_t j = 0; j < kF; ++j) {
      double inner = 0;
      for (int64_t i = 0; i < kD; ++i)
        inner += w.A(t, i) * w.W(i, j);
      want += std::max(inner, 0.0) * w.C(j);
    }
    CHECK(got_nest.at({t}) == doctest::Approx(want).epsilon(1e-13));
    double want2 = 0;
    for (int64_t i = 0; i < kD; ++i)
      for (int64_t i2 = 0; i2 < kD; ++i2)
        want2 += w.A(t, i) * w.B(t, i2) - w.A(t, i2);
    CHECK(got_pairs.at({t}) == doctest::Approx(want2).epsilon(1e-13));
  }
}

TEST_CASE("reference ops: softmax rows sum to 1") {
  World w(-30.0, 30.0); // wide logits: the max subtraction must keep exp finite
  Func sm("sm", DType::f32);
  sm(w.t, w.i) = softmax(w.i, w.a(w.t, w.i) * 3.0);
  Func cols("cols", DType::f32);
  cols(w.t, w.i) = softmax(w.t, w.a(w.t, w.i)); // along the first index
  for (Precision prec : {Precision::f64, Precision::f32}) {
    INFO("precision " << (prec == Precision::f64 ? "f64" : "f32"));
    HostTensor got = w.run(sm, prec), got_cols = w.run(cols, prec);
    double tol = prec == Precision::f64 ? 1e-14 : 1e-6;
    for (int64_t t = 0; t < kT; ++t) {
      double mx = -INFINITY, total = 0, row = 0;
      for (int64_t i = 0; i < kD; ++i)
        mx = std::max(mx, 3.0 * w.A(t, i));
      for (int64_t i = 0; i < kD; ++i)
        total += std::exp(3.0 * w.A(t, i) - mx);
      for (int64_t i = 0; i < kD; ++i) {
        CHECK(std::isfinite(got.at({t, i})));
        CHECK(got.at({t, i}) == doctest::Approx(std::exp(3.0 * w.A(t, i) - mx) / total).epsilon(tol));
        row += got.at({t, i});
      }
      CHECK(row == doctest::Approx(1.0).epsilon(tol));
    }
    for (int64_t i = 0; i < kD; ++i) {
      double col = 0;
      for (int64_t t = 0; t < kT; ++t)
        col += got_cols.at({t, i});
      CHECK(col == doctest::Approx(1.0).epsilon(tol));
    }
  }
}
