// Every user error of the algebra, the reference evaluator's input checks and
// the examples, triggered on purpose; each test checks that the message names
// the definition, the index and the fix, not just that something failed.
#include <doctest/doctest.h>

#include <functional>
#include <string>

#include "backends/reference/evaluate.h"
#include "dsl/moeforge.h"
#include "examples/examples.h"
#include "user_error.h"

using namespace moeforge;

namespace {

using testing::user_error_of;

void check_has(const std::string &msg, std::initializer_list<const char *> parts) {
  INFO("message: " << msg);
  for (const char *p : parts)
    CHECK_MESSAGE(msg.find(p) != std::string::npos, "missing '" << std::string(p) << "'");
}

// A routed world: x(T, D), w1(E, D, F), router probabilities p over lg(T, E).
struct World {
  Dim T = Dim::dynamic("T"), D{"D", 4}, F{"F", 3}, E{"E", 4};
  Var t{"t", T}, t2{"t2", T}, i{"i", D}, i2{"i2", D}, j{"j", F}, e{"e", E};
  Input x{"x", {T, D}};
  Input lg{"lg", {T, E}, DType::f32};
  Param w1{"w1", {E, D, F}};
  Func p{"p", DType::f32};
  World() { p(t, e) = softmax(e, lg(t, e)); }
};

} // namespace

TEST_CASE("dsl errors: Dim with a non-positive extent") {
  check_has(user_error_of([] { Dim d("D", 0); }),
            {"Dim 'D' has extent 0", "must be positive", "Dim.dynamic(\"D\") in Python, Dim::dynamic in C++"});
  CHECK_THROWS_WITH_AS(Dim("F", -3), doctest::Contains("Dim 'F' has extent -3"), UserError);
  Dim T = Dim::dynamic("T");
  check_has(user_error_of([&] { Dim::scaled("P", T, 0); }), {"Dim 'P' = T * 0", "the factor must be positive"});
  check_has(user_error_of([&] { Dim::scaled("P", Dim(), 2); }), {"Dim 'P' is a scaled Dim and needs a base Dim"});
}

TEST_CASE("dsl errors: empty names and empty handles") {
  check_has(user_error_of([] { Var v("v", Dim()); }), {"Var 'v' needs a Dim to range over"});
  check_has(user_error_of([] { Func f(""); }), {"a Func needs a name"});
  check_has(user_error_of([] { Input x("", {Dim("D", 2)}); }), {"an Input or Param needs a name"});
  check_has(user_error_of([] { Param w("w", {Dim("D", 2), Dim()}); }), {"dimension 1 of 'w' is an empty Dim"});
  check_has(user_error_of([] { exp(Expr()); }), {"exp() of an undefined expression"});
  check_has(user_error_of([] { -Expr(); }), {"neg() of an undefined expression"});
  check_has(user_error_of([] { Expr() * 2.0; }), {"operator * on an undefined expression"});
  check_has(user_error_of([] { max(1.0, Expr()); }), {"operator max on an undefined expression"});
  Dim D("D", 2);
  Var i("i", D);
  Input x("x", {D});
  check_has(user_error_of([&] { sum(Var(), x(i)); }), {"sum() needs a variable and a summand"});
  check_has(user_error_of([&] { sum(i, Expr()); }), {"sum() needs a variable and a summand"});
  check_has(user_error_of([&] { softmax(Var(), x(i)); }), {"softmax() needs a variable and an expression"});
  // Default-constructed Funcs and buffers: a user error, not a crash.
  Func nameless;
  check_has(user_error_of([&] { nameless(i) = x(i) * 2.0; }),
            {"a default-constructed Func has no name: make it as Func(\"name\")"});
  check_has(user_error_of([&] { (void)nameless.name(); }), {"a default-constructed Func has no name"});
  Buffer unmade; // (Input and Param have no default constructor; their base has)
  check_has(user_error_of([&] { (void)unmade(i); }),
            {"a default-constructed Input or Param has no name or shape: make it as Input(\"name\", {dims...})"});
  check_has(user_error_of([&] { (void)unmade.dims(); }), {"a default-constructed Input or Param"});
}

