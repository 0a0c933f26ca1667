// Lowering: algebra + schedule -> kernel program. The passes run in the
// order listed in lower.cpp's `lower`; an observer gets the program after
// each one (`moeforge emit --passes` prints them, and golden tests keep
// them), as does MOEFORGE_DEBUG=lower on stderr. A Pipeline or Schedule the
// program cannot express is a UserError that says which definition and why.
#pragma once

#include <functional>
#include <string>

#include "dsl/pipeline.h"
#include "lowering/kernel_program.h"
#include "schedules/schedule.h"

namespace moeforge {

// Called after each pass with its name and the program it left.
using PassObserver = std::function<void(const std::string &pass, const KernelProgram &program)>;

KernelProgram lower(const Pipeline &pipeline, const Schedule &schedule, const PassObserver &observe = {});

// The passes, in order (each is also usable alone, for tests).
KernelProgram build_steps(const Pipeline &pipeline, const Schedule &schedule);
KernelProgram fuse_gate_into_epilogue(KernelProgram p, const Schedule &schedule);
KernelProgram split_unfused_epilogues(KernelProgram p, const Schedule &schedule);
KernelProgram insert_permutation(KernelProgram p, const Schedule &schedule);
KernelProgram assign_row_layouts(KernelProgram p, const Schedule &schedule);
KernelProgram resolve_row_maps(KernelProgram p, const Schedule &schedule);
KernelProgram materialize_transposes(KernelProgram p, const Schedule &schedule);
// Then fuse_elementwise_consumers over the whole program (below),
// fuse_atomic_combines (where the schedule asks), and last
// the two that move work into the routing (forward programs only):
//
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

// The passes up to materialize_transposes: lower_training fuses the
// forward's and the backward's element-wise steps separately, so no work
// crosses between them (and keeps the probabilities, which the backward reads).
KernelProgram lower_before_fusion(const Pipeline &pipeline, const Schedule &schedule, const PassObserver &observe = {});

// Element-wise steps of steps [begin, end) that read a GEMM's output at its
// (row, col), and whose other reads are ready when that GEMM runs, become
// extra outputs of the GEMM's epilogue (unless the schedule says
// fuse_epilogue(func, false) of the GEMM's Func or the step's); a GEMM output
// nothing reads any more is then not stored. A combine over a route with
// k = 1 (each token's one pair r = t) of a routed GEMM's output fuses too,
// stored at row r; with k > 1 it stays a step (a token's pairs are in
// different tiles; fuse_atomic_combines takes it when the schedule says
// atomic_combine). Returns the new end. lower() runs it last over the whole
// program; lower_training on the forward and the backward separately, so no
// work crosses from one to the other.
size_t fuse_elementwise_consumers(KernelProgram &p, size_t begin, size_t end, const Schedule &schedule);

// Schedule::atomic_combine: a step y(t, col) = combine(route, t, v(r, col))
// over a route with k > 1, whose v reads the output of a routed GEMM of steps
// [begin, end) at (r, col) (and per-pair values ready by then), and is that
// output's only reader, is taken into the GEMM: its epilogue computes v and
// adds it into row token(r) of y (GemmStep::out_add), the GEMM's output is
// no longer stored, and the combine's step goes. Returns the new end.
size_t fuse_atomic_combines(KernelProgram &p, size_t begin, size_t end);
// The note KernelProgram::not_applied carries when atomic_combine(true) found
// no such combine.
extern const char *const kAtomicCombineNotApplied;

// GEMMs of steps [begin, end) over the same A, rows, columns and tiling
// (SwiGLU's x W1 and x W3, once autodiff has made them Funcs of their own)
// become one GEMM with a B and an accumulator each, so A is read once; the
// later GEMM's output becomes an extra output of the first. Only where the
// merged accumulators fit (wgmma: tile_n / 2 registers per B and thread, at
// most 128) and the later B is ready at the first. Returns the new end.
size_t merge_sibling_gemms(KernelProgram &p, size_t begin, size_t end);

// Element-wise steps of steps [begin, end) over the same index Dims whose
// outputs are stored alike (the backward's SwiGLU derivatives, both made
// from d_h and the saved pre-activation) become one step with extra outputs,
// so that the inputs they share are read once: a later step joins an earlier
// one when everything it reads is ready there or is one of the earlier
// step's element-wise values at its own indices (the value then replaces
// the read). A sum over the last index of such a sibling's values joins it
// as a row sum (ExtraOutput::row_sum; the gate gradient beside d_o). Other
// steps that reduce (softmax, combines) stay apart, and so does a step
// whose output the schedule gives fuse_epilogue(false) (by name, or
// schedule-wide for the parts lowering made). Returns the new end.
size_t merge_sibling_pointwise(KernelProgram &p, size_t begin, size_t end, const Schedule &schedule);

} // namespace moeforge
