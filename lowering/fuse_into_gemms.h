// Lowering passes that move work into GEMMs: sibling GEMMs over one A become
// one GEMM with a B each, element-wise consumers of a GEMM's output become
// its epilogue's extra outputs, and a combine over pairs becomes atomic adds
// in the epilogue (where the schedule asks).
#pragma once

#include <cstddef>

#include "lowering/kernel_program.h"
#include "schedules/schedule.h"

namespace moeforge {

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

} // namespace moeforge
