// What a layer holds at one token count, in words a user can act on: the
// bytes a training forward keeps for its backward (each saved tensor), and
// for each entry point the workspace it touches and the tensors live at
// its fullest step. `moeforge emit --memory` prints it; it is the plan the
// CUDA runtime places its buffers by (runtime/memory_plan.h), so what it
// says is what a module asks torch's allocator for.
#pragma once

#include <cstdint>
#include <string>

#include "lowering/kernel_program.h"
#include "runtime/memory_plan.h"

namespace moeforge {

// `boundary`: the first backward step of a training program; the program's
// step count for a forward alone (nothing is then saved).
std::string memory_report(const KernelProgram &p, size_t boundary, int64_t tokens);

} // namespace moeforge
