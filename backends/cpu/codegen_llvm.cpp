#include "backends/cpu/codegen_llvm.h"

#include <llvm/IR/Verifier.h>
#include <llvm/Support/raw_ostream.h>

#include "backends/cpu/llvm_emit_steps.h"
#include "dsl/error.h"

namespace moeforge::cpu {

LlvmModule::LlvmModule() = default;
LlvmModule::LlvmModule(LlvmModule &&) noexcept = default;
LlvmModule &LlvmModule::operator=(LlvmModule &&) noexcept = default;
LlvmModule::~LlvmModule() {
  module.reset(); // the module refers to its context: it goes first
  context.reset();
}

std::string LlvmModule::ir_text() const {
  std::string s;
  llvm::raw_string_ostream os(s);
  module->print(os, nullptr);
  return os.str();
}

namespace {

std::string symbol_name(const std::string &step) {
  std::string out = "moeforge_";
  for (char c : step)
    out += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return out;
}

void check_dtypes(const KernelProgram &prog, const std::string &step) {
  for (const TensorDecl &t : prog.tensors)
    user_check(t.dtype != DType::f16) << "step " << step << ": tensor '" << t.name
                                      << "' is f16, which the CPU backend does not support yet; use bf16 or f32";
}

} // namespace

LlvmModule generate_llvm(const KernelProgram &program) {
  LlvmModule m;
  m.context = std::make_unique<llvm::LLVMContext>();
  m.module = std::make_unique<llvm::Module>("moeforge_" + program.schedule_name, *m.context);
  for (const Step &step : program.steps) {
    if (std::holds_alternative<RoutingStep>(step) || std::holds_alternative<AttentionStep>(step))
      continue; // routing (runtime/routing_host.h) and attention (CpuLayer::attend) run on the host
    CpuKernel k;
    k.step = step_name(step);
    k.symbol = symbol_name(k.step);
    check_dtypes(program, k.step);
    FunctionBuilder fb(program, *m.module, k);
    if (auto *g = std::get_if<GemmStep>(&step))
      emit_gemm(program, *g, fb);
    else if (auto *p = std::get_if<PointwiseStep>(&step))
      emit_pointwise(program, *p, fb);
    else if (auto *t = std::get_if<TransposeStep>(&step))
      emit_transpose(program, *t, fb);
    else
      emit_gather(program, std::get<GatherStep>(step), fb);
    fb.finish();
    std::string msg;
    llvm::raw_string_ostream os(msg);
    internal_check(!llvm::verifyFunction(*fb.function(), &os))
        << "step " << k.step << ": the generated LLVM function is invalid: " << os.str();
    m.kernels.push_back(std::move(k));
  }
  return m;
}

} // namespace moeforge::cpu
