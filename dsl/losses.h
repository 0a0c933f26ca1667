// Auxiliary losses of MoE training, as algebra: each is a 0-D Func (a scalar)
// built from the ordinary builders, so it prints, is checked, the reference
// evaluates it and grad() differentiates it. Make a loss an extra output of
// the layer's Pipeline and differentiate all outputs at once:
//
//     Func lb = load_balancing_loss(route, probs, e, {"lb_loss", 0.01});
//     Func z = z_loss(logits, e, {"z_loss", 0.001});
//     Pipeline train({y, lb, z});
//     Gradients g = grad(train, {y, lb, z}); // seeds d_y, d_lb_loss, d_z_loss
//
// Means over the tokens divide by extent(T), the token count bound when the
// layer runs. The per-token and per-expert parts are Funcs of their own
// ("<name>_<what>"), so a compiled backend can run them in parallel and only
// the final reduction to a scalar is serial.
#pragma once

#include <string>

#include "dsl/ir.h"

namespace moeforge {

struct AuxLossOptions {
  // The loss Func's name; its helper Funcs are named "<name>_<what>". Empty:
  // "lb_loss" or "z_loss".
  std::string name;
  // The loss is multiplied by it (Switch Transformer: 0.01; ST-MoE's z-loss:
  // 0.001), so a seed of 1 gives the weighted loss's gradient.
  double coefficient = 1.0;
};

// Switch Transformer's load-balancing loss over route's E experts:
//
//     L = coefficient * E * sum over e of f(e) * P(e)
//     f(e) = (pairs routed to e) / (T * k)   -- "<name>_fraction"
//     P(e) = mean over tokens t of probs(t, e) -- "<name>_mean_prob"
//
// f is a constant of the derivative (top-k selection is), so the gradient
// reaches the router through P only. probs is a defined Func over the
// route's (token, expert) Dims in either order, usually the probabilities
// the route selected on; expert is its expert index. L is 1 for a uniform
// router with uniform routing and grows as both concentrate on few experts.
Func load_balancing_loss(const Route &route, const Func &probs, const Var &expert, const AuxLossOptions &options = {});

// ST-MoE's router z-loss: the mean over tokens of the squared log-sum-exp of
// the router logits along expert,
//
//     lse(t) = log(sum over e of exp(logits(t, e)))   -- "<name>_lse"
//     L = coefficient * (sum over t of lse(t)^2) / T
//
// which keeps logits small. logits is a defined Func of two indices, one of
// them expert. The log-sum-exp is written without a max shift (the algebra
// has no max-reduction), so it overflows float32 for logits near 88, far
// above a trained router's.
Func z_loss(const Func &logits, const Var &expert, const AuxLossOptions &options = {});

} // namespace moeforge
