// Lowering: algebra + schedule -> kernel program. The passes run in the
// order listed in lower.cpp's `lower`; an observer gets the program after
// each one (`moeforge emit --passes` prints them, and golden tests keep
// them), as does MOEFORGE_DEBUG=lower on stderr. A Pipeline or Schedule the
// program cannot express is a UserError that says which definition and why.
#pragma once

#include <functional>
#include <string>

#include "dsl/pipeline.h"
#include "lowering/fuse_into_gemms.h"
#include "lowering/kernel_program.h"
#include "lowering/merge_pointwise.h"
#include "lowering/router_into_routing.h"
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
// Then the fusions of fuse_into_gemms.h and merge_pointwise.h, and last
// the two passes of router_into_routing.h (forward programs only).

// The passes up to materialize_transposes: lower_training fuses the
// forward's and the backward's element-wise steps separately, so no work
// crosses between them (and keeps the probabilities, which the backward reads).
KernelProgram lower_before_fusion(const Pipeline &pipeline, const Schedule &schedule, const PassObserver &observe = {});

} // namespace moeforge