TEST_CASE("dsl errors: parse_dtype names the choices") {
  check_has(user_error_of([] { parse_dtype("f64"); }), {"unknown dtype 'f64'", "use f32, bf16 or f16"});
  CHECK_THROWS_WITH_AS(parse_dtype(""), doctest::Contains("unknown dtype ''"), UserError);
}

TEST_CASE("dsl errors: wrong arity") {
  World w;
  Func f("f");
  check_has(user_error_of([&] { f(w.t) = w.x(w.t); }), {"in definition of 'f'", "'x' has 2 dimensions (T, D)",
                                                        "x(t) gives 1 index", "give one index per dimension"});
  Func g("g");
  check_has(user_error_of([&] { g(w.t, w.i, w.j) = w.x(w.t, w.i) * w.w1(w.i, w.j); }),
            {"in definition of 'g'", "'w1' has 3 dimensions (E, D, F)", "w1(i, j) gives 2 indices"});
  Input v("v", {w.D});
  Func h("h");
  check_has(user_error_of([&] { h(w.t, w.i) = v(w.t, w.i); }), {"'v' has 1 dimension (D)", "gives 2 indices"});
}

TEST_CASE("dsl errors: index over the wrong Dim") {
  World w;
  Func f("f");
  check_has(user_error_of([&] { f(w.t, w.i) = w.x(w.i, w.t); }),
            {"in definition of 'f'", "index 'i' ranges over D (4)", "dimension 0 of 'x' is T", "in x(i, t)",
             "index it with a variable over T", "reorder"});
  Func g("g");
  check_has(user_error_of([&] { g(w.e, w.i, w.j) = w.w1(w.e, w.i, w.i); }),
            {"index 'i' ranges over D (4) but dimension 2 of 'w1' is F (3)"});
}

TEST_CASE("dsl errors: routed index over the wrong Dim or with the wrong variable") {
  World w;
  Route route = top_k(w.p, w.e, 2);
  Var r = route.pair();
  Func h("h");
  check_has(user_error_of([&] { h(r, w.i, w.j) = w.w1(route.token(r), w.i, w.j); }),
            {"in definition of 'h'", "token(r) ranges over T", "dimension 0 of 'w1' is E (4)",
             "index it with a variable over E"});
  check_has(user_error_of([&] { route.token(w.t); }),
            {"route 'route'", "token(t) needs the route's own pair variable 'r'", "route.pair()"});
  check_has(user_error_of([&] { route.expert(w.i); }), {"expert(i) needs the route's own pair variable 'r'"});
}

TEST_CASE("dsl errors: unbound index on the right side") {
  World w;
  Func f("f");
  check_has(user_error_of([&] { f(w.t) = w.x(w.t, w.i); }),
            {"in definition of 'f'", "index 'i' is used on the right side but is not on the left", "add it to f(...)",
             "sum(i, ...)"});
}

TEST_CASE("dsl errors: sum over a var the summand does not use") {
  World w;
  Func f("f");
  check_has(user_error_of([&] { f(w.t, w.i) = sum(w.j, w.x(w.t, w.i)); }),
            {"in definition of 'f'", "sum over 'j'", "the summand x(t, i) does not use 'j'",
             "index the summand by it or drop the sum"});
}

TEST_CASE("dsl errors: sum rebinding a bound var") {
  World w;
  Func f("f");
  check_has(user_error_of([&] { f(w.t, w.i) = sum(w.i, w.x(w.t, w.i)); }),
            {"in definition of 'f'", "sum over 'i'", "already bound", "use a new Var"});
  Func g("g");
  check_has(user_error_of([&] { g(w.t) = sum(w.i, sum(w.i, w.x(w.t, w.i))); }),
            {"in definition of 'g'", "sum over 'i', which is already bound by an enclosing sum"});
  // With a fresh variable it is fine.
  Func ok("ok");
  CHECK_NOTHROW(ok(w.t) = sum(w.i, sum(w.i2, w.x(w.t, w.i) * w.x(w.t, w.i2))));
}

TEST_CASE("dsl errors: softmax along an unused var") {
  World w;
  Func f("f", DType::f32);
  check_has(user_error_of([&] { f(w.t, w.e) = softmax(w.e, w.x(w.t, w.i)); }),
            {"in definition of 'f'", "softmax along 'e'", "x(t, i) does not use 'e'",
             "normalise along an index the expression has"});
}

