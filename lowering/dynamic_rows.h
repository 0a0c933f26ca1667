// Rows of a run-time length, padded to 8 elements.
//
// A tensor whose last dim is the token count (or a route's pair count) has
// rows of a length known only at run time: Mixture-of-Attention's scores
// p(r, u) over the tokens u, their gradients, x^T for the router's weight
// gradient. The CUDA GEMMs move rows in 16-byte vectors (8 bf16 or 4 f32
// values), so such a row must start at a multiple of 8 elements whatever
// the count: each gets a row stride rounded up to 8 (TensorDecl::stride8).
// What sits in a row's tail is never read as a value: a GEMM that reads
// such rows as A zero-fills the elements past K itself, and element-wise
// steps stop at the row's length.
#pragma once

#include "lowering/kernel_program.h"

namespace moeforge {

// Sets stride8 on every intermediate of rank 2 or more (not an Input, Param
// or program output: those are the caller's dense tensors) whose last dim
// is dynamic, in any layout but padded_t (whose rows are the route's
// padded rows, already whole routing blocks). Idempotent: the
// lowerings run it once their tensors are made, and again before planning
// for the tensors later passes add.
void pad_dynamic_rows(KernelProgram &p);

} // namespace moeforge
