// The CPU backend's FP8 operands (Schedule::fp8): before a GEMM step whose
// Func takes them, each operand it multiplies is rounded by dsl/fp8.h's block
// rule into a copy, and the step's kernel reads the copy in its place. The
// scales are powers of two, so the rounded values are exact in the operand's
// own dtype (bf16 or f32) and the kernel's unchanged product of them is the
// product the reference evaluates and an FP8 tensor core with per-block
// scales computes. The copies are the CPU's way to check the numbers; the
// GPU's FP8 GEMMs are to quantise in the steps that make their operands.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsl/fp8.h"
#include "lowering/kernel_program.h"

namespace moeforge::cpu {

// An operand of a GEMM step and whether its stored last axis is the
// contracted one (A[rows, k], B^T[e?, n, k]) or its first (A^T[k, rows],
// B[e?, k, n]).
struct Fp8Operand {
  std::string tensor;
  bool k_last = true;
};

// The operands g multiplies (A, each B, a chained A2 and B2), each once.
std::vector<Fp8Operand> fp8_operands(const GemmStep &g);

// A UserError, naming the Func, for an FP8 GEMM the CPU backend does not
// round yet: a weight gradient (an expert reduction, whose blocks would run
// over each expert's rows in the routing's order), or an epilogue that reads
// an operand as well (it would read the rounded copy).
void check_fp8_gemms(const KernelProgram &program);

// `bytes` of tensor t's storage at `shape` (its shape at the current token
// count), rounded: a weight (no dynamic Dim) in 128 x 128 blocks of each
// expert's matrix, an activation in blocks of 128 along its contracted axis
// and one element across it.
std::vector<uint8_t> fp8_rounded_copy(const TensorDecl &t, const std::vector<int64_t> &shape, const uint8_t *bytes,
                                      size_t size, bool k_last, Fp8Format format);

} // namespace moeforge::cpu