TEST_CASE("dsl errors: redefining a Func") {
  World w;
  Func f("f");
  f(w.t, w.i) = w.x(w.t, w.i);
  check_has(user_error_of([&] { f(w.t, w.i) = w.x(w.t, w.i) * 2.0; }),
            {"'f' is already defined as f(...) = x(t, i)", "a Func is defined once", "use a new Func"});
  // The first definition is kept.
  CHECK(to_string(f) == "f(t, i) = x(t, i)");
  Func g("g");
  check_has(user_error_of([&] { g(w.t) = Expr(); }), {"'g' is defined by an empty expression"});
}

TEST_CASE("dsl errors: reading an undefined Func") {
  World w;
  Func g("g"), f("f");
  check_has(user_error_of([&] { Expr e = g(w.t, w.i); }),
            {"'g' is used before it is defined", "define g(...) = ... before reading it"});
  // A definition reading itself is caught the same way.
  check_has(user_error_of([&] { f(w.t, w.i) = f(w.t, w.i) + 1.0; }), {"'f' is used before it is defined"});
  // An access built below the Func handle is caught by the checker.
  Func h("h");
  check_has(user_error_of([&] {
              h(w.t, w.i) = Access::make(g.node(), {w.t, w.i});
            }),
            {"in definition of 'h'", "'g' is used before it is defined: define g(...) first"});
}

TEST_CASE("dsl errors: left side of a definition") {
  World w;
  Route route = top_k(w.p, w.e, 2);
  Var r = route.pair();
  Func dup("dup");
  check_has(user_error_of([&] { dup(w.t, w.t) = w.x(w.t, w.i) * 0.0 + 1.0; }),
            {"the left side of 'dup' uses 't' twice", "distinct variable"});
  Func routed("routed");
  check_has(user_error_of([&] { routed(route.token(r), w.i) = w.x(route.token(r), w.i); }),
            {"the left side of 'routed' uses token(r)", "must be plain variables"});
  // Two different Vars of one name: the text would print f(i, i).
  Var i_over_e("i", w.E);
  Func same_name("same_name");
  check_has(user_error_of([&] { same_name(w.i, i_over_e) = w.x(w.t, w.i) * 0.0 + 1.0; }),
            {"the left side of 'same_name' has two different indices named 'i' (over D and E)",
             "give each Var its own name"});
  Func right("right");
  check_has(user_error_of([&] { right(w.t, w.i) = w.x(w.t, w.i) + w.p(w.t, i_over_e); }),
            {"in definition of 'right': two different indices are named 'i' (over D on the left and E on the right)"});
}

TEST_CASE("dsl errors: top_k arguments") {
  World w;
  check_has(user_error_of([&] { top_k(w.p, w.e, 5); }),
            {"top_k: k = 5 but 'p' has 4 experts along 'e'", "choose 1 <= k <= 4"});
  check_has(user_error_of([&] { top_k(w.p, w.e, 0); }), {"top_k: k = 0", "choose 1 <= k <= 4"});
  check_has(user_error_of([&] { top_k(w.p, w.i, 1); }),
            {"top_k: 'i' is not an index of 'p(t, e)'", "pass the expert index"});
  Func undefined("probs");
  check_has(user_error_of([&] { top_k(undefined, w.e, 1); }),
            {"top_k: 'probs' is not defined yet", "define the router probabilities first"});
  check_has(user_error_of([&] { top_k(Func(), w.e, 1); }), {"top_k: the probabilities Func is empty"});
  Param w3("w3", {w.T, w.E, w.D});
  Func three("three", DType::f32);
  three(w.t, w.e, w.i) = w3(w.t, w.e, w.i);
  check_has(user_error_of([&] { top_k(three, w.e, 1); }),
            {"top_k: 'three' has 3 indices", "must be a Func of (token, expert)"});
  Func one("one", DType::f32);
  one(w.e) = sum(w.t, w.lg(w.t, w.e));
  check_has(user_error_of([&] { top_k(one, w.e, 1); }), {"top_k: 'one' has 1 indices"});
  // The expert Dim must be static.
  Var u("u", w.T);
  Input tt("tt", {w.T, w.T}, DType::f32);
  Func dyn("dyn", DType::f32);
  dyn(w.t, u) = tt(w.t, u);
  check_has(user_error_of([&] { top_k(dyn, u, 1); }), {"top_k: the expert Dim 'T' must have a static extent"});
  TopKOptions unnamed;
  unnamed.name = "";
  check_has(user_error_of([&] { top_k(w.p, w.e, 1, unnamed); }), {"top_k: the route needs a name"});
}

