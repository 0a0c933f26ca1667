// An MoE layer whose router adds a per-expert bias to its logits, so tests and
// benchmarks can force routing shapes through the same algebra: an empty
// expert, every token on one expert, or skew (a ramp over the experts).
#pragma once

#include <cmath>
#include <string>

#include "dsl/ops.h"
#include "examples/examples.h"

namespace moeforge {

// Per-expert router bias: none, every token's first choice is expert 0, expert
// E-1 never chosen, or a ramp that makes later experts busier (skew).
enum class Bias { none, all_to_first, last_empty, ramp };

// A GeLU or SwiGLU MoE whose logits are x * wr + bias(e).
inline Example biased_moe(const ExampleShape &s, bool swiglu, Bias bias, bool renormalize = false) {
  Dim T = Dim::dynamic("T"), D("D", s.d), F("F", s.f), E("E", s.experts);
  Var t("t", T), e("e", E), i("i", D), j("j", F);
  Input x("x", {T, D}), b("bias", {E}, DType::f32);
  Param wr("wr", {D, E}), w1("w1", {E, D, F}), w3("w3", {E, D, F}), w2("w2", {E, F, D});
  Func logits("logits", DType::f32), probs("probs", DType::f32);
  logits(t, e) = sum(i, x(t, i) * wr(i, e)) + b(e); // the bias runs in the GEMM's epilogue
  probs(t, e) = softmax(e, logits(t, e));
  TopKOptions opts;
  opts.renormalize = renormalize;
  Route route = top_k(probs, e, static_cast<int>(s.topk), opts);
  Var r = route.pair();
  Func h("h"), o("o"), y("y");
  Expr up = sum(i, x(route.token(r), i) * w1(route.expert(r), i, j));
  if (swiglu)
    h(r, j) = silu(up) * sum(i, x(route.token(r), i) * w3(route.expert(r), i, j));
  else
    h(r, j) = gelu(up);
  o(r, i) = sum(j, h(r, j) * w2(route.expert(r), j, i));
  y(t, i) = combine(route, t, route.gate(r) * o(r, i));
  double sd = 1.0 / std::sqrt(double(s.d));
  Example ex{swiglu ? "biased_swiglu" : "biased_gelu",
             "test MoE with a router bias",
             Pipeline({y}),
             "y",
             route.name(),
             {{"x", 1.0}, {"wr", sd}, {"w1", sd}, {"w3", sd}, {"w2", 1.0 / std::sqrt(double(s.f))}}};
  return ex;
}

// The router bias(e) that forces `bias` over `experts` experts.
inline HostTensor router_bias(Bias bias, int64_t experts, double ramp = 1.5) {
  HostTensor b({experts});
  for (int64_t e = 0; e < experts; ++e) {
    double v = 0;
    switch (bias) {
    case Bias::none:
      break;
    case Bias::all_to_first:
      v = e == 0 ? 30.0 : 0.0;
      break;
    case Bias::last_empty:
      v = e == experts - 1 ? -30.0 : 0.0;
      break;
    case Bias::ramp:
      v = ramp * double(e) / double(experts);
      break;
    }
    b.data[e] = v;
  }
  return b;
}

// Inputs for biased_moe: random weights, and the bias that forces `bias`.
inline TensorMap biased_inputs(const Example &ex, const ExampleShape &s, Bias bias, uint64_t seed, double ramp = 1.5) {
  TensorMap in = ex.random_inputs(s, seed);
  in.at("bias") = router_bias(bias, s.experts, ramp);
  return in;
}

} // namespace moeforge
