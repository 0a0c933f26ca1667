// Building the algebra: Dims, Vars, tensors, Func definitions, free variables,
// dtype inference, Pipeline collection and the IRMutator's sharing contract.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "dsl/moeforge.h"
#include "examples/examples.h"

using namespace moeforge;

namespace {

std::vector<std::string> names(const std::vector<Var> &vs) {
  std::vector<std::string> out;
  for (const Var &v : vs)
    out.push_back(v.name());
  return out;
}

std::vector<std::string> step_names(const Pipeline &p) {
  std::vector<std::string> out;
  for (const Pipeline::Step &s : p.steps())
    out.push_back(s.route ? "top_k:" + s.route->name : s.func->name);
  return out;
}

} // namespace

TEST_CASE("dsl build: static dynamic and scaled Dims") {
  Dim D("D", 64);
  CHECK(D.name() == "D");
  CHECK(D.extent() == 64);
  CHECK_FALSE(D.is_dynamic());
  CHECK(D.defined());

  Dim T = Dim::dynamic("T");
  CHECK(T.name() == "T");
  CHECK(T.is_dynamic());
  CHECK(T.extent() == -1);

  Dim P = Dim::scaled("P", T, 2);
  CHECK(P.is_dynamic());
  CHECK(P.get()->base.get() == T.get());
  CHECK(P.get()->factor == 2);
  Dim S = Dim::scaled("S", D, 3);
  CHECK_FALSE(S.is_dynamic());
  CHECK(S.extent() == 192);

  // Identity, not name, makes two Dims the same.
  Dim D2("D", 64);
  CHECK_FALSE(D.same_as(D2));
  Dim D3 = D;
  CHECK(D3 == D);
  CHECK_FALSE(Dim().defined());
}

TEST_CASE("dsl build: Vars range over their Dim") {
  Dim T = Dim::dynamic("T");
  Var t("t", T), t2("t", T);
  CHECK(t.name() == "t");
  CHECK(t.dim().same_as(T));
  CHECK_FALSE(t.same_as(t2)); // two Vars are different even with one name
  Var copy = t;
  CHECK(copy == t);
}

TEST_CASE("dsl build: Input and Param record kind dims and dtype") {
  Dim T = Dim::dynamic("T"), D("D", 4);
  Input x("x", {T, D});
  Param w("w", {D, D}, DType::f32);
  CHECK(x.name() == "x");
  CHECK(x.kind() == BufferKind::input);
  CHECK(x.dtype() == DType::bf16); // the default storage type
  REQUIRE(x.dims().size() == 2);
  CHECK(x.dims()[0].same_as(T));
  CHECK(x.dims()[1].same_as(D));
  CHECK(w.kind() == BufferKind::param);
  CHECK(w.dtype() == DType::f32);
}

TEST_CASE("dsl build: a Func definition records its args and body") {
  Dim T = Dim::dynamic("T"), D("D", 4), F("F", 3);
  Var t("t", T), i("i", D), j("j", F);
  Input x("x", {T, D});
  Param w("w", {D, F});
  Func h("h");
  CHECK_FALSE(h.is_defined());
  Expr body = sum(i, x(t, i) * w(i, j));
  h(t, j) = body;
  CHECK(h.is_defined());
  CHECK(names(h.args()) == std::vector<std::string>{"t", "j"});
  CHECK(h.body().same_as(body));
  REQUIRE(h.body().as<Sum>() != nullptr);
  CHECK(h.body().as<Sum>()->var.same_as(i));
  auto *mul = h.body().as<Sum>()->body.as<Binary>();
  REQUIRE(mul != nullptr);
  CHECK(mul->op == BinaryOp::mul);
  REQUIRE(mul->a.as<Access>() != nullptr);
  CHECK(mul->a.as<Access>()->buffer == x.node());
  CHECK(mul->a.as<Access>()->target_rank() == 2);

  // Reading the Func makes an Access to its node.
  Expr read = h(t, j);
  REQUIRE(read.as<Access>() != nullptr);
  CHECK(read.as<Access>()->func == h.node());
  CHECK(read.as<Access>()->target_name() == "h");
  CHECK(read.as<Access>()->target_dim(1).same_as(F));
}

