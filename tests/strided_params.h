// A SwiGLU MoE layer in transformers' weight layouts, its gate and up
// projections read where transformers keeps them: w1 and w3 [E, F, D] are the
// two halves of one gate_up_proj [E, 2F, D], Params whose experts lie 2 F D
// elements apart (Param outer_stride), and down_proj w2 [E, D, F]. Shared by
// the tests of every backend (test_outer_stride.cpp, test_cpu_outer_stride.cpp,
// test_cuda_outer_stride.cpp).
#pragma once

#include <cmath>

#include "dsl/ops.h"
#include "examples/examples.h"

namespace moeforge::testing {

inline Example gate_up_swiglu(const ExampleShape &s) {
  Dim T = Dim::dynamic("T"), D("D", s.d), F("F", s.f), E("E", s.experts);
  Var t("t", T), e("e", E), i("i", D), j("j", F);
  Input x("x", {T, D});
  Param wr("wr", {D, E}), w2("w2", {E, D, F});
  Param w1("w1", {E, F, D}, DType::bf16, 2 * s.f * s.d), w3("w3", {E, F, D}, DType::bf16, 2 * s.f * s.d);
  Func logits("logits", DType::f32), probs("probs", DType::f32);
  logits(t, e) = sum(i, x(t, i) * wr(i, e));
  probs(t, e) = softmax(e, logits(t, e));
  TopKOptions renormalized;
  renormalized.renormalize = true;
  const Route route = top_k(probs, e, static_cast<int>(s.topk), renormalized);
  Var r = route.pair();
  Func h("h");
  h(r, j) = silu(sum(i, x(route.token(r), i) * w1(route.expert(r), j, i))) *
            sum(i, x(route.token(r), i) * w3(route.expert(r), j, i));
  Func o("o");
  o(r, i) = sum(j, h(r, j) * w2(route.expert(r), i, j));
  Func y("y");
  y(t, i) = combine(route, t, route.gate(r) * o(r, i));
  const double sd = 1.0 / std::sqrt(double(s.d)), sf = 1.0 / std::sqrt(double(s.f));
  return Example{"gate_up_swiglu", "SwiGLU MoE in transformers' layouts, w1 and w3 the halves of one gate_up_proj",
                 Pipeline({y}),    "y",
                 route.name(),     {{"x", 1.0}, {"wr", sd}, {"w1", sd}, {"w3", sd}, {"w2", sf}}};
}

} // namespace moeforge::testing
