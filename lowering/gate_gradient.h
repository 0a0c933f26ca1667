// The gate's gradient through the expert contraction
// (Schedule::gate_gradient_from_dh), a rewrite of a training program's
// backward that the algebra allows.
//
// A gated combine y(t) = sum over t's pairs r of s(r) * o(r, :), with
// o(r, i) = sum(j, h(r, j) * W(expert(r), j, i)), differentiates to
//     d_s(r)    = sum(i, dy(token(r), i) * o(r, i))      reads o
//     d_o(r, i) = s(r) * dy(token(r), i)
//     d_h(r, j) = sum(i, d_o(r, i) * W(expert(r), j, i))
// o is linear in h, so d_s(r) = sum(j, h(r, j) * u(r, j)) with
// u(r, j) = sum(i, dy(token(r), i) * W(expert(r), j, i)), and d_h = s(r) * u.
// The dH GEMM then computes u from dy's rows (a per-pair copy of them, or
// gathered by token inside the GEMM where the schedule gathers there),
// every element-wise read of d_h becomes s(r) * u, and d_s sums h * u over
// j: the backward no longer reads o, so the forward need not keep it
// (T * k x d). Dividing d_h by s(r) instead would fail where a gate is 0.
// Under recompute_elementwise, with dy's rows copied per pair, dW2 =
// sum_r h(r)^T d_o(r) reads s(r) * h (made beside the h the backward makes
// again) against that copy, and d_o itself is no longer made.
#pragma once

#include <cstddef>
#include <map>
#include <string>

#include "lowering/kernel_program.h"
#include "schedules/schedule.h"

namespace moeforge {

// Rewrites the backward steps [forward_steps, end) of p as above. `copies`
// maps forward tensors to the backward's own copies of them
// (Schedule::recompute): h is read through it. Returns whether the pattern
// was found and rewritten; a program without it (no gated combine of a
// contraction, or a GEMM reading d_h) is left unchanged.
bool gate_gradient_from_dh(KernelProgram &p, size_t forward_steps, const Schedule &schedule,
                           const std::map<std::string, std::string> &copies);

} // namespace moeforge