TEST_CASE("dsl build: free_vars in order of first appearance") {
  Dim T = Dim::dynamic("T"), D("D", 4), F("F", 3), E("E", 4);
  Var t("t", T), i("i", D), j("j", F), e("e", E);
  Input x("x", {T, D});
  Param w("w", {D, F});
  CHECK(names(free_vars(x(t, i) * w(i, j))) == std::vector<std::string>{"t", "i", "j"});
  CHECK(names(free_vars(w(i, j) + x(t, i))) == std::vector<std::string>{"i", "j", "t"});
  CHECK(names(free_vars(sum(i, x(t, i) * w(i, j)))) == std::vector<std::string>{"t", "j"});
  CHECK(names(free_vars(softmax(i, x(t, i)))) == std::vector<std::string>{"t", "i"});
  CHECK(free_vars(Expr(2.0)).empty());

  // A combine binds the pair variable and frees its target.
  Input lg("lg", {T, E}, DType::f32);
  Func p("p", DType::f32);
  p(t, e) = softmax(e, lg(t, e));
  Route route = top_k(p, e, 2);
  Var r = route.pair();
  CHECK(names(free_vars(x(route.token(r), i))) == std::vector<std::string>{"r", "i"});
  CHECK(names(free_vars(combine(route, t, route.gate(r) * x(route.token(r), i)))) ==
        std::vector<std::string>{"t", "i"});
}

TEST_CASE("dsl build: dtype bf16 stays bf16") {
  Dim T = Dim::dynamic("T"), D("D", 4), F("F", 3);
  Var t("t", T), i("i", D), j("j", F);
  Input x("x", {T, D});
  Param w("w", {D, F});
  CHECK((x(t, i) * x(t, i)).dtype() == DType::bf16);
  Func h("h");
  h(t, j) = gelu(sum(i, x(t, i) * w(i, j)));
  CHECK(h.dtype() == DType::bf16);
  Func g("g");
  g(t, j) = h(t, j) - h(t, j);
  CHECK(g.dtype() == DType::bf16);
}

TEST_CASE("dsl build: dtype mixing with an f32 Func widens to f32") {
  Dim T = Dim::dynamic("T"), D("D", 4);
  Var t("t", T), i("i", D);
  Input x("x", {T, D});
  Input x16("x16", {T, D}, DType::f16);
  Func s("s", DType::f32);
  s(t, i) = x(t, i);
  CHECK(s.dtype() == DType::f32);
  Func mixed("mixed");
  mixed(t, i) = x(t, i) * s(t, i);
  CHECK(mixed.dtype() == DType::f32);
  CHECK((s(t, i) + x(t, i)).dtype() == DType::f32);
  // Two different 16-bit types also widen.
  CHECK((x(t, i) + x16(t, i)).dtype() == DType::f32);
  CHECK((x16(t, i) * x16(t, i)).dtype() == DType::f16);
  CHECK(promote(DType::bf16, DType::f16) == DType::f32);
  CHECK(promote(DType::f16, DType::f16) == DType::f16);
}

TEST_CASE("dsl build: dtype weak constants adopt the other type") {
  Dim T = Dim::dynamic("T"), D("D", 4);
  Var t("t", T), i("i", D);
  Input x("x", {T, D});
  Expr two = 2.0;
  CHECK(two.get()->weak_type);
  CHECK((x(t, i) * 2.0).dtype() == DType::bf16);
  CHECK((0.5 + x(t, i)).dtype() == DType::bf16);
  CHECK((x(t, i) * exp(Expr(1.0))).dtype() == DType::bf16);
  CHECK((x(t, i) / (Expr(1.0) + Expr(2.0))).dtype() == DType::bf16);
  Func f("f");
  f(t, i) = 1.0 - x(t, i) * 3.0;
  CHECK(f.dtype() == DType::bf16);
  // A constant with an explicit type is not weak: it promotes like a tensor.
  Expr strong = Const::make(2.0, DType::f32);
  CHECK_FALSE(strong.get()->weak_type);
  CHECK((x(t, i) * strong).dtype() == DType::f32);
  CHECK((x(t, i) * Const::make(2.0, DType::bf16)).dtype() == DType::bf16);
}

TEST_CASE("dsl build: declared storage types win") {
  Dim T = Dim::dynamic("T"), D("D", 4);
  Var t("t", T), i("i", D);
  Input x("x", {T, D});
  Input xf("xf", {T, D}, DType::f32);
  Func down("down", DType::bf16);
  down(t, i) = xf(t, i) * xf(t, i); // an f32 body stored as bf16
  CHECK(down.dtype() == DType::bf16);
  Func up("up", DType::f32);
  up(t, i) = x(t, i); // a bf16 body stored as f32
  CHECK(up.dtype() == DType::f32);
  Func half("half", DType::f16);
  half(t, i) = x(t, i);
  CHECK(half.dtype() == DType::f16);
  // Readers see the stored type.
  CHECK((down(t, i) * x(t, i)).dtype() == DType::bf16);
  CHECK(parse_dtype("bf16") == DType::bf16);
  CHECK(std::string(dtype_name(DType::f16)) == "f16");
  CHECK(dtype_bytes(DType::f32) == 4);
  CHECK(dtype_bytes(DType::bf16) == 2);
}

