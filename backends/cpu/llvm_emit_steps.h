// One step of the kernel program emitted into its function (codegen_llvm.h
// says what each step's loops are). Private to backends/cpu.
#pragma once

#include "backends/cpu/llvm_builders.h"

namespace moeforge::cpu {

void emit_gemm(const KernelProgram &prog, const GemmStep &g, FunctionBuilder &fb);
void emit_pointwise(const KernelProgram &prog, const PointwiseStep &s, FunctionBuilder &fb);
void emit_gather(const KernelProgram &prog, const GatherStep &s, FunctionBuilder &fb);
void emit_transpose(const KernelProgram &prog, const TransposeStep &s, FunctionBuilder &fb);

} // namespace moeforge::cpu
