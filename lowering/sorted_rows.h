// Saved routed tensors, and the gradients a backward writes over them, in
// the expert-sorted order without padding (RowLayout::sorted).
//
// Under gradients_over_saved a backward writes SwiGLU's dH1 and dH3 over the
// saved pre-activations, and GEMMs load those gradients in tile order (dX's
// A, dW1's and dW3's B), so both stayed padded: T k + E (block - 1) rows in
// the worst case of every expert's last tile, which is what the saved
// region is sized by. Sorted, a tile's rows are still consecutive (from
// offsets_unpadded[e] + its padded start - offsets[e]), so the GEMMs load
// them by TMA as before, and each tensor holds T k rows: fine64's saved
// region goes from 752 to 708 MiB a layer, gpt-oss's by 180 MiB (128
// experts, f = 2880).
//
// A box that starts at a tile's sorted row runs past the expert's rows
// into the next expert's. Every reader this pass allows tolerates that:
// an element-wise step reads each pair at its own row; a routed GEMM
// reading the tensor as A (rows are the output's rows) stores only the
// tile's own rows; an expert reduction reading it as B (rows are the sum's
// K) multiplies those rows by A's, which are zero there (a padded A with
// zero padding rows, loaded by TMA, or a sorted A whose rows there the
// loop zeroes: store_gathers_sorted below), and a box past the last
// expert's rows reads past the tensor, which TMA fills with zeros. (A row
// past an expert's own holds the next expert's finite values; a
// non-finite one there would make 0 x inf a NaN in this expert's weight
// gradient, where the step's gradients are already not finite.)
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "lowering/kernel_program.h"

namespace moeforge {

// Stores in RowLayout::sorted each saved tensor of `over_saved` (gradient ->
// the saved tensor it is written over, the training program's
// written_over_saved) together with its gradient, where both qualify: the
// saved tensor is padded, over a route that drops nothing, written in tile
// order by a forward routed GEMM's epilogue (its output or a further one)
// with plain stores (no TMA tile, which would store the tile's padding rows
// into the next expert's), and read by element-wise steps only; the gradient is written
// by an element-wise step and read by element-wise steps, as A (or the
// chained A2) of a routed GEMM, and as B of an expert reduction whose A is
// a padded tensor zero on its padding rows. Returns the saved tensors it stored so.
std::vector<std::string> store_saved_sorted(KernelProgram &p, size_t forward_steps,
                                            const std::map<std::string, std::string> &over_saved);

// After store_saved_sorted: stores in RowLayout::sorted each gathered copy
// (a GatherStep's padded output, x's rows for dW1 and dW3) that only expert
// reductions read, each as its A, in place by TMA, over a B stored sorted.
// Both operands then start at the expert's unpadded first row and K is the
// expert's pair count, so the last k-tile's box reads the next expert's
// rows in both; the CUDA loop zeroes A's there in shared memory before the
// tensor cores read the stage (GemmPlan::k_unpadded), and the CPU backend
// reads an expert's own rows only. The gather writes each pair's row at
// its sorted row and nothing on padding. The copy loses E (block - 1) rows
// (fine64: 544.5 -> 512 MiB, what was the backward's fullest tensor). Returns the
// copies it stored so.
std::vector<std::string> store_gathers_sorted(KernelProgram &p);

} // namespace moeforge
