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

#include "lowering/kernel_program.h"

namespace moeforge {

// Marks, in each element-wise step's `in_place`, the outputs that may take
// an input's bytes: the input is an intermediate (not an Input, not a
// program output, not kept across `boundary`: the tensors a training
// forward keeps for its backward, which may run more than once), its last
// reader is this step, and it has the output's dtype, dims and row layout;
// the output is first written here and is an intermediate too; the step
// reads the input only at its own indices and takes no reduction or
// softmax. Each input is taken at most once. Run after the last pass that
// reorders or merges steps: the marks hold for the steps' order as it is
// (plan_step_memory checks them again).
void mark_in_place_outputs(KernelProgram &p, size_t boundary);

// Whether step `s` of p may write `output` over `input` as mark_in_place_outputs
// requires, in the steps' order as it is now.
bool may_write_in_place(const KernelProgram &p, size_t s, const std::string &output, const std::string &input,
                        size_t boundary);

} // namespace moeforge
