// Element-wise outputs taken back out of a merged kernel where that lowers
// a training backward's peak.
//
// merge_sibling_pointwise puts every element-wise output over the same
// pairs into one kernel, so the saved activations they share are read once.
// In a SwiGLU backward that kernel makes the activation gradients from dA
// (dy W2^T) and, beside them, the gated h that dW2 reads. The gated h needs
// no dA, but merged it is made only once dA exists, and so it, dA and both
// activation gradients are live at once (mixtral: four T k x f tensors,
// 1.9 GiB). On its own, the gated h runs first, dW2 reads it and it dies
// before dA is made: the peak holds one T k x f tensor fewer, for one more
// read of the saved pre-activations (about 1 % of the step).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "lowering/kernel_program.h"

namespace moeforge {

// Over steps [boundary, end of p): each element-wise output of a merged
// pointwise step that, run as a step of its own (reading its inputs again)
// and with the steps reordered for memory, lowers the most bytes live at
// once (order_for_memory.h's peak, in-place outputs counted once) is split
// off, until no split lowers it. `kept`: the tensors whose lifetimes do not
// count (held across the backward anyway). Runs after order_steps_for_memory
// and leaves the steps in its order; the in-place marks are left to be made
// again (mark_in_place_outputs).
void split_pointwise_for_memory(KernelProgram &p, size_t boundary, const std::vector<std::string> &kept);

} // namespace moeforge
