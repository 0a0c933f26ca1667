// Routed tensors stored in the pair order (T k rows, row p for pair p)
// instead of the padded one (T k + E (block - 1) rows in the worst case of
// every expert's last block), where no reader needs the padded order.
//
// A GEMM's tiles run over an expert's rows in the padded order, so a tensor
// a GEMM loads (by TMA, in tile order) stays padded; an element-wise step
// finds a pair's row in either layout, and a GEMM whose epilogue stores row
// by row (not a TMA tile) can store each row at sorted_pair[p]. A route that
// drops pairs keeps the padded order (its kept rows are bounded by it, not
// by T k).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "lowering/kernel_program.h"

namespace moeforge {

// A training forward's saved activations: a routed tensor the forward's GEMM
// epilogue writes among its outputs (SwiGLU's two pre-activations) and that
// only element-wise steps read. The saved region is what a model keeps per
// layer between its forward and its backward; the padding it no longer
// holds is 12 % of it on qwen3moe (128 experts, top-8). A GEMM storing by
// TMA (GeLU's pre-activation beside h) keeps its outputs padded: the plain
// stores would cost that GEMM its speed. Stores in pair order those of them
// that `store` accepts, and returns them all.
std::vector<std::string> save_in_pair_order(KernelProgram &p, size_t forward_steps,
                                            const std::function<bool(const std::string &)> &store);

// A training backward's routed GEMM outputs that only element-wise steps
// read, from a GEMM that stores row by row: the input gradient's per-pair
// rows (T k x d), which the sum over each token's pairs reads, are the
// largest tensor of the backward's workspace at its fullest step, and their
// padding (E (block - 1) x d) goes with this. The sum then reads a token's
// k rows one after another.
void backward_rows_in_pair_order(KernelProgram &p, size_t forward_steps);

} // namespace moeforge
