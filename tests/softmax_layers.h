// Layers that are one softmax over an input, for the CUDA backend's warp-per-row
// softmax: a static row that fits a lane's registers (72 columns: the last
// 32-column slice partial), a static row that does not (520), a dynamic row
// (along the tokens, so rows are strided), and rows indexed by two other
// variables. Shared by the compile-only and the GPU tests.
#pragma once

#include <string>
#include <vector>

#include "dsl/ops.h"
#include "examples/examples.h"

namespace moeforge::testing {

inline Example softmax_layer(const std::string &what, const Pipeline &p) {
  return Example{"softmax_" + what, "a softmax over an input (" + what + ")", p, "p", "", {{"a", 4.0}}};
}

// what: "short" (72 static columns), "long" (520), "tokens" (along the
// dynamic T) or "3d" (p(t, g, c), softmax over c, rows over t and g).
inline Example softmax_rows(const std::string &what) {
  Dim T = Dim::dynamic("T"), G("G", 3), C("C", what == "long" ? 520 : 72);
  Var t("t", T), g("g", G), c("c", C);
  Func p("p", DType::f32);
  if (what == "3d") {
    Input a("a", {T, G, C}, DType::f32);
    p(t, g, c) = softmax(c, a(t, g, c));
  } else {
    Input a("a", {T, C}, DType::f32);
    p(t, c) = what == "tokens" ? softmax(t, a(t, c)) : softmax(c, a(t, c));
  }
  return softmax_layer(what, Pipeline({p}));
}

inline std::vector<std::string> softmax_row_kinds() { return {"short", "long", "tokens", "3d"}; }

} // namespace moeforge::testing
