// Two weight gradients as one expert reduction (Schedule::merge_weight_gradients).
//
// SwiGLU's backward reduces x's routed rows twice over the same rows:
// dW1 = X^T dH1 and dW3 = X^T dH3. As two kernels each loads every A stage
// for itself, and at f = 1408 under 256-wide tiles each has a last column
// tile half empty (6 tiles for 5.5 tiles' columns). As one, each tile holds
// tile_n / 2 columns of both gradients: its stage carries both B's columns
// side by side, one wgmma of tile_n columns reads A once for both, and
// f = 1408 takes 11 tiles of 128 + 128 columns where the two took 12.
#pragma once

#include <cstddef>

#include "lowering/kernel_program.h"

namespace moeforge {

// Merges each later expert reduction of steps [begin, end) into an earlier
// one that reduces the same A over the same route and rows, into outputs
// of the same shape, with one B stored alike (same tensor layout, row map
// and dtype) and the same tiling, whose B is ready at the earlier step: the
// earlier step gets the second B and an accumulator for it, its tile_n
// halved (each B's columns; wgmma's registers hold tile_n / 2 of them per
// thread in all), and the later step's output becomes its further output.
// Only single-B reductions read in place (operands_in_place) by the
// warp-specialised loop with TMA loads and an even tile_n of at least 128
// merge, as the CUDA plan runs them (gemm_plan.h). Returns how many merged.
size_t merge_weight_gradients(KernelProgram &p, size_t begin, size_t end);

} // namespace moeforge