TEST_CASE("dsl build: top_k makes a route with pairs and gates") {
  Dim T = Dim::dynamic("T"), E("E", 8);
  Var t("t", T), e("e", E);
  Input lg("lg", {T, E}, DType::f32);
  Func p("p", DType::f32);
  p(t, e) = softmax(e, lg(t, e));
  Route route = top_k(p, e, 3);
  CHECK(route.k() == 3);
  CHECK(route.name() == "route");
  CHECK(route.pair().name() == "r");
  const Dim &pairs = route.pair().dim();
  CHECK(pairs.name() == "route.pairs");
  CHECK(pairs.is_dynamic());
  CHECK(pairs.get()->base.get() == T.get());
  CHECK(pairs.get()->factor == 3);
  CHECK(route.node()->token_var.same_as(t));
  CHECK(route.node()->expert_var.same_as(e));
  CHECK(route.gate_func().name() == "route_gate");
  CHECK(route.gate_func().dtype() == DType::f32);
  Index tok = route.token(route.pair());
  CHECK(tok.field == RouteField::token);
  CHECK(tok.dim().same_as(T));
  CHECK(route.expert(route.pair()).dim().same_as(E));

  // probs given as p(e, t) works too: the expert index is found by identity.
  Input lg2("lg2", {E, T}, DType::f32);
  Func q("q", DType::f32);
  q(e, t) = lg2(e, t);
  TopKOptions opts;
  opts.name = "mixtral";
  opts.renormalize = true;
  Route r2 = top_k(q, e, 2, opts);
  CHECK(r2.name() == "mixtral");
  CHECK(r2.pair().dim().name() == "mixtral.pairs");
  CHECK(r2.node()->token_var.same_as(t));
  CHECK(r2.gate_func().name() == "mixtral_gate");
  // Renormalised gates divide by the per-token sum.
  auto *div = r2.gate_func().body().as<Binary>();
  REQUIRE(div != nullptr);
  CHECK(div->op == BinaryOp::div);
  CHECK(div->b.as<Access>()->target_name() == "mixtral_gate_sum");
}

TEST_CASE("dsl build: Pipeline steps in dependency order") {
  Example ex = make_example("moe_mlp", ExampleShape{16, 4, 2, 8, 6});
  CHECK(step_names(ex.pipeline) ==
        std::vector<std::string>{"logits", "probs", "top_k:route", "route_gate", "h", "o", "y"});
  REQUIRE(ex.pipeline.routes().size() == 1);
  CHECK(ex.pipeline.routes()[0]->name == "route");
  REQUIRE(ex.pipeline.outputs().size() == 1);
  CHECK(ex.pipeline.outputs()[0].name() == "y");
  std::vector<std::string> funcs;
  for (const Func &f : ex.pipeline.funcs())
    funcs.push_back(f.name());
  CHECK(funcs == std::vector<std::string>{"logits", "probs", "route_gate", "h", "o", "y"});

  Example sw = make_example("swiglu_moe", ExampleShape{16, 4, 2, 8, 6});
  CHECK(step_names(sw.pipeline) ==
        std::vector<std::string>{"logits", "probs", "top_k:route", "route_gate_sum", "route_gate", "h", "o", "y"});
}

