#include "examples/examples.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>

#include "dsl/error.h"
#include "dsl/ops.h"

namespace moeforge {

namespace {

// The kernels and the routing index rows, pairs and experts with 32-bit
// integers, and every tensor's element count must fit 64-bit arithmetic
// (in bytes): beyond these a shape would wrap, not fail.
constexpr int64_t kMaxExtent = (int64_t(1) << 31) - 1;

// A size as the caller spelled it: "--tokens" / "--tokens 5", or "tokens" /
// "tokens=5".
struct Spelled {
  ShapeSpelling spelling;
  std::string name(const char *size) const {
    return spelling == ShapeSpelling::cli_flags ? "--" + std::string(size) : size;
  }
  std::string value(const char *size, int64_t v) const {
    return name(size) + (spelling == ShapeSpelling::cli_flags ? " " : "=") + std::to_string(v);
  }
};

int64_t checked_product(const std::string &name, const Spelled &sp,
                        const std::vector<std::pair<const char *, int64_t>> &factors) {
  int64_t p = 8; // bytes per element at most (the reference's doubles)
  std::string what;
  for (const auto &[size, v] : factors) {
    what += (what.empty() ? "" : " x ") + sp.value(size, v);
    user_check(!__builtin_mul_overflow(p, v, &p))
        << name << ": a tensor of " << what << " elements is too large to address (its size in bytes overflows "
        << "64 bits): lower those sizes";
  }
  return p;
}

void check_shape(const std::string &name, const ExampleShape &s, bool routed, const Spelled &sp) {
  user_check(s.tokens >= 1) << name << ": " << sp.name("tokens") << " must be at least 1 (got " << s.tokens << ")";
  user_check(s.d >= 1) << name << ": " << sp.name("d") << " must be at least 1 (got " << s.d << ")";
  user_check(s.f >= 1) << name << ": " << sp.name("f") << " must be at least 1 (got " << s.f << ")";
  for (const auto &[size, v] : {std::pair{"tokens", s.tokens}, {"d", s.d}, {"f", s.f}})
    user_check(v <= kMaxExtent) << name << ": " << sp.value(size, v) << " is beyond " << kMaxExtent
                                << ", the largest extent the kernels index with 32-bit integers";
  checked_product(name, sp, {{"tokens", s.tokens}, {"d", s.d}});
  checked_product(name, sp, {{"tokens", s.tokens}, {"f", s.f}});
  checked_product(name, sp, {{"d", s.d}, {"f", s.f}});
  if (!routed)
    return;
  user_check(s.experts >= 1) << name << ": " << sp.name("experts") << " must be at least 1 (got " << s.experts << ")";
  user_check(s.experts <= kMaxExtent) << name << ": " << sp.value("experts", s.experts) << " is beyond " << kMaxExtent;
  user_check(s.topk >= 1 && s.topk <= s.experts)
      << name << ": " << sp.value("topk", s.topk) << " with " << s.experts << " experts: choose 1 <= topk <= experts";
  user_check(s.tokens <= kMaxExtent / s.topk)
      << name << ": " << sp.value("tokens", s.tokens) << " x " << sp.value("topk", s.topk) << " pairs is beyond "
      << kMaxExtent << ", the most pairs the routing numbers with 32-bit integers: lower " << sp.name("tokens")
      << " or " << sp.name("topk");
  checked_product(name, sp, {{"experts", s.experts}, {"d", s.d}, {"f", s.f}});
  checked_product(name, sp, {{"tokens", s.tokens}, {"topk", s.topk}, {"f", s.f}});
  checked_product(name, sp, {{"tokens", s.tokens}, {"experts", s.experts}});
}

// The router shared by the MoE examples: logits = x Wr, softmax over experts.
struct Router {
  Func probs{"probs"};
  Route route;
};

// probs(t, e) = softmax over e of x Wr.
Func router_probs(const Input &x, const Param &wr, const Var &t, const Var &e, const Var &i) {
  Func logits("logits", DType::f32);
  logits(t, e) = sum(i, x(t, i) * wr(i, e));
  Func probs("probs", DType::f32);
  probs(t, e) = softmax(e, logits(t, e));
  return probs;
}

Router make_router(const Input &x, const Param &wr, const Var &t, const Var &e, const Var &i, int k, bool renorm) {
  Func probs = router_probs(x, wr, t, e, i);
  TopKOptions opts;
  opts.renormalize = renorm;
  return Router{probs, top_k(probs, e, k, opts)};
}

// The GeLU-MLP MoE (gelu(x W1[e]) W2[e], gated combine) under the routing
// that route_of picks from the router's probabilities: top-k (moe_mlp) or
// expert choice (expert_choice_moe).
Example gelu_mlp_moe(const ExampleShape &s, const std::string &name, const std::string &description,
                     const std::function<Route(const Func &probs, const Var &e)> &route_of) {
  Dim T = Dim::dynamic("T"), D("D", s.d), F("F", s.f), E("E", s.experts);
  Var t("t", T), e("e", E), i("i", D), j("j", F);
  Input x("x", {T, D});
  Param wr("wr", {D, E}), w1("w1", {E, D, F}), w2("w2", {E, F, D});
  const Route route = route_of(router_probs(x, wr, t, e, i), e);
  Var r = route.pair();

  Func h("h");
  h(r, j) = gelu(sum(i, x(route.token(r), i) * w1(route.expert(r), i, j)));
  Func o("o");
  o(r, i) = sum(j, h(r, j) * w2(route.expert(r), j, i));
  Func y("y");
  y(t, i) = combine(route, t, route.gate(r) * o(r, i));
  return Example{name,
                 description,
                 Pipeline({y}),
                 "y",
                 route.name(),
                 {{"x", 1.0},
                  {"wr", 1.0 / std::sqrt(double(s.d))},
                  {"w1", 1.0 / std::sqrt(double(s.d))},
                  {"w2", 1.0 / std::sqrt(double(s.f))}}};
}

Example moe_mlp(const ExampleShape &s) {
  return gelu_mlp_moe(s, "moe_mlp", "GeLU-MLP MoE: softmax router, top-k, gelu(x W1[e]) W2[e], gated combine",
                      [&](const Func &probs, const Var &e) { return top_k(probs, e, static_cast<int>(s.topk)); });
}

// Per-expert biases on both expert GEMMs: their gradients are per-expert
// sums over the routed rows (expert_sum of one matrix), which autodiff
// derives and lowering runs as element-wise loops over each expert's rows.
Example expert_bias_moe(const ExampleShape &s) {
  Dim T = Dim::dynamic("T"), D("D", s.d), F("F", s.f), E("E", s.experts);
  Var t("t", T), e("e", E), i("i", D), j("j", F);
  Input x("x", {T, D});
  Param wr("wr", {D, E}), w1("w1", {E, D, F}), b1("b1", {E, F}), w2("w2", {E, F, D}), b2("b2", {E, D});
  Router router = make_router(x, wr, t, e, i, static_cast<int>(s.topk), false);
  const Route &route = router.route;
  Var r = route.pair();

  Func h("h");
  h(r, j) = gelu(sum(i, x(route.token(r), i) * w1(route.expert(r), i, j)) + b1(route.expert(r), j));
  Func o("o");
  o(r, i) = sum(j, h(r, j) * w2(route.expert(r), j, i)) + b2(route.expert(r), i);
  Func y("y");
  y(t, i) = combine(route, t, route.gate(r) * o(r, i));
  return Example{"expert_bias_moe",
                 "GeLU-MLP MoE with per-expert biases: gelu(x W1[e] + b1[e]) W2[e] + b2[e], gated combine",
                 Pipeline({y}),
                 "y",
                 route.name(),
                 {{"x", 1.0},
                  {"wr", 1.0 / std::sqrt(double(s.d))},
                  {"w1", 1.0 / std::sqrt(double(s.d))},
                  {"b1", 0.5},
                  {"w2", 1.0 / std::sqrt(double(s.f))},
                  {"b2", 0.5}}};
}

// The routed GLU experts: h(r) = act(x(token(r)) W1[e]) * (x(token(r)) W3[e]),
// o(r) = h(r) W2[e], e = expert(r); returns o. The gate and up projections
// share the gathered rows of x.
Func glu_experts(const Input &x, const Route &route, const Param &w1, const Param &w3, const Param &w2,
                 Expr (*act)(const Expr &), const Var &i, const Var &j) {
  Var r = route.pair();
  Func h("h");
  h(r, j) = act(sum(i, x(route.token(r), i) * w1(route.expert(r), i, j))) *
            sum(i, x(route.token(r), i) * w3(route.expert(r), i, j));
  Func o("o");
  o(r, i) = sum(j, h(r, j) * w2(route.expert(r), j, i));
  return o;
}

// A gated-linear-unit MoE: act(x W1[e]) * (x W3[e]) W2[e], renormalised
// top-k gates; act is silu (SwiGLU), gelu (GeGLU) or relu (ReGLU).
Example glu_moe(const ExampleShape &s, const std::string &name, const std::string &description,
                Expr (*act)(const Expr &)) {
  Dim T = Dim::dynamic("T"), D("D", s.d), F("F", s.f), E("E", s.experts);
  Var t("t", T), e("e", E), i("i", D), j("j", F);
  Input x("x", {T, D});
  Param wr("wr", {D, E}), w1("w1", {E, D, F}), w3("w3", {E, D, F}), w2("w2", {E, F, D});
  Router router = make_router(x, wr, t, e, i, static_cast<int>(s.topk), true);
  const Route &route = router.route;
  Var r = route.pair();

  Func o = glu_experts(x, route, w1, w3, w2, act, i, j);
  Func y("y");
  y(t, i) = combine(route, t, route.gate(r) * o(r, i));
  double sd = 1.0 / std::sqrt(double(s.d));
  return Example{name,          description,
                 Pipeline({y}), "y",
                 route.name(),  {{"x", 1.0}, {"wr", sd}, {"w1", sd}, {"w3", sd}, {"w2", 1.0 / std::sqrt(double(s.f))}}};
}

Example swiglu_moe(const ExampleShape &s) {
  return glu_moe(s, "swiglu_moe", "Mixtral-style SwiGLU MoE: renormalised top-k gates, silu(x W1[e]) * (x W3[e]) W2[e]",
                 silu);
}

// Routed SwiGLU experts beside an always-on shared SwiGLU expert that every
// token passes through, its output scaled by a per-token sigmoid gate
// (Qwen2-MoE): y = combine(gate(r) o(r)) + sigmoid(x . wsg) shared(x). The
// shared expert is dense algebra over the tokens; nothing marks it shared.
Example shared_expert_moe(const ExampleShape &s) {
  Dim T = Dim::dynamic("T"), D("D", s.d), F("F", s.f), E("E", s.experts);
  Var t("t", T), e("e", E), i("i", D), j("j", F);
  Input x("x", {T, D});
  Param wr("wr", {D, E}), w1("w1", {E, D, F}), w3("w3", {E, D, F}), w2("w2", {E, F, D});
  Param ws1("ws1", {D, F}), ws3("ws3", {D, F}), ws2("ws2", {F, D}), wsg("wsg", {D});
  Router router = make_router(x, wr, t, e, i, static_cast<int>(s.topk), false);
  const Route &route = router.route;
  Var r = route.pair();

  Func o = glu_experts(x, route, w1, w3, w2, silu, i, j);
  Func hs("hs");
  hs(t, j) = silu(sum(i, x(t, i) * ws1(i, j))) * sum(i, x(t, i) * ws3(i, j));
  Func os("os");
  os(t, i) = sum(j, hs(t, j) * ws2(j, i));
  Func shared_gate("shared_gate", DType::f32);
  shared_gate(t) = sigmoid(sum(i, x(t, i) * wsg(i)));
  Func y("y");
  y(t, i) = combine(route, t, route.gate(r) * o(r, i)) + shared_gate(t) * os(t, i);
  double sd = 1.0 / std::sqrt(double(s.d)), sf = 1.0 / std::sqrt(double(s.f));
  return Example{
      "shared_expert_moe",
      "routed SwiGLU experts plus an always-on shared SwiGLU expert scaled by sigmoid(x wsg) (Qwen2-MoE)",
      Pipeline({y}),
      "y",
      route.name(),
      {{"x", 1.0}, {"wr", sd}, {"w1", sd}, {"w3", sd}, {"w2", sf}, {"ws1", sd}, {"ws3", sd}, {"ws2", sf}, {"wsg", sd}}};
}

// A transformer block's MoE half as written: RMSNorm (with its learned scale
// g) as a prologue, then the router and the GeLU experts over the normalised
// rows. Nothing marks the prologue: it is a dense Func the gathers read.
Example rmsnorm_moe(const ExampleShape &s) {
  Dim T = Dim::dynamic("T"), D("D", s.d), F("F", s.f), E("E", s.experts);
  Var t("t", T), e("e", E), i("i", D), j("j", F);
  Input x("x", {T, D});
  Param g("g", {D}, DType::f32), wr("wr", {D, E}), w1("w1", {E, D, F}), w2("w2", {E, F, D});
  Func scale("scale", DType::f32), nx("nx");
  scale(t) = rsqrt(sum(i, x(t, i) * x(t, i)) * (1.0 / double(s.d)) + 1e-6);
  nx(t, i) = x(t, i) * scale(t) * g(i);
  Func logits("logits", DType::f32), probs("probs", DType::f32);
  logits(t, e) = sum(i, nx(t, i) * wr(i, e));
  probs(t, e) = softmax(e, logits(t, e));
  Route route = top_k(probs, e, static_cast<int>(s.topk));
  Var r = route.pair();
  Func h("h"), o("o"), y("y");
  h(r, j) = gelu(sum(i, nx(route.token(r), i) * w1(route.expert(r), i, j)));
  o(r, i) = sum(j, h(r, j) * w2(route.expert(r), j, i));
  y(t, i) = combine(route, t, route.gate(r) * o(r, i));
  double sd = 1.0 / std::sqrt(double(s.d));
  return Example{"rmsnorm_moe", "RMSNorm prologue, then the GeLU-MLP MoE over the normalised rows",
                 Pipeline({y}), "y",
                 route.name(),  {{"x", 1.0}, {"g", 1.0}, {"wr", sd}, {"w1", sd}, {"w2", 1.0 / std::sqrt(double(s.f))}}};
}

// DeepSeek-V3's router over SwiGLU experts: sigmoid scores s = sigmoid(x Wr);
// a per-expert bias b (an Input the training loop nudges toward balance,
// auxiliary-loss-free; selection is a constant for differentiation, so no
// gradient reaches it) that steers the selection only; group-limited top-k
// over s + b; gates from the unbiased scores, normalised over the token's k
// choices and scaled by 2.5 (DeepSeek-V3's routed_scaling_factor).
Example deepseek_moe(const ExampleShape &s) {
  // Groups of at least two experts: 8 where E allows (DeepSeek-V3: 256
  // experts in 8 groups), the best half of them kept.
  int groups = 1;
  for (int g : {8, 4, 2})
    if (s.experts % g == 0 && s.experts / g >= 2) {
      groups = g;
      break;
    }
  Dim T = Dim::dynamic("T"), D("D", s.d), F("F", s.f), E("E", s.experts);
  Var t("t", T), e("e", E), i("i", D), j("j", F);
  Input x("x", {T, D}), bias("bias", {E}, DType::f32);
  Param wr("wr", {D, E}), w1("w1", {E, D, F}), w3("w3", {E, D, F}), w2("w2", {E, F, D});
  Func logits("logits", DType::f32), scores("scores", DType::f32), choice("choice", DType::f32);
  logits(t, e) = sum(i, x(t, i) * wr(i, e));
  scores(t, e) = sigmoid(logits(t, e));
  choice(t, e) = scores(t, e) + bias(e);
  TopKOptions opts;
  opts.groups = groups;
  opts.top_groups = std::max(1, groups / 2);
  Route route = top_k(choice, e, static_cast<int>(s.topk), opts);
  Var r = route.pair();
  Func picked("picked", DType::f32), picked_sum("picked_sum", DType::f32), gate("gate", DType::f32);
  picked(r) = scores(route.token(r), route.expert(r));
  picked_sum(t) = combine(route, t, picked(r));
  gate(r) = 2.5 * picked(r) / picked_sum(route.token(r));

  Func o = glu_experts(x, route, w1, w3, w2, silu, i, j);
  Func y("y");
  y(t, i) = combine(route, t, gate(r) * o(r, i));
  double sd = 1.0 / std::sqrt(double(s.d));
  return Example{"deepseek_moe",
                 "DeepSeek-V3 routing: sigmoid scores, a selection-only expert bias, group-limited top-k, "
                 "normalised gates x 2.5, SwiGLU experts",
                 Pipeline({y}),
                 "y",
                 route.name(),
                 {{"x", 1.0}, {"bias", 0.1}, {"wr", sd}, {"w1", sd}, {"w3", sd}, {"w2", 1.0 / std::sqrt(double(s.f))}}};
}

Example dense_mlp(const ExampleShape &s) {
  Dim T = Dim::dynamic("T"), D("D", s.d), F("F", s.f);
  Var t("t", T), i("i", D), j("j", F);
  Input x("x", {T, D});
  Param w1("w1", {D, F}), w2("w2", {F, D});
  Func h("h");
  h(t, j) = gelu(sum(i, x(t, i) * w1(i, j)));
  Func y("y");
  y(t, i) = sum(j, h(t, j) * w2(j, i));
  return Example{"dense_mlp",
                 "a dense GeLU MLP (no routing): gelu(x W1) W2",
                 Pipeline({y}),
                 "y",
                 "",
                 {{"x", 1.0}, {"w1", 1.0 / std::sqrt(double(s.d))}, {"w2", 1.0 / std::sqrt(double(s.f))}}};
}

Example attention(const ExampleShape &s) {
  Dim T = Dim::dynamic("T"), D("D", s.d);
  Var t("t", T), u("u", T), i("i", D);
  Input q("q", {T, D}), k("k", {T, D}), v("v", {T, D});
  Func p("p", DType::f32);
  p(t, u) = softmax(u, sum(i, q(t, i) * k(u, i)) * (1.0 / std::sqrt(double(s.d))));
  Func out("out");
  out(t, i) = sum(u, p(t, u) * v(u, i));
  return Example{"attention",
                 "softmax attention over the tokens: softmax(q k^T / sqrt(d)) v",
                 Pipeline({out}),
                 "out",
                 "",
                 {{"q", 1.0}, {"k", 1.0}, {"v", 1.0}}};
}

// Mixture-of-Attention (ScatterMoE's MoA): attention heads as experts. Each
// token's k chosen heads project it to a query with the head's own W_q and
// take the head's output back to the model width with its own W_o; the keys
// and values are one shared projection of every token, and the attention
// between them (each routed query against every token) is the same for
// all heads. The gated combine sums a token's heads, as an MoE's experts.
// Not causal: every query sees every token.
Example moa(const ExampleShape &s) {
  Dim T = Dim::dynamic("T"), D("D", s.d), F("F", s.f), E("E", s.experts);
  Var t("t", T), u("u", T), e("e", E), i("i", D), c("c", F);
  Input x("x", {T, D});
  Param wr("wr", {D, E}), wq("wq", {E, D, F}), wk("wk", {D, F}), wv("wv", {D, F}), wo("wo", {E, F, D});
  Router router = make_router(x, wr, t, e, i, static_cast<int>(s.topk), false);
  const Route &route = router.route;
  Var r = route.pair();

  Func key("key"), value("value");
  key(u, c) = sum(i, x(u, i) * wk(i, c));
  value(u, c) = sum(i, x(u, i) * wv(i, c));
  Func q("q");
  q(r, c) = sum(i, x(route.token(r), i) * wq(route.expert(r), i, c));
  Func p("p", DType::f32);
  p(r, u) = softmax(u, sum(c, q(r, c) * key(u, c)) * (1.0 / std::sqrt(double(s.f))));
  Func z("z");
  z(r, c) = sum(u, p(r, u) * value(u, c));
  Func o("o");
  o(r, i) = sum(c, z(r, c) * wo(route.expert(r), c, i));
  Func y("y");
  y(t, i) = combine(route, t, route.gate(r) * o(r, i));
  const double sd = 1.0 / std::sqrt(double(s.d));
  return Example{"moa",
                 "Mixture-of-Attention: heads as experts, routed W_q[e] and W_o[e] around one shared softmax "
                 "attention (keys and values shared)",
                 Pipeline({y}),
                 "y",
                 route.name(),
                 {{"x", 1.0}, {"wr", sd}, {"wq", sd}, {"wk", sd}, {"wv", sd}, {"wo", 1.0 / std::sqrt(double(s.f))}}};
}

// Expert choice (Zhou et al. 2022): each expert takes the C tokens of
// largest router probability, C = ceil(cf * T / E) with the capacity factor
// cf = s.topk (the mean number of experts per token), so a token gets any
// number of experts, none included; GeLU experts, the probability as gate.
Example expert_choice_moe(const ExampleShape &s) {
  return gelu_mlp_moe(s, "expert_choice_moe",
                      "Expert-choice MoE: each expert takes its top C = ceil(cf T / E) tokens (cf = --topk), "
                      "gelu(x W1[e]) W2[e], gated combine",
                      [&](const Func &probs, const Var &e) { return expert_choice(probs, e, double(s.topk)); });
}

} // namespace

std::vector<std::string> example_names() {
  return {"moe_mlp",      "swiglu_moe",  "geglu_moe",         "reglu_moe", "expert_bias_moe", "shared_expert_moe",
          "deepseek_moe", "rmsnorm_moe", "expert_choice_moe", "dense_mlp", "attention",       "moa"};
}

Example make_example(const std::string &name, const ExampleShape &shape, ShapeSpelling spelling) {
  const Spelled sp{spelling};
  bool routed = name == "moe_mlp" || name == "swiglu_moe" || name == "geglu_moe" || name == "reglu_moe" ||
                name == "expert_bias_moe" || name == "shared_expert_moe" || name == "deepseek_moe" ||
                name == "rmsnorm_moe" || name == "moa" || name == "expert_choice_moe";
  if (routed || name == "dense_mlp" || name == "attention")
    check_shape(name, shape, routed, sp);
  if (name == "expert_choice_moe") {
    // Every token offers every expert: T * E pairs.
    user_check(shape.tokens <= kMaxExtent / shape.experts)
        << name << ": " << sp.value("tokens", shape.tokens) << " x " << sp.value("experts", shape.experts)
        << " pairs is beyond " << kMaxExtent << ", the most pairs the routing numbers with 32-bit integers: lower "
        << sp.name("tokens") << " or " << sp.name("experts");
    return expert_choice_moe(shape);
  }
  if (name == "moe_mlp")
    return moe_mlp(shape);
  if (name == "swiglu_moe")
    return swiglu_moe(shape);
  if (name == "geglu_moe")
    return glu_moe(shape, name, "GeGLU MoE: renormalised top-k gates, gelu(x W1[e]) * (x W3[e]) W2[e]", gelu);
  if (name == "reglu_moe")
    return glu_moe(shape, name, "ReGLU MoE: renormalised top-k gates, relu(x W1[e]) * (x W3[e]) W2[e]", relu);
  if (name == "expert_bias_moe")
    return expert_bias_moe(shape);
  if (name == "shared_expert_moe")
    return shared_expert_moe(shape);
  if (name == "deepseek_moe")
    return deepseek_moe(shape);
  if (name == "rmsnorm_moe")
    return rmsnorm_moe(shape);
  if (name == "dense_mlp")
    return dense_mlp(shape);
  if (name == "attention")
    return attention(shape);
  if (name == "moa")
    return moa(shape);
  std::string known;
  for (const std::string &n : example_names())
    known += (known.empty() ? "" : ", ") + n;
  user_error << "unknown example '" << name << "': choose one of " << known;
}

std::vector<int64_t> Example::input_shape(const BufferNode &b, const ExampleShape &shape) const {
  std::vector<int64_t> dims;
  for (const Dim &d : b.dims)
    dims.push_back(d.is_dynamic() ? shape.tokens : d.extent());
  return dims;
}

double Example::init_range(const std::string &name) const {
  auto it = init_scale.find(name);
  return it == init_scale.end() ? 1.0 : it->second;
}

TensorMap Example::random_inputs(const ExampleShape &shape, uint64_t seed) const {
  TensorMap out;
  for (const BufferPtr &b : pipeline.buffers()) {
    const double a = init_range(b->name);
    out[b->name] = hashed_random_tensor(input_shape(*b, shape), seed, random_stream(b->name), -a, a,
                                        /*bf16=*/b->dtype == DType::bf16);
  }
  return out;
}

} // namespace moeforge
