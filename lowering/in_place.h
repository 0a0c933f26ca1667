// Element-wise outputs written over an input's bytes.
//
// An element-wise step computes every value of an element before it stores
// any (the backends' contract for PointwiseStep), so an output may take the
// bytes of an input the step reads only at the element it writes, once no
// later step reads that input: in a training step's backward the gradient
// of one activation then takes the bytes of the gradient it is made from
// (SwiGLU's dH becomes dA in place), and the backward's workspace holds one
// T k x f tensor fewer at its peak.
#pragma once

#include <cstddef>
#include <map>
#include <string>

#include "lowering/kernel_program.h"

namespace moeforge {

// Marks, in each element-wise step's `in_place`, the outputs that may take
// an input's bytes: the input is an intermediate (not an Input, not a
// program output), its last reader is this step, and it has the output's
// dtype, dims and row layout; the output is first written here and is an
// intermediate too; the step reads the input only at its own indices and
// takes no reduction or softmax. Each input is taken at most once. An input
// kept across `boundary` (what a training forward saves for its backward)
// is taken only under p.gradients_over_saved, by a step after the
// boundary: the backward then destroys what it read, so a forward serves
// one backward. Such an input is preferred, since the saved region holds
// its bytes until the backward ends anyway, while a transient input taken
// would live on as long as the output. Run after the last pass that
// reorders or merges steps: the marks hold for the steps' order as it is
// (plan_step_memory checks them again).
void mark_in_place_outputs(KernelProgram &p, size_t boundary);

// Whether step `s` of p may write `output` over `input` as mark_in_place_outputs
// requires, in the steps' order as it is now.
bool may_write_in_place(const KernelProgram &p, size_t s, const std::string &output, const std::string &input,
                        size_t boundary);

// Whether `input` may live in the bytes of `output`, a program output (the
// caller's tensor, which it points the layer at) that step s writes while
// reading `input` only at its own indices: `input` is an intermediate of
// the output's dtype, dims and layout, written by one step before s and
// read by s alone, in the same part of the program (not kept across
// `boundary`), and no step before s touches the output. The input's writer
// then fills the output's memory, and s reads each element there before it
// writes the output's value over it. A training backward's input gradient,
// the experts' share summed onto the router's, so needs no workspace for
// the router's share. mark_in_place_outputs marks such a pair too (the
// kernels must not treat the two pointers as apart); plan_step_memory
// places the input there.
bool may_live_in_output(const KernelProgram &p, size_t s, const std::string &output, const std::string &input,
                        size_t boundary);

// Whether `input`, read by step `s`, is what a forward saved: written before
// `boundary`, with s at or after it.
bool is_saved_input(const KernelProgram &p, size_t s, const std::string &input, size_t boundary);

// The outputs marked to take a saved tensor's bytes (Schedule::
// gradients_over_saved), output -> the saved tensor, where the steps' order
// still allows it. Where the runtime shares those bytes (memory the caller
// gives each step), a backward destroys what its forward saved.
std::map<std::string, std::string> written_over_saved(const KernelProgram &p, size_t boundary);

} // namespace moeforge
