#include "examples/aux_loss_example.h"

#include <algorithm>

#include "dsl/error.h"
#include "dsl/losses.h"

namespace moeforge {

std::vector<Func> AuxLossLayer::output_funcs() const {
  std::vector<Func> out;
  for (const std::string &name : outputs)
    out.push_back(example.pipeline.func(name));
  return out;
}

AuxLossLayer with_aux_losses(const Example &layer, const AuxLossCoefficients &c) {
  const Pipeline &p = layer.pipeline;
  user_check(!layer.route.empty()) << "example '" << layer.name
                                   << "' has no routing: the auxiliary losses need a routed layer (moe_mlp, "
                                      "swiglu_moe or a biased_moe)";
  auto it =
      std::find_if(p.routes().begin(), p.routes().end(), [&](const RoutingPtr &r) { return r->name == layer.route; });
  user_check(it != p.routes().end()) << "example '" << layer.name << "' names its route '" << layer.route
                                     << "' but its pipeline has no route of that name";
  const RoutingPtr &rn = *it;
  bool has_logits = std::any_of(p.steps().begin(), p.steps().end(),
                                [](const Pipeline::Step &s) { return s.func && s.func->name == "logits"; });
  user_check(has_logits) << "example '" << layer.name
                         << "' has no Func named 'logits': the z-loss reads the router's logits, so name them "
                            "\"logits\" (logits(t, e) = sum(i, x(t, i) * wr(i, e)))";
  // The user's handle on the layer's route: the routing and its gate Func.
  Route route(rn, p.func(rn->name + "_gate"));
  Func probs(rn->probs), logits = p.func("logits");
  const Var &e = rn->expert_var;
  Func lb = load_balancing_loss(route, probs, e, {"lb_loss", c.load_balancing});
  Func z = z_loss(logits, e, {"z_loss", c.z});

  Func y = p.func(layer.output);
  Example ex = layer;
  ex.name = layer.name + "_aux";
  ex.description = layer.description + "; plus the load-balancing loss and the router z-loss";
  ex.pipeline = Pipeline({y, lb, z});
  return AuxLossLayer{ex, {y.name(), lb.name(), z.name()}, lb.name(), z.name()};
}

AuxLossLayer make_aux_loss_example(const std::string &name, const ExampleShape &shape, const AuxLossCoefficients &c) {
  user_check(name == "moe_mlp" || name == "swiglu_moe")
      << "unknown example with auxiliary losses '" << name << "': choose moe_mlp or swiglu_moe";
  return with_aux_losses(make_example(name, shape), c);
}

} // namespace moeforge
