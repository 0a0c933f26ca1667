#include "dsl/ops.h"

#include <cmath>

#include "dsl/error.h"

namespace moeforge {

Expr operator+(const Expr &a, const Expr &b) { return Binary::make(BinaryOp::add, a, b); }
Expr operator-(const Expr &a, const Expr &b) { return Binary::make(BinaryOp::sub, a, b); }
Expr operator*(const Expr &a, const Expr &b) { return Binary::make(BinaryOp::mul, a, b); }
Expr operator/(const Expr &a, const Expr &b) { return Binary::make(BinaryOp::div, a, b); }
Expr operator-(const Expr &a) { return Unary::make(UnaryOp::neg, a); }
Expr max(const Expr &a, const Expr &b) { return Binary::make(BinaryOp::max, a, b); }

Expr exp(const Expr &a) { return Unary::make(UnaryOp::exp, a); }
Expr log(const Expr &a) { return Unary::make(UnaryOp::log, a); }
Expr tanh(const Expr &a) { return Unary::make(UnaryOp::tanh, a); }
Expr sigmoid(const Expr &a) { return Unary::make(UnaryOp::sigmoid, a); }
Expr relu(const Expr &a) { return Unary::make(UnaryOp::relu, a); }
Expr gelu(const Expr &a) { return Unary::make(UnaryOp::gelu, a); }
Expr silu(const Expr &a) { return Unary::make(UnaryOp::silu, a); }
Expr sqrt(const Expr &a) { return Unary::make(UnaryOp::sqrt, a); }
Expr rsqrt(const Expr &a) { return Unary::make(UnaryOp::rsqrt, a); }

Expr step(const Expr &a) { return Unary::make(UnaryOp::step, a); }
Expr index_eq(const Index &a, const Index &b) { return IndexEq::make(a, b); }

Expr extent(const Dim &d) { return Extent::make(d); }

Expr sum(const Var &var, const Expr &body) { return Sum::make(var, body); }
Expr softmax(const Var &var, const Expr &body) { return Softmax::make(var, body); }

namespace {

// top_k's route; expert choice's when capacity_factor > 0 (RoutingNode).
Route make_route(const Func &probs, const Var &expert, int k, const TopKOptions &options, double capacity_factor) {
  user_check(probs.node() != nullptr) << "top_k: the probabilities Func is empty";
  user_check(probs.is_defined()) << "top_k: '" << probs.name()
                                 << "' is not defined yet: define the router probabilities first";
  const auto &args = probs.args();
  user_check(args.size() == 2) << "top_k: '" << probs.name() << "' has " << args.size()
                               << " indices; router probabilities must be a Func of (token, expert)";
  int ei = args[0].same_as(expert) ? 0 : (args[1].same_as(expert) ? 1 : -1);
  user_check(ei >= 0) << "top_k: '" << expert.name() << "' is not an index of '" << probs.name() << "("
                      << args[0].name() << ", " << args[1].name() << ")': pass the expert index";
  const Var &token = args[1 - ei];
  int64_t E = expert.dim().extent();
  user_check(!expert.dim().is_dynamic())
      << "top_k: the expert Dim '" << expert.dim().name() << "' must have a static extent"
      << "; to let each expert pick its top tokens instead, write expert_choice(probs, expert, capacity_factor)";
  user_check(k >= 1 && k <= E) << "top_k: k = " << k << " but '" << probs.name() << "' has " << E << " experts along '"
                               << expert.name() << "': choose 1 <= k <= " << E;
  user_check(!options.name.empty()) << "top_k: the route needs a name";
  user_check(options.groups >= 1 && E % options.groups == 0)
      << "top_k: groups = " << options.groups << " must divide the " << E << " experts along '" << expert.name()
      << "' into equal groups";
  user_check(options.groups == 1 || (options.top_groups >= 1 && options.top_groups <= options.groups))
      << "top_k: top_groups = " << options.top_groups << " of " << options.groups
      << " groups: choose 1 <= top_groups <= groups";
  user_check(options.groups == 1 || k <= options.top_groups * (E / options.groups))
      << "top_k: k = " << k << " but the " << options.top_groups << " best groups of " << E / options.groups
      << " experts hold only " << options.top_groups * (E / options.groups) << ": raise top_groups or lower k";

  auto node = std::make_shared<RoutingNode>();
  node->name = options.name;
  node->probs = probs.node();
  node->token_var = token;
  node->expert_var = expert;
  node->k = k;
  node->groups = options.groups;
  node->top_groups = options.groups == 1 ? 1 : options.top_groups;
  node->capacity_factor = capacity_factor;
  node->pairs = Dim::scaled(options.name + ".pairs", token.dim(), k);
  node->pair = Var("r", node->pairs);
  RoutingPtr route = node;

  // The gates are algebra over probs, so gradients reach the router through
  // them; the selection (which experts) is a constant.
  const Var &r = node->pair;
  Index tok(route, RouteField::token, r), exp_(route, RouteField::expert, r);
  // probs may be p(t, e) or p(e, t): index it in its own argument order.
  Expr chosen = ei == 1 ? probs({tok, exp_}) : probs({exp_, tok});
  Func gate(options.name + "_gate", probs.dtype());
  if (options.renormalize) {
    Func total(options.name + "_gate_sum", DType::f32);
    total(token) = RouteSum::make(route, RouteField::token, token, chosen);
    gate(r) = chosen / total({tok});
  } else {
    gate(r) = chosen;
  }
  return Route(route, gate);
}

} // namespace

Route top_k(const Func &probs, const Var &expert, int k, const TopKOptions &options) {
  return make_route(probs, expert, k, options, 0.0);
}

Route expert_choice(const Func &probs, const Var &expert, double capacity_factor, const std::string &name) {
  user_check(std::isfinite(capacity_factor) && capacity_factor > 0)
      << "expert_choice: capacity_factor = " << capacity_factor
      << " must be positive (the mean number of experts per token; 1 or 2 are usual)";
  user_check(probs.node() != nullptr && probs.is_defined())
      << "expert_choice: the scores Func is empty or not defined yet: define the router scores first";
  user_check(!expert.dim().is_dynamic()) << "expert_choice: the expert Dim '" << expert.dim().name()
                                         << "' must have a static extent";
  TopKOptions options;
  options.name = name;
  // Every token offers every expert; the capacity then keeps each expert's
  // best tokens (dsl/capacity.h). The gates are the unnormalised scores.
  return make_route(probs, expert, static_cast<int>(expert.dim().extent()), options, capacity_factor);
}

Expr combine(const Route &route, const Var &token, const Expr &body) {
  return RouteSum::make(route.node(), RouteField::token, token, body);
}

Expr expert_sum(const Route &route, const Var &expert, const Expr &body) {
  return RouteSum::make(route.node(), RouteField::expert, expert, body);
}

} // namespace moeforge
