// Lowering for training: the layer's forward and backward as one kernel
// program, split into two entry points. The forward is every step the
// layer's output needs (routing included); the backward is the rest and reads
// what the forward left in memory: those tensors are the activations a
// training step keeps between its forward and its backward (`saved`).
//
// Under a schedule with recompute(true), the backward makes its own copy of
// each routed activation that is cheap to make again (element-wise steps,
// gathers, and GEMMs that read the layer's inputs), so the forward's copy need
// not be kept; outputs of GEMMs over other activations (the second expert
// GEMM) stay stored, recomputing them would cost a whole GEMM.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsl/training.h"
#include "lowering/kernel_program.h"
#include "schedules/schedule.h"

namespace moeforge {

struct TrainingProgram {
  KernelProgram program;                  // the forward's steps first, then the backward's
  size_t forward_steps = 0;               // steps [0, forward_steps) are the forward
  std::string output, seed;               // the forward output ("y") and the upstream gradient Input ("d_y")
  std::vector<std::string> gradients, of; // "d_x", ... and the Input or Param each belongs to
  // Tensors the forward writes and the backward reads, in program order.
  std::vector<std::string> saved;
  std::vector<std::string> recomputed; // forward tensors the backward makes again
};

// Lowers training_algebra(forward, output) under `schedule`.
TrainingProgram lower_training(const Pipeline &forward, const Func &output, const Schedule &schedule);

} // namespace moeforge
