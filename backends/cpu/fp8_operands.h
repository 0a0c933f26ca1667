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

// A UserError, naming the Func and the fix, for an FP8 GEMM the CPU backend
// cannot round: a weight gradient (an expert reduction) that reads an
// operand by each pair's token row (x or dy gathered: a token's row would
// need another rounding in each expert's blocks), or an epilogue that reads
// an operand as well (it would read the rounded copy).
void check_fp8_gemms(const KernelProgram &program);

// `bytes` of tensor t's storage at `shape` (its shape at the current token
// count), rounded: a weight (no dynamic Dim) in 128 x 128 blocks of each
// expert's matrix, an activation in blocks of 128 along its contracted axis
// and one element across it.
std::vector<uint8_t> fp8_rounded_copy(const TensorDecl &t, const std::vector<int64_t> &shape, const uint8_t *bytes,
                                      size_t size, bool k_last, Fp8Format format);

// The routing tables a weight gradient's operand rows follow (the host's
// copies of the route's arrays, runtime/routing_format.h).
struct ExpertRows {
  int64_t experts = 0;
  const int32_t *counts = nullptr, *offsets = nullptr, *offsets_unpadded = nullptr, *sorted_pair = nullptr;
};

// The same for an operand of a weight gradient (a sum over each expert's
// pairs, read through `rows`): blocks of 128 of each expert's pairs, in the
// routing's order from the expert's first, times one column; the rows (or,
// stored transposed, the columns) that are no pair's (padding, dropped
// pairs) are left as they are and count in no block.
std::vector<uint8_t> fp8_rounded_expert_copy(const TensorDecl &t, const std::vector<int64_t> &shape,
                                             const uint8_t *bytes, size_t size, RowMap rows, const ExpertRows &route,
                                             Fp8Format format);

} // namespace moeforge::cpu
