// Reverse-mode differentiation of the algebra: the backward pass of a layer is
// more algebra. grad() walks a Pipeline's definitions in reverse dependency
// order and builds, for every Func, Input and Param the output depends on, a
// Func "d_<name>" over the same dimensions, defined with the ordinary builders
// (so it prints, is checked, and the reference evaluates it):
//
//     d_h(r, j) = sum(i, d_o(r, i) * w2(expert(r), j, i))
//     d_w2(e, f, d) = expert_sum(route, e, h(r, f) * d_o(r, d))
//     d_x(t, d) = combine(route, t, sum(j, ...)) + sum(e, d_logits(t, e) * wr(d, e))
//
// The upstream gradient enters as a seed Input "d_<output>" shaped like the
// output. Top-k selection is a constant: gradients reach the router through
// the gate reads probs(token(r), expert(r)), which scatter back with
// combine(route, t, g(r) * [expert(r) == e]).
#pragma once

#include <map>
#include <string>

#include "dsl/pipeline.h"

namespace moeforge {

struct Gradients {
  std::string seed; // the seed Input's name ("d_<output>")
  // forward name (Func, Input or Param) -> its gradient Func. The output's own
  // gradient is the seed Input, so the output is absent. Forward values the
  // derivatives need (gelu's argument, say) become Funcs "<func>_<what>" over
  // their free indices, read by the gradients rather than recomputed.
  std::map<std::string, Func> of;
  Pipeline pipeline; // outputs: every gradient Func (the forward is recomputed in it)

  // The gradient of a Func, Input or Param by its forward name; a UserError
  // names the candidates when the output does not depend on it.
  const Func &operator[](const std::string &name) const;
};

// Differentiates `output` (a Func of p) with respect to everything it reads.
// seed_name defaults to "d_<output>". Constructs without a derivative rule
// (a read with a repeated index, a routed read mixing routes) are UserErrors
// that name the construct.
Gradients grad(const Pipeline &p, const Func &output, const std::string &seed_name = "");

} // namespace moeforge
