// Optimisation and JIT compilation of a generated module: the new pass
// manager's O2 pipeline for the host CPU (so the loop vectoriser sees the
// host's vector width), then ORC LLJIT. Compiled programs are cached within
// the process by their unoptimised IR text, so a program lowered twice (same
// layer and schedule) is compiled once.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backends/cpu/codegen_llvm.h"

namespace moeforge::cpu {

// Compiled step functions, in program order, with their argument lists.
// Holds the JIT alive; shared by every layer compiled from the same IR.
struct JitProgram {
  std::vector<CpuKernel> kernels;
  std::vector<StepFunction> functions;
  std::string ir;            // the unoptimised IR (the cache key)
  std::string optimised_ir;  // after the O2 pipeline
  std::shared_ptr<void> jit; // the LLJIT instance, type-erased
};

// Optimises and compiles `module` (or returns the cached result for the same
// IR). LLVM errors become InternalErrors naming `what` and the step.
std::shared_ptr<const JitProgram> jit_compile(LlvmModule module, const std::string &what);

// Runs the O2 pipeline on `module` in place (for printing optimised IR).
void optimise_module(LlvmModule &module, const std::string &what);

} // namespace moeforge::cpu
