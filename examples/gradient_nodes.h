// A small layer built from the two node kinds the gradients introduce:
// step(x) (the derivative of relu and max) and [a == b] (an index indicator;
// through a route it scatters per-pair values back to (token, expert), as
// d_probs does). The compiled backends' tests run it against the reference.
#pragma once

#include "dsl/ops.h"
#include "examples/examples.h"

namespace moeforge {

inline Example gradient_nodes_layer(const ExampleShape &s) {
  Dim T = Dim::dynamic("T"), E("E", s.experts);
  Var t("t", T), e("e", E);
  Input lg("lg", {T, E}, DType::f32);
  Func probs("probs", DType::f32);
  probs(t, e) = softmax(e, lg(t, e));
  Route route = top_k(probs, e, static_cast<int>(s.topk));
  Var r = route.pair();
  Func relu_grad("relu_grad", DType::f32);
  relu_grad(t, e) = step(lg(t, e)) * lg(t, e);
  // The chosen experts' gates scattered back to (token, expert).
  Func chosen("chosen", DType::f32);
  chosen(t, e) = combine(route, t, route.gate(r) * index_eq(route.expert(r), e));
  Func out("out", DType::f32);
  out(t, e) = chosen(t, e) + relu_grad(t, e) * probs(t, e);
  return Example{"gradient_nodes", "step and [a == b], as gradients use them", Pipeline({out}), "out", route.name(),
                 {{"lg", 2.0}}};
}

} // namespace moeforge
