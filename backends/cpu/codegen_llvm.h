// Kernel program -> LLVM IR: one function per step (routing stays on the
// host), built with IRBuilder. Loops are plain counted loops over allocas;
// the O2 pipeline (jit.h) promotes them to registers and vectorises the
// inner ones.
//   GEMM       routed: tiles of the routing table x rows in the tile, or
//              dense: rows; then N in blocks of the schedule's tile_n, K
//              (K may be dynamic: d_wr reduces over the tokens). Operand
//              rows follow the step's RowMaps; fp32 accumulators; the
//              epilogue expression per element; padding rows skipped.
//              Expert reductions (expert_k): experts x M rows x N blocks,
//              K = the expert's padded segment [offsets[e], offsets[e+1]).
//   pointwise  loops over the Func's domain; combine = a loop over the
//              token's k pairs, expert_sum over the expert's segment of
//              sorted_pair, sum(i, ...) a loop over i; a top-level softmax
//              = three row loops.
//   gather     padded row p = row token(r), r or p (r = sorted_pair[p]),
//              zero on padding.
//   transpose  dense: the last two dims swapped; routed: the padded_t copy
//              dst[c, p] over every padded position, zero on padding.
// LLVM types stay out of this header (its users need no LLVM include path).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backends/cpu/cpu_kernel.h"
#include "lowering/kernel_program.h"

namespace llvm {
class LLVMContext;
class Module;
} // namespace llvm

namespace moeforge::cpu {

struct LlvmModule {
  std::unique_ptr<llvm::LLVMContext> context;
  std::unique_ptr<llvm::Module> module;
  std::vector<CpuKernel> kernels; // in program order
  LlvmModule();
  LlvmModule(LlvmModule &&) noexcept;
  LlvmModule &operator=(LlvmModule &&) noexcept;
  ~LlvmModule();
  // The module as LLVM assembly text.
  std::string ir_text() const;
};

// Throws UserError (naming the step) for what the CPU backend cannot run
// (f16 tensors, dynamic N extents or row lengths of gathers).
LlvmModule generate_llvm(const KernelProgram &program);

} // namespace moeforge::cpu
