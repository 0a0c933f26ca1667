#include "dsl/losses.h"

#include <cmath>
#include <vector>

#include "dsl/error.h"
#include "dsl/ops.h"

namespace moeforge {

namespace {

// The token index of a router Func f(token, expert) (in either order), after
// checking that f is one.
Var token_index(const char *loss, const char *role, const Func &f, const Var &expert) {
  user_check(f.node() != nullptr) << loss << ": the " << role << " Func is empty: pass the router's " << role;
  user_check(f.is_defined()) << loss << ": '" << f.name() << "' is not defined yet: define the router's " << role
                             << " before the loss";
  const std::vector<Var> &args = f.args();
  user_check(args.size() == 2) << loss << ": '" << f.name() << "' has " << args.size() << " ind"
                               << (args.size() == 1 ? "ex" : "ices") << "; the router's " << role
                               << " must be a Func of (token, expert)";
  user_check(expert.defined()) << loss << ": the expert index is an empty Var: pass the expert index of '" << f.name()
                               << "'";
  int at = args[0].same_as(expert) ? 0 : (args[1].same_as(expert) ? 1 : -1);
  user_check(at >= 0) << loss << ": '" << expert.name() << "' is not an index of '" << f.name() << "(" << args[0].name()
                      << ", " << args[1].name() << ")': pass its expert index";
  return args[1 - at];
}

std::string checked_name(const char *loss, const AuxLossOptions &o, const char *fallback) {
  user_check(std::isfinite(o.coefficient))
      << loss << ": the coefficient is " << o.coefficient << ": give a finite weight (e.g. 0.01)";
  return o.name.empty() ? fallback : o.name;
}

} // namespace

Func load_balancing_loss(const Route &route, const Func &probs, const Var &expert, const AuxLossOptions &options) {
  const char *what = "load_balancing_loss";
  std::string name = checked_name(what, options, "lb_loss");
  Var t = token_index(what, "probabilities", probs, expert);
  const RoutingNode &rn = *route.node();
  user_check(expert.dim().same_as(rn.expert_dim()))
      << what << ": the expert index '" << expert.name() << "' of '" << probs.name() << "' ranges over "
      << expert.dim().name() << " but route '" << rn.name << "' chooses among " << rn.expert_dim().name()
      << ": pass probabilities over the route's experts";
  user_check(t.dim().same_as(rn.token_dim()))
      << what << ": the token index '" << t.name() << "' of '" << probs.name() << "' ranges over " << t.dim().name()
      << " but route '" << rn.name << "' routes the tokens of " << rn.token_dim().name()
      << ": pass probabilities over the route's tokens";
  const Var &r = route.pair();

  // f(e): the share of the T * k routed pairs that went to e. It reads no
  // tensor (only the routing), so grad() treats it as the constant it is.
  Func fraction(name + "_fraction", DType::f32);
  fraction(expert) = sum(r, index_eq(route.expert(r), expert)) / extent(r.dim());
  // P(e): the router's mean probability for e over the tokens.
  Func mean_prob(name + "_mean_prob", DType::f32);
  mean_prob(expert) = sum(t, probs(std::vector<Index>(probs.args().begin(), probs.args().end()))) / extent(t.dim());
  // 0-D: a loss is a scalar, and its seed in grad() a 0-D Input.
  Func loss(name, DType::f32);
  double experts = static_cast<double>(rn.expert_dim().extent());
  loss() = options.coefficient * experts * sum(expert, fraction(expert) * mean_prob(expert));
  return loss;
}

Func z_loss(const Func &logits, const Var &expert, const AuxLossOptions &options) {
  const char *what = "z_loss";
  std::string name = checked_name(what, options, "z_loss");
  Var t = token_index(what, "logits", logits, expert);
  // Per token: the log-sum-exp along the experts, parallel over tokens.
  Func lse(name + "_lse", DType::f32);
  lse(t) = log(sum(expert, exp(logits(std::vector<Index>(logits.args().begin(), logits.args().end())))));
  Func loss(name, DType::f32);
  loss() = options.coefficient * sum(t, lse(t) * lse(t)) / extent(t.dim());
  return loss;
}

} // namespace moeforge