TEST_CASE("dsl errors: combine target over the wrong Dim") {
  World w;
  Route route = top_k(w.p, w.e, 2);
  Var r = route.pair();
  Func y("y");
  check_has(user_error_of([&] { y(w.i) = combine(route, w.i, route.gate(r)); }),
            {"in definition of 'y'", "the token sum of route 'route' goes to 'i', which ranges over D (4)",
             "use a variable over T"});
  Func g("g");
  check_has(user_error_of([&] { g(w.t, w.i) = expert_sum(route, w.t, w.x(route.token(r), w.i)); }),
            {"the expert sum of route 'route' goes to 't'", "use a variable over E"});
  check_has(user_error_of([&] { combine(route, Var(), route.gate(r)); }),
            {"combine() needs a route, a variable and a summand"});
}

TEST_CASE("dsl errors: combine summand not using the pair variable") {
  World w;
  Route route = top_k(w.p, w.e, 2);
  Param b("b", {w.D});
  Func y("y");
  check_has(user_error_of([&] { y(w.t, w.i) = combine(route, w.t, b(w.i)); }),
            {"in definition of 'y'", "the summand b(i) of the token sum does not use the pair variable 'r'",
             "index it by r, token(r) or expert(r)"});
}

TEST_CASE("dsl errors: combine summand using the target directly") {
  World w;
  Route route = top_k(w.p, w.e, 2);
  Var r = route.pair();
  Func y("y");
  check_has(user_error_of([&] { y(w.t, w.i) = combine(route, w.t, route.gate(r) * w.x(w.t, w.i)); }),
            {"in definition of 'y'", "uses 't' directly", "inside a token sum write token(r) instead"});
  Func dw("dw");
  check_has(user_error_of(
                [&] { dw(w.e, w.i) = expert_sum(route, w.e, w.lg(route.token(r), w.e) * w.x(route.token(r), w.i)); }),
            {"in definition of 'dw'", "uses 'e' directly", "write expert(r) instead"});
}

TEST_CASE("dsl errors: routed sum nested in a sum over the same pairs") {
  World w;
  Route route = top_k(w.p, w.e, 2);
  Var r = route.pair();
  Func g("g");
  check_has(user_error_of([&] { g(r, w.i) = combine(route, w.t, w.x(route.token(r), w.i)); }),
            {"in definition of 'g'", "a token sum of route 'route' inside another sum over its pairs 'r'",
             "sum over the pairs once"});
}

