// Printing: every node kind as readable math with exactly the parentheses the
// meaning needs, Funcs, Dims, buffers, routes and whole Pipelines.
#include <doctest/doctest.h>

#include <sstream>
#include <string>

#include "dsl/moeforge.h"
#include "examples/examples.h"

using namespace moeforge;

namespace {

template <typename T> std::string str(const T &v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

// A small world to print in.
struct World {
  Dim T = Dim::dynamic("T"), D{"D", 4}, F{"F", 3}, E{"E", 4};
  Var t{"t", T}, i{"i", D}, j{"j", F}, e{"e", E};
  Input a{"a", {T, D}}, b{"b", {T, D}}, c{"c", {T, D}};
  Param w{"w", {E, D, F}};
};

} // namespace

TEST_CASE("dsl print: arithmetic parenthesisation") {
  World s;
  Expr a = s.a(s.t, s.i), b = s.b(s.t, s.i), c = s.c(s.t, s.i);
  CHECK(to_string(a - (b - c)) == "a(t, i) - (b(t, i) - c(t, i))");
  CHECK(to_string((a - b) - c) == "a(t, i) - b(t, i) - c(t, i)");
  CHECK(to_string(a - (b + c)) == "a(t, i) - (b(t, i) + c(t, i))");
  CHECK(to_string(a + (b - c)) == "a(t, i) + b(t, i) - c(t, i)");
  CHECK(to_string((a + b) * c) == "(a(t, i) + b(t, i)) * c(t, i)");
  CHECK(to_string(a * (b + c)) == "a(t, i) * (b(t, i) + c(t, i))");
  CHECK(to_string(a + b * c) == "a(t, i) + b(t, i) * c(t, i)");
  CHECK(to_string(a / (b * c)) == "a(t, i) / (b(t, i) * c(t, i))");
  CHECK(to_string(a / (b / c)) == "a(t, i) / (b(t, i) / c(t, i))");
  CHECK(to_string((a / b) / c) == "a(t, i) / b(t, i) / c(t, i)");
  CHECK(to_string((a - b) / (b + c)) == "(a(t, i) - b(t, i)) / (b(t, i) + c(t, i))");
}

TEST_CASE("dsl print: negation and constants") {
  World s;
  Expr a = s.a(s.t, s.i), b = s.b(s.t, s.i);
  CHECK(to_string(-a) == "-a(t, i)");
  CHECK(to_string(-(a + b)) == "-(a(t, i) + b(t, i))");
  CHECK(to_string(-(a * b)) == "-(a(t, i) * b(t, i))");
  CHECK(to_string(-a * b) == "-a(t, i) * b(t, i)");
  CHECK(to_string(a * -b) == "a(t, i) * -b(t, i)");
  CHECK(to_string(a - -b) == "a(t, i) - -b(t, i)");
  CHECK(to_string(-(-a)) == "-(-a(t, i))"); // not --a: that is a decrement
  CHECK(to_string(-Expr(-2.0)) == "-(-2)");
  CHECK(to_string(Expr(2.0)) == "2");
  CHECK(to_string(Expr(0.125)) == "0.125");
  CHECK(to_string(a * 2.0 + 1.0) == "a(t, i) * 2 + 1");
  CHECK(to_string(a * Expr(-0.5)) == "a(t, i) * -0.5");
  CHECK(to_string(Expr()) == "<undefined>");
}

TEST_CASE("dsl print: element-wise functions and max") {
  World s;
  Expr a = s.a(s.t, s.i), b = s.b(s.t, s.i);
  CHECK(to_string(max(a, b)) == "max(a(t, i), b(t, i))");
  CHECK(to_string(max(a + b, 0.0) * 2.0) == "max(a(t, i) + b(t, i), 0) * 2");
  CHECK(to_string(gelu(a * b)) == "gelu(a(t, i) * b(t, i))");
  CHECK(to_string(exp(a) + log(b)) == "exp(a(t, i)) + log(b(t, i))");
  CHECK(to_string(tanh(a - b)) == "tanh(a(t, i) - b(t, i))");
  CHECK(to_string(sigmoid(-a)) == "sigmoid(-a(t, i))");
  CHECK(to_string(relu(a) * silu(b)) == "relu(a(t, i)) * silu(b(t, i))");
  CHECK(to_string(-exp(a)) == "-exp(a(t, i))");
}

TEST_CASE("dsl print: sum softmax and routed sums") {
  World s;
  Input x("x", {s.T, s.D});
  Param w1("w1", {s.D, s.F});
  CHECK(to_string(sum(s.i, x(s.t, s.i) * w1(s.i, s.j))) == "sum(i, x(t, i) * w1(i, j))");
  CHECK(to_string(sum(s.i, x(s.t, s.i)) * 2.0) == "sum(i, x(t, i)) * 2");
  CHECK(to_string(sum(s.j, sum(s.i, x(s.t, s.i) * w1(s.i, s.j)))) == "sum(j, sum(i, x(t, i) * w1(i, j)))");

  Input lg("lg", {s.T, s.E}, DType::f32);
  CHECK(to_string(softmax(s.e, lg(s.t, s.e))) == "softmax(e, lg(t, e))");
  CHECK(to_string(softmax(s.e, lg(s.t, s.e) * 0.5)) == "softmax(e, lg(t, e) * 0.5)");
  Func probs("probs", DType::f32);
  probs(s.t, s.e) = softmax(s.e, lg(s.t, s.e));
  Route route = top_k(probs, s.e, 2);
  Var r = route.pair();
  CHECK(str(route.token(r)) == "token(r)");
  CHECK(str(route.expert(r)) == "expert(r)");
  CHECK(to_string(x(route.token(r), s.i)) == "x(token(r), i)");
  CHECK(to_string(combine(route, s.t, route.gate(r) * x(route.token(r), s.i))) ==
        "combine(route, t, route_gate(r) * x(token(r), i))");
  CHECK(to_string(expert_sum(route, s.e, x(route.token(r), s.i) * route.gate(r))) ==
        "expert_sum(route, e, x(token(r), i) * route_gate(r))");
  CHECK(to_string(s.w(route.expert(r), s.i, s.j)) == "w(expert(r), i, j)");
}

TEST_CASE("dsl print: Funcs Dims Vars buffers and routes") {
  World s;
  Func h("h");
  CHECK(to_string(h) == "h() = <undefined>");
  Input x("x", {s.T, s.D});
  Param w1("w1", {s.D, s.F}, DType::f32);
  h(s.t, s.j) = gelu(sum(s.i, x(s.t, s.i) * w1(s.i, s.j)));
  CHECK(to_string(h) == "h(t, j) = gelu(sum(i, x(t, i) * w1(i, j)))");
  CHECK(str(s.T) == "T (dynamic)");
  CHECK(str(s.D) == "D = 4");
  CHECK(str(Dim::scaled("P", s.T, 2)) == "P = T * 2");
  CHECK(str(Dim()) == "<no dim>");
  CHECK(str(s.i) == "i in D");
  CHECK(str(x) == "input x(T, D) : bf16");
  CHECK(str(w1) == "param w1(D, F) : f32");

  Input lg("lg", {s.T, s.E}, DType::f32);
  Func probs("probs", DType::f32);
  probs(s.t, s.e) = softmax(s.e, lg(s.t, s.e));
  Route route = top_k(probs, s.e, 2);
  CHECK(str(*route.node()) == "route = top_k(probs, e, k = 2)  -- pairs r over route.pairs = T * 2");
  CHECK(to_string(route.gate_func()) == "route_gate(r) = probs(token(r), expert(r))");
  TopKOptions opts;
  opts.renormalize = true;
  opts.name = "mix";
  Route mix = top_k(probs, s.e, 3, opts);
  CHECK(to_string(mix.gate_func()) == "mix_gate(r) = probs(token(r), expert(r)) / mix_gate_sum(token(r))");
}

TEST_CASE("dsl print: the moe_mlp pipeline") {
  Example ex = make_example("moe_mlp", ExampleShape{256, 8, 2, 64, 128});
  std::string text = str(ex.pipeline);
  INFO(text);
  const char *lines[] = {
      "dims:  T (dynamic);  D = 64;  E = 8;  route.pairs = T * 2;  F = 128;\n",
      "input x(T, D) : bf16\n",
      "param wr(D, E) : bf16\n",
      "param w1(E, D, F) : bf16\n",
      "param w2(E, F, D) : bf16\n",
      "logits(t, e) = sum(i, x(t, i) * wr(i, e))  : f32\n",
      "probs(t, e) = softmax(e, logits(t, e))  : f32\n",
      "route = top_k(probs, e, k = 2)  -- pairs r over route.pairs = T * 2\n",
      "route_gate(r) = probs(token(r), expert(r))  : f32\n",
      "h(r, j) = gelu(sum(i, x(token(r), i) * w1(expert(r), i, j)))  : bf16\n",
      "o(r, i) = sum(j, h(r, j) * w2(expert(r), j, i))  : bf16\n",
      "y(t, i) = combine(route, t, route_gate(r) * o(r, i))  : f32\n",
      "outputs: y\n",
  };
  // Every line, in this order, and nothing else.
  std::string expected;
  for (const char *l : lines)
    expected += l;
  CHECK(text == expected);
  CHECK(text.find("h(r, j) = gelu(sum(i, x(token(r), i) * w1(expert(r), i, j)))") != std::string::npos);
}

TEST_CASE("dsl print: the swiglu_moe and attention pipelines") {
  Example sw = make_example("swiglu_moe", ExampleShape{256, 8, 2, 64, 128});
  std::string text = str(sw.pipeline);
  INFO(text);
  CHECK(text.find("route_gate_sum(t) = combine(route, t, probs(token(r), expert(r)))  : f32\n") != std::string::npos);
  CHECK(text.find("route_gate(r) = probs(token(r), expert(r)) / route_gate_sum(token(r))  : f32\n") !=
        std::string::npos);
  CHECK(text.find("h(r, j) = silu(sum(i, x(token(r), i) * w1(expert(r), i, j))) * "
                  "sum(i, x(token(r), i) * w3(expert(r), i, j))  : bf16\n") != std::string::npos);
  CHECK(text.find("param w3(E, D, F) : bf16\n") != std::string::npos);

  Example at = make_example("attention", ExampleShape{256, 8, 2, 64, 128});
  std::string att = str(at.pipeline);
  INFO(att);
  CHECK(att == "dims:  T (dynamic);  D = 64;\n"
               "input q(T, D) : bf16\n"
               "input k(T, D) : bf16\n"
               "input v(T, D) : bf16\n"
               "p(t, u) = softmax(u, sum(i, q(t, i) * k(u, i)) * 0.125)  : f32\n"
               "out(t, i) = sum(u, p(t, u) * v(u, i))  : f32\n"
               "outputs: out\n");
}
