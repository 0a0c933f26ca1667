// Lowering pass: sibling element-wise steps merge into one kernel with
// several outputs (and row sums riding along), so the inputs they share are
// read once.
#pragma once

#include <cstddef>

#include "lowering/kernel_program.h"
#include "schedules/schedule.h"

namespace moeforge {

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
