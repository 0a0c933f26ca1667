// Lowering passes that move router work into the routing step, last in
// lower() (forward programs only: a training backward reads the router's
// probabilities, so lower_training keeps their steps).
#pragma once

#include <cstddef>

#include "lowering/kernel_program.h"
#include "schedules/schedule.h"

namespace moeforge {

// gate_from_routing: a step g(r) = S(token(r), expert(r)), S the route's
// scores and r its pair (the plain top-k gate), is removed; the routing step
// writes the chosen scores to g itself (RoutingStep::gate_output). So is the
// renormalised gate g(r) = S(token(r), expert(r)) / n(token(r)) with its sum
// n(t) = route_sum over t's pairs of the same chosen scores, when nothing
// else reads n, the route has no capacity and one expert group: the routing
// divides by the sum itself (RoutingStep::renormalize).
KernelProgram gate_from_routing(KernelProgram p, const Schedule &schedule);
// softmax_into_routing: when the scores are S(t, e) = softmax(e, L(t, e)) of
// an f32 tensor L and nothing but the routing reads S (after
// gate_from_routing) nor asks for it as an output, S's step and tensor go:
// the routing reads L and takes the softmax itself (RoutingStep::softmax).
KernelProgram softmax_into_routing(KernelProgram p, const Schedule &schedule);

} // namespace moeforge
