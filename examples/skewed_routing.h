// Inputs under which a softmax router's top-k is skewed: the busiest expert
// gets about `target` times the mean of the pairs. The benchmarks skew
// routing with a router bias (biased_moe.h); the examples' routers have
// none, so a bias is made from what they do have: one feature of x held at
// 1 for every token, whose router weights are a ramp over the experts
// (logit(t, e) gains ramp * e / E, as the benchmarks' bias adds). The ramp
// is found by bisection on the routing of every token, computed here.
// Used by `moeforge tune`, so that a schedule is chosen for both routings.
#pragma once

#include <optional>
#include <string>

#include "examples/examples.h"
#include "runtime/tensor.h"

namespace moeforge {

struct SkewedInputs {
  TensorMap inputs;         // x and wr as skewed: the other inputs stay as they were
  double ramp = 0;          // the bias ramp found
  double max_over_mean = 0; // the busiest expert's pairs over the mean, over every token
};

// nullopt (with `why`) where the layer's router is not logits = x wr with
// x [T, d] and wr [d, E] (the MoE examples' router), or no ramp reaches
// `target`.
std::optional<SkewedInputs> skewed_router_inputs(const TensorMap &inputs, int64_t topk, double target,
                                                 std::string *why);

} // namespace moeforge