TEST_CASE("dsl build: Pipeline buffers in first-read order and dims") {
  Dim T = Dim::dynamic("T"), D("D", 4), F("F", 3);
  Var t("t", T), i("i", D), j("j", F);
  // Declared in one order, read in another: the pipeline follows the reads.
  Param w2("w2", {F, D}), w1("w1", {D, F});
  Input x("x", {T, D});
  Func h("h");
  h(t, j) = sum(i, x(t, i) * w1(i, j));
  Func y("y");
  y(t, i) = sum(j, h(t, j) * w2(j, i));
  Pipeline p({y});
  std::vector<std::string> bufs;
  for (const BufferPtr &b : p.buffers())
    bufs.push_back(b->name);
  CHECK(bufs == std::vector<std::string>{"x", "w1", "w2"});
  std::vector<std::string> dims;
  for (const Dim &d : p.dims())
    dims.push_back(d.name());
  CHECK(dims == std::vector<std::string>{"T", "D", "F"});
  CHECK(p.routes().empty());

  Example ex = make_example("moe_mlp", ExampleShape{16, 4, 2, 8, 6});
  dims.clear();
  for (const Dim &d : ex.pipeline.dims())
    dims.push_back(d.name());
  CHECK(dims == std::vector<std::string>{"T", "D", "E", "route.pairs", "F"});
  bufs.clear();
  for (const BufferPtr &b : ex.pipeline.buffers())
    bufs.push_back(b->name);
  CHECK(bufs == std::vector<std::string>{"x", "wr", "w1", "w2"});
}

TEST_CASE("dsl build: Pipeline func and buffer lookup") {
  Example ex = make_example("moe_mlp", ExampleShape{16, 4, 2, 8, 6});
  Func h = ex.pipeline.func("h");
  CHECK(h.name() == "h");
  CHECK(h.node() == ex.pipeline.funcs()[3].node());
  CHECK(ex.pipeline.func("route_gate").args()[0].name() == "r");
  BufferPtr w1 = ex.pipeline.buffer("w1");
  REQUIRE(w1 != nullptr);
  CHECK(w1->kind == BufferKind::param);
  CHECK(w1->dims.size() == 3);
  CHECK(ex.pipeline.buffer("x")->kind == BufferKind::input);
}

TEST_CASE("dsl build: Pipeline with two outputs lists shared steps once") {
  Dim T = Dim::dynamic("T"), D("D", 4);
  Var t("t", T), i("i", D);
  Input x("x", {T, D});
  Func a("a");
  a(t, i) = relu(x(t, i));
  Func b("b");
  b(t, i) = a(t, i) * 2.0;
  Func c("c");
  c(t, i) = a(t, i) + x(t, i);
  Pipeline p({b, c});
  CHECK(step_names(p) == std::vector<std::string>{"a", "b", "c"});
  CHECK(p.buffers().size() == 1);
  CHECK(p.outputs().size() == 2);
  // Outputs listed twice are still one step.
  Pipeline q({c, c, a});
  CHECK(step_names(q) == std::vector<std::string>{"a", "c"});
}

namespace {

// Changes nothing.
struct Identity : IRMutator {};

// Replaces the constant 2 by 3.
struct TwoToThree : IRMutator {
  Expr mutate_node(const Const &c, const Expr &self) override { return c.value == 2.0 ? Expr(3.0) : self; }
};

struct CountAccesses : IRVisitor {
  int n = 0;
  void visit_node(const Access &) override { ++n; }
};

} // namespace

TEST_CASE("dsl build: IRMutator returns the same node when nothing changes") {
  Dim T = Dim::dynamic("T"), D("D", 4), E("E", 4);
  Var t("t", T), i("i", D), e("e", E);
  Input x("x", {T, D});
  Input lg("lg", {T, E}, DType::f32);
  Func p("p", DType::f32);
  p(t, e) = softmax(e, lg(t, e));
  Route route = top_k(p, e, 2);
  Var r = route.pair();
  Expr left = sum(i, exp(-x(t, i)) * 2.0);
  Expr right = combine(route, t, route.gate(r) * max(x(route.token(r), i), Expr(0.0)));
  Expr whole = softmax(i, left + right) / 4.0;

  Identity id;
  CHECK(id.mutate(whole).same_as(whole));
  CHECK(id.mutate(right).same_as(right));

  // A change rebuilds the path to the root and shares everything else.
  TwoToThree m;
  Expr changed = m.mutate(whole);
  CHECK_FALSE(changed.same_as(whole));
  CHECK(to_string(changed) ==
        "softmax(i, sum(i, exp(-x(t, i)) * 3) + combine(route, t, route_gate(r) * max(x(token(r), i), 0))) / 4");
  auto *div = changed.as<Binary>();
  REQUIRE(div != nullptr);
  CHECK(div->b.same_as(whole.as<Binary>()->b));
  auto *add = div->a.as<Softmax>()->body.as<Binary>();
  REQUIRE(add != nullptr);
  CHECK(add->b.same_as(right)); // the untouched combine is the same node
  CHECK_FALSE(add->a.same_as(left));
  CHECK(m.mutate(right).same_as(right));

  CountAccesses count;
  count.visit(whole);
  CHECK(count.n == 3);
}
