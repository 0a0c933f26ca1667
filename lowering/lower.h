// Lowering: algebra + schedule -> kernel program. The passes run in the
// order listed in lower.cpp's `lower`; MOEFORGE_DEBUG=lower prints the
// program after each one. A Pipeline or Schedule the program cannot express
// is a UserError that says which definition and why.
#pragma once

#include "dsl/pipeline.h"
#include "lowering/kernel_program.h"
#include "schedules/schedule.h"

namespace moeforge {

KernelProgram lower(const Pipeline &pipeline, const Schedule &schedule);

// The passes, in order (each is also usable alone, for tests).
KernelProgram build_steps(const Pipeline &pipeline, const Schedule &schedule);
KernelProgram fuse_gate_into_epilogue(KernelProgram p, const Schedule &schedule);
KernelProgram split_unfused_epilogues(KernelProgram p, const Schedule &schedule);
KernelProgram insert_permutation(KernelProgram p, const Schedule &schedule);
KernelProgram assign_row_layouts(KernelProgram p, const Schedule &schedule);
KernelProgram resolve_row_maps(KernelProgram p, const Schedule &schedule);
KernelProgram materialize_transposes(KernelProgram p, const Schedule &schedule);
// Last: fuse_elementwise_consumers over the whole program (below).

// Every pass above but the last: lower_training fuses the forward's and the
// backward's element-wise steps separately, so no work crosses between them.
KernelProgram lower_before_fusion(const Pipeline &pipeline, const Schedule &schedule);

// Element-wise steps of steps [begin, end) that read a GEMM's output at its
// (row, col), and whose other reads are ready when that GEMM runs, become
// extra outputs of the GEMM's epilogue (unless the schedule says
// fuse_epilogue(func, false) of the GEMM's Func or the step's); a GEMM output
// nothing reads any more is then not stored. A combine over a route with
// k = 1 (each token's one pair r = t) of a routed GEMM's output fuses too,
// stored at row r; with k > 1 it stays a step (a token's pairs are in
// different tiles). Returns the new end. lower() runs it last over the whole
// program; lower_training on the forward and the backward separately, so no
// work crosses from one to the other.
size_t fuse_elementwise_consumers(KernelProgram &p, size_t begin, size_t end, const Schedule &schedule);

} // namespace moeforge
