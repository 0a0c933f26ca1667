// The order of a program's steps that keeps the least memory live at once.
//
// Lowering emits a training step's backward in the order autodiff wrote its
// Funcs: each gradient GEMM after the whole chain that feeds the input's
// gradient, so a tensor the weight gradients read (the upstream gradient
// gathered into expert rows, T k x d) stays live across that chain, beside
// the chain's own T k x d temporaries. Where several steps could run next,
// this pass runs first the one that frees the most bytes (as the last reader
// of a temporary) for the fewest it allocates, so a temporary dies as soon as
// what reads it has run. The kernels are the same and run the same number of
// times; only their order, and so which temporaries overlap, changes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "lowering/kernel_program.h"

namespace moeforge {

// Reorders steps [begin, end) of p. A step stays after every step of the
// range it depends on: one that writes what it reads or writes, or reads
// what it writes. Only the lifetimes of the tensors not in `kept` count
// (inputs, outputs and what the caller keeps across the range live anyway).
// Sizes are estimated with every token Dim at `tokens` (a layer's memory is
// dominated by its per-token and per-pair tensors at any count, so one
// estimate orders well for all). Ties keep the steps' order.
void order_steps_for_memory(KernelProgram &p, size_t begin, size_t end, const std::vector<std::string> &kept,
                            int64_t tokens = 16384);

// The most bytes of tensors not in `kept` live at once over steps
// [begin, end), at the same size estimate: what order_steps_for_memory
// lowers (a tensor is live from the step writing it to its last reader; one
// written before `begin` counts from `begin`; an output marked in place
// shares its input's bytes).
size_t peak_live_bytes(const KernelProgram &p, size_t begin, size_t end, const std::vector<std::string> &kept,
                       int64_t tokens = 16384);

} // namespace moeforge