TEST_CASE("dsl errors: Pipeline construction") {
  World w;
  check_has(user_error_of([] { Pipeline p(std::vector<Func>{}); }), {"a Pipeline needs at least one output Func"});
  check_has(user_error_of([] { Pipeline p({Func()}); }), {"a Pipeline output is an empty Func"});
  check_has(user_error_of([] { Pipeline p({Func("nothing")}); }),
            {"'nothing' is part of the pipeline but never defined"});

  // Two tensors with one name.
  Input x2("x", {w.T, w.D});
  Func f("f");
  f(w.t, w.i) = w.x(w.t, w.i) + x2(w.t, w.i);
  check_has(user_error_of([&] { Pipeline p({f}); }),
            {"two different tensors are named 'x' in this pipeline", "give each Func, Input and Param its own name"});
  // A Func named like an Input.
  Func clash("lg");
  clash(w.t, w.i) = w.x(w.t, w.i);
  Func g("g");
  g(w.t, w.e, w.i) = w.lg(w.t, w.e) * clash(w.t, w.i);
  check_has(user_error_of([&] { Pipeline p({g}); }), {"two different tensors are named 'lg'"});
  // Two Dims of one name and different extents: the text could not tell
  // them apart. (One name at one extent, made twice, is the same Dim's.)
  Dim d2("D", w.D.extent() * 2);
  Var i2("i2", d2);
  Input wide("wide", {w.T, d2});
  Func both("both");
  both(w.t, w.i, i2) = w.x(w.t, w.i) * wide(w.t, i2);
  check_has(user_error_of([&] { Pipeline p({both}); }),
            {"two different Dims are named 'D' in this pipeline, of extents", "give each Dim its own name"});
  // Two Vars of one name over different Dims: the text would print
  // sum(i, x(t, i) * w(i, i)) for a contraction over D into F.
  Dim F("F", w.D.extent() + 16);
  Var i_f("i", F);
  Param wf("wf", {w.D, F});
  Func proj("proj");
  proj(w.t, i_f) = sum(w.i, w.x(w.t, w.i) * wf(w.i, i_f));
  check_has(user_error_of([&] { Pipeline p({proj}); }),
            {"two Vars named 'i' range over different Dims (", "the second in 'proj'", "give each Var its own name"});
  // One name over one Dim, made twice (a helper's own Var), is fine.
  Var i_again("i", w.D);
  Func again("again");
  again(w.t, i_again) = w.x(w.t, i_again);
  CHECK_NOTHROW(Pipeline({again}));
  // The same tensor read twice is fine.
  Func ok("ok");
  ok(w.t, w.i) = w.x(w.t, w.i) * w.x(w.t, w.i);
  CHECK_NOTHROW(Pipeline({ok}));
}

TEST_CASE("dsl errors: Pipeline lookup of unknown names") {
  Example ex = make_example("dense_mlp", ExampleShape{4, 1, 1, 4, 3});
  check_has(user_error_of([&] { ex.pipeline.func("z"); }),
            {"no Func named 'z' in this pipeline", "its Funcs are: h, y"});
  check_has(user_error_of([&] { ex.pipeline.buffer("w3"); }),
            {"no Input or Param named 'w3' in this pipeline", "it has: x, w1, w2"});
}

// ------------------------------------------------------------ evaluator inputs

TEST_CASE("evaluator errors: missing and unknown inputs") {
  ExampleShape shape{5, 4, 2, 4, 3};
  Example ex = make_example("moe_mlp", shape);
  TensorMap in = ex.random_inputs(shape, 1);
  TensorMap missing = in;
  missing.erase("w1");
  check_has(user_error_of([&] { evaluate(ex.pipeline, missing); }),
            {"no tensor given for param 'w1'", "pass one of shape w1(E, D, F)"});
  missing = in;
  missing.erase("x");
  check_has(user_error_of([&] { evaluate(ex.pipeline, missing); }), {"no tensor given for input 'x'"});
  TensorMap extra = in;
  extra["w3"] = HostTensor({4, 4, 3});
  check_has(user_error_of([&] { evaluate(ex.pipeline, extra); }), {"'w3' is not an Input or Param of this pipeline"});
  EvalResult res = evaluate(ex.pipeline, in);
  check_has(user_error_of([&] { res["nope"]; }), {"no value named 'nope' was evaluated"});
}

TEST_CASE("evaluator errors: wrong rank and wrong element count") {
  ExampleShape shape{5, 4, 2, 4, 3};
  Example ex = make_example("moe_mlp", shape);
  TensorMap in = ex.random_inputs(shape, 1);
  in["wr"] = HostTensor({4, 4, 1});
  check_has(user_error_of([&] { evaluate(ex.pipeline, in); }),
            {"'wr' has 3 dimensions (shape (4, 4, 1)) but is declared wr(D, E)"});
  in = ex.random_inputs(shape, 1);
  in["wr"].data.pop_back();
  check_has(user_error_of([&] { evaluate(ex.pipeline, in); }), {"'wr' holds 15 values but its shape needs 16"});
}

TEST_CASE("evaluator errors: extent mismatch with a static Dim") {
  ExampleShape shape{5, 4, 2, 4, 3};
  Example ex = make_example("moe_mlp", shape);
  TensorMap in = ex.random_inputs(shape, 1);
  in["w1"] = HostTensor({4, 4, 7});
  check_has(user_error_of([&] { evaluate(ex.pipeline, in); }),
            {"dimension 2 of 'w1' is F = 3", "the tensor given has extent 7", "every tensor over F must agree"});
}

