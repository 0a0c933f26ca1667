// GEMMs whose outputs are only ever added (Schedule::chain_summed_gemms), a
// rewrite of a training program's backward that the algebra allows.
//
// SwiGLU's h1 = x W1 and h3 = x W3 both read x, so x's gradient is a sum of
// two products over the routed pairs:
//     d_x(t, d) = combine(route, t, X1(r, d)) + combine(route, t, X2(r, d)) + ...
//     X1(r, d)  = sum(j, dH1(r, j) * W1(expert(r), d, j))
//     X2(r, d)  = sum(j, dH3(r, j) * W3(expert(r), d, j))
// combine is a sum over t's pairs, so the two terms are combine(route, t,
// X1 + X2), and X1 + X2 is one GEMM over both reductions: A B + A2 B2 into
// one accumulator (GemmStep::chained). One T*k x d tensor is written and
// read instead of two, and each output tile has one epilogue instead of two.
#pragma once

#include <cstddef>

#include "lowering/kernel_program.h"

namespace moeforge {

// Rewrites every such pair among the steps [begin, end) of p: the later
// GEMM takes the earlier one's operands as its chained product, the earlier
// GEMM and its output go, and the element-wise step keeps one of the two
// terms. Two GEMMs qualify when each stores its plain accumulator, has one
// B operand and no fused outputs, both run over the same rows (route, row
// maps, B's layout) and columns, and nothing else reads either output.
// Returns how many pairs were chained.
int chain_summed_gemms(KernelProgram &p, size_t begin);

} // namespace moeforge
