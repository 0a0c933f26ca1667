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
#include <vector>

#include "dsl/pipeline.h"

namespace moeforge {

struct Gradients {
  std::string seed;               // the (first) output's seed Input ("d_<output>")
  std::vector<std::string> seeds; // every output's seed Input, in the order of the outputs
  // forward name (Func, Input or Param) -> its gradient Func. An output's own
  // gradient is its seed Input, so the output is absent, unless another output
  // reads it: then it is a Func "<seed>_total" (the seed plus the other
  // outputs' terms). Forward values the
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

// Differentiates several outputs at once: the total gradient of the sum over
// k of <seed_k, outputs[k]>, each output seeded by its own Input (named
// seed_names[k], or "d_<output>" when seed_names is empty or the name is "")
// shaped like it; a 0-D output (a loss) gets a 0-D seed, a scalar. The
// gradients of a tensor reached from several outputs add up. With auxiliary
// losses as extra outputs (dsl/losses.h), grad(p, {y, lb_loss, z_loss}) with
// the losses' seeds set to 1 gives a training step's gradients.
Gradients grad(const Pipeline &p, const std::vector<Func> &outputs, const std::vector<std::string> &seed_names = {});

} // namespace moeforge
