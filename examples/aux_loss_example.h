// The routed example layers with their auxiliary training losses as extra
// outputs: Switch Transformer's load-balancing loss and ST-MoE's router
// z-loss (dsl/losses.h), each a 0-D Func weighted by its coefficient. The
// layer itself is built by make_example (or biased_moe) unchanged: the same
// Funcs, names and output y; the losses only read its router.
//
//     AuxLossLayer a = make_aux_loss_example("moe_mlp", shape);
//     Gradients g = grad(a.example.pipeline, a.output_funcs()); // seeds d_y, d_lb_loss, d_z_loss
#pragma once

#include <string>
#include <vector>

#include "examples/examples.h"

namespace moeforge {

struct AuxLossCoefficients {
  double load_balancing = 0.01; // Switch Transformer's alpha
  double z = 0.001;             // ST-MoE's router z-loss weight
};

struct AuxLossLayer {
  // The layer with the losses: pipeline outputs are `outputs`, in order;
  // example.output is still the layer's own output ("y").
  Example example;
  std::vector<std::string> outputs; // {"y", "lb_loss", "z_loss"}
  std::string load_balancing_loss;  // "lb_loss"
  std::string z_loss;               // "z_loss"
  // The output Funcs, for grad(pipeline, outputs).
  std::vector<Func> output_funcs() const;
};

// Adds the two losses to a routed layer: its route, the probabilities that
// route selected on and a Func named "logits" (the router's logits), as
// moe_mlp, swiglu_moe and biased_moe build them. The result is named
// "<layer>_aux". A layer without them is a UserError that says what is
// missing.
AuxLossLayer with_aux_losses(const Example &layer, const AuxLossCoefficients &c = {});

// make_example(name, shape) with the losses: "moe_mlp" or "swiglu_moe".
AuxLossLayer make_aux_loss_example(const std::string &name, const ExampleShape &shape,
                                   const AuxLossCoefficients &c = {});

} // namespace moeforge
