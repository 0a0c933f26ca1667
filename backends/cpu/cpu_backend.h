// The LLVM CPU backend behind the backend interface (runtime/backend.h):
// CpuLayer and CpuTrainingLayer, each holding its pipeline and compiled
// program, so that callers need not keep them alive.
#pragma once

#include <memory>

#include "runtime/backend.h"

namespace moeforge::cpu {

// Layers on this machine's cores (MOEFORGE_CPU_THREADS of them, else all).
std::unique_ptr<Backend> make_backend();

} // namespace moeforge::cpu
