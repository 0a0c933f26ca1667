// The CPU backend's AttentionStep (lowering/fuse_attention.h), run on the
// host: the forward's softmax online a row at a time (the running maximum
// rescaling what was summed before it), each row's log-sum-exp where the
// step keeps it, and the two gradient parts from it, the probabilities made
// again as exp(s - lse). In f32 from the stored values, as the GPU's
// kernels compute (their products round p and ds to bf16; these do not).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "lowering/kernel_program.h"

namespace moeforge::cpu {

// Where a step's tensors are at this run's shapes, and its route's tables.
struct AttentionMemory {
  std::function<uint8_t *(const std::string &)> tensor; // a tensor's bytes
  std::function<int64_t(const TensorDecl &)> elements;  // the elements it stores
  const int32_t *sorted_pair = nullptr;                 // the step's route's (where it has one)
  int64_t padded_rows = 0;                              // the route's slots in use
};

void run_attention(const KernelProgram &prog, const AttentionStep &step, const AttentionMemory &memory);

} // namespace moeforge::cpu