TEST_CASE("evaluator errors: two tensors disagree on the dynamic T") {
  ExampleShape shape{5, 4, 2, 4, 3};
  Example ex = make_example("attention", shape);
  TensorMap in = ex.random_inputs(shape, 1);
  in["v"] = HostTensor({6, 4});
  check_has(user_error_of([&] { evaluate(ex.pipeline, in); }),
            {"dimension 0 of 'v' is T = 5", "the tensor given has extent 6", "every tensor over T must agree"});
}

TEST_CASE("evaluator errors: a dynamic Dim that no tensor binds") {
  Dim T = Dim::dynamic("T"), D("D", 3);
  Var t("t", T), i("i", D);
  Param b("b", {D});
  Func f("f");
  f(t, i) = b(i) * 2.0; // broadcast over t: nothing says how many tokens
  Pipeline p({f});
  TensorMap in;
  in["b"] = HostTensor({3}, 1.0);
  check_has(user_error_of([&] { evaluate(p, in); }),
            {"the extent of the dynamic Dim 'T' is unknown", "no Input or Param of the pipeline is indexed by it"});
}

TEST_CASE("evaluator errors: a tensor over the route pairs must have T times k rows") {
  World w;
  Route route = top_k(w.p, w.e, 2);
  Var r = route.pair();
  Input g("g", {r.dim(), w.D}, DType::f32);
  Func y("y", DType::f32);
  y(w.t, w.i) = combine(route, w.t, route.gate(r) * g(r, w.i));
  Pipeline p({y});
  TensorMap in;
  in["lg"] = HostTensor({3, 4}, 0.0);
  in["g"] = HostTensor({5, 4}, 1.0); // 3 tokens x k = 2 is 6 pairs
  check_has(user_error_of([&] { evaluate(p, in); }), {"'g'", "route.pairs", "5", "6"});
  in["g"] = HostTensor({6, 4}, 1.0);
  CHECK_NOTHROW(evaluate(p, in));
}

// ------------------------------------------------------------ examples

TEST_CASE("example errors: unknown names and impossible shapes") {
  check_has(user_error_of([] { make_example("mixtral", ExampleShape{}); }),
            {"unknown example 'mixtral'", "choose one of moe_mlp, swiglu_moe, geglu_moe, reglu_moe, expert_bias_moe, "
                                          "shared_expert_moe, deepseek_moe, rmsnorm_moe, expert_choice_moe, dense_mlp, "
                                          "attention, moa"});
  check_has(user_error_of([] {
              make_example("moe_mlp", ExampleShape{16, 4, 5, 8, 8});
            }),
            {"moe_mlp: --topk 5 with 4 experts", "choose 1 <= topk <= experts"});
  check_has(user_error_of([] {
              make_example("swiglu_moe", ExampleShape{16, 4, 0, 8, 8});
            }),
            {"swiglu_moe: --topk 0 with 4 experts"});
  check_has(user_error_of([] {
              make_example("dense_mlp", ExampleShape{0, 4, 2, 8, 8});
            }),
            {"dense_mlp: --tokens must be at least 1 (got 0)"});
  check_has(user_error_of([] {
              make_example("moe_mlp", ExampleShape{-2, 4, 2, 8, 8});
            }),
            {"--tokens must be at least 1 (got -2)"});
  check_has(user_error_of([] {
              make_example("attention", ExampleShape{4, 4, 2, 0, 8});
            }),
            {"attention: --d must be at least 1 (got 0)"});
  check_has(user_error_of([] {
              make_example("moe_mlp", ExampleShape{4, 4, 2, 8, 0});
            }),
            {"moe_mlp: --f must be at least 1 (got 0)"});
  check_has(user_error_of([] {
              make_example("moe_mlp", ExampleShape{4, 0, 1, 8, 8});
            }),
            {"moe_mlp: --experts must be at least 1 (got 0)"});
  // Routing flags do not matter to the layers without routing.
  CHECK_NOTHROW(make_example("dense_mlp", ExampleShape{4, 1, 5, 8, 8}));
}
