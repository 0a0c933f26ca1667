// RMSNorm, the usual prologue of a transformer block, written with sqrt and
// rsqrt: y(t, i) = x(t, i) * rsqrt(mean_i x(t, i)^2 + eps) * g(i), and the
// rows' L2 norms sqrt(sum_i x(t, i)^2) beside it. The backends' tests run it
// against the reference, forward and gradients.
#pragma once

#include "dsl/ops.h"
#include "examples/examples.h"

namespace moeforge {

inline Example rmsnorm_layer(const ExampleShape &s) {
  Dim T = Dim::dynamic("T"), D("D", s.d);
  Var t("t", T), i("i", D);
  Input x("x", {T, D}, DType::f32);
  Param g("g", {D}, DType::f32);
  Func scale("scale", DType::f32);
  scale(t) = rsqrt(sum(i, x(t, i) * x(t, i)) * (1.0 / double(s.d)) + 1e-6);
  Func norm("norm", DType::f32);
  norm(t) = sqrt(sum(i, x(t, i) * x(t, i)));
  Func y("y", DType::f32);
  y(t, i) = x(t, i) * scale(t) * g(i) + norm(t) * 1e-3;
  return Example{
      "rmsnorm", "RMSNorm with the rows' L2 norms: sqrt and rsqrt", Pipeline({y}), "y", "", {{"x", 1.0}, {"g", 1.0}}};
}

} // namespace moeforge
