// Building expressions: arithmetic, element-wise functions, contractions,
// softmax and routing. Everything here only builds IR; nothing is evaluated.
#pragma once

#include <string>

#include "dsl/ir.h"

namespace moeforge {

Expr operator+(const Expr &a, const Expr &b);
Expr operator-(const Expr &a, const Expr &b);
Expr operator*(const Expr &a, const Expr &b);
Expr operator/(const Expr &a, const Expr &b);
Expr operator-(const Expr &a);
Expr max(const Expr &a, const Expr &b);

Expr exp(const Expr &a);
Expr log(const Expr &a);
Expr tanh(const Expr &a);
Expr sigmoid(const Expr &a);
Expr relu(const Expr &a);
// GeLU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
Expr gelu(const Expr &a);
// SiLU (swish): x * sigmoid(x).
Expr silu(const Expr &a);
// The square root and its reciprocal 1 / sqrt(x) (RMSNorm's scale), for x > 0.
Expr sqrt(const Expr &a);
Expr rsqrt(const Expr &a);

// step(x) = x > 0 ? 1 : 0 (relu's derivative).
Expr step(const Expr &a);
// [a == b]: 1 where the two indices agree, else 0 (e.g. expert(r) == e).
Expr index_eq(const Index &a, const Index &b);

// The extent of d as a value (a float): extent(T) is the token count, known
// only when the layer runs for a dynamic T; a mean over the tokens is
// sum(t, ...) / extent(T). Its derivative is 0.
Expr extent(const Dim &d);

// sum over var: a contraction when body is a product using var on both sides.
Expr sum(const Var &var, const Expr &body);
// softmax of body along var (var stays an index of the result).
Expr softmax(const Var &var, const Expr &body);

struct TopKOptions {
  // Divide each gate by the sum of its token's k probabilities (Mixtral).
  bool renormalize = false;
  // Names the route, its pair Dim/Var ("<name>.pairs", "r") and gate Func.
  std::string name = "route";
  // Group-limited selection (DeepSeek-V3): the experts in `groups` equal
  // contiguous groups, each scored by the sum of its two largest probs; only
  // the experts of the `top_groups` best groups are candidates
  // (dsl/top_k_select.h). 1: every expert is a candidate.
  int groups = 1;
  int top_groups = 1;
};

// Selects, for every token t, the k experts with the largest probs(t, e). probs
// must be a defined Func of two indices, one of them `expert`.
Route top_k(const Func &probs, const Var &expert, int k, const TopKOptions &options = {});

// Expert choice routing (Zhou et al. 2022): each expert takes the C tokens of
// largest probs(t, e), C = min(T, ceil(capacity_factor * T / E)), so a
// token may get any number of experts, none included. The route's pairs are
// every (token, expert), r = t * E + slot (slot order as top_k's), of which
// each expert keeps C (dsl/capacity.h); the others add nothing to any sum
// over the pairs. gate(r) = probs(token(r), expert(r)).
Route expert_choice(const Func &probs, const Var &expert, double capacity_factor, const std::string &name = "route");

// The gated combine's shape: for each token t, the sum of body over the pairs r
// of route with token(r) = t. body uses route.pair(); t is a Var over the
// route's token Dim and must not appear in body (write route.token(r)).
Expr combine(const Route &route, const Var &token, const Expr &body);

// For each expert e, the sum of body over the pairs r with expert(r) = e (the
// per-expert reductions of the weight gradients).
Expr expert_sum(const Route &route, const Var &expert, const Expr &body);

} // namespace moeforge
