#include "backends/cpu/jit.h"

#include <map>
#include <mutex>

#include <llvm/ExecutionEngine/Orc/ExecutionUtils.h>
#include <llvm/ExecutionEngine/Orc/JITTargetMachineBuilder.h>
#include <llvm/ExecutionEngine/Orc/LLJIT.h>
#include <llvm/ExecutionEngine/Orc/ThreadSafeModule.h>
#include <llvm/IR/LLVMContext.h>
#include <llvm/IR/Module.h>
#include <llvm/IR/Verifier.h>
#include <llvm/Passes/PassBuilder.h>
#include <llvm/Support/TargetSelect.h>
#include <llvm/Support/raw_ostream.h>
#include <llvm/Target/TargetMachine.h>

#include "dsl/error.h"

namespace moeforge::cpu {

namespace {

// LLVM reports failures as llvm::Error / Expected; ours are exceptions that
// name what was being compiled.
void check(llvm::Error err, const std::string &what, const char *doing) {
  if (err)
    throw InternalError("CPU backend, " + what + ": " + doing + " failed: " + llvm::toString(std::move(err)));
}

template <typename T> T take(llvm::Expected<T> value, const std::string &what, const char *doing) {
  if (!value)
    throw InternalError("CPU backend, " + what + ": " + doing + " failed: " + llvm::toString(value.takeError()));
  return std::move(*value);
}

void initialise_llvm() {
  static std::once_flag once;
  std::call_once(once, [] {
    llvm::InitializeNativeTarget();
    llvm::InitializeNativeTargetAsmPrinter();
  });
}

std::unique_ptr<llvm::TargetMachine> host_machine(const std::string &what) {
  initialise_llvm();
  auto jtmb = take(llvm::orc::JITTargetMachineBuilder::detectHost(), what, "detecting the host CPU");
  return take(jtmb.createTargetMachine(), what, "creating the host target machine");
}

std::string print(const llvm::Module &m) {
  std::string s;
  llvm::raw_string_ostream os(s);
  m.print(os, nullptr);
  return os.str();
}

// The process-wide cache. Deliberately never destroyed: LLVM's own static
// state may already be gone when static destructors run at exit.
struct Cache {
  std::mutex mutex;
  std::map<std::string, std::shared_ptr<const JitProgram>> programs;
};
Cache &cache() {
  static Cache *c = new Cache;
  return *c;
}

} // namespace

void optimise_module(LlvmModule &m, const std::string &what) {
  auto tm = host_machine(what);
  m.module->setDataLayout(tm->createDataLayout());
  m.module->setTargetTriple(tm->getTargetTriple().str());
  std::string msg;
  llvm::raw_string_ostream os(msg);
  if (llvm::verifyModule(*m.module, &os))
    throw InternalError("CPU backend, " + what + ": the generated module is invalid: " + os.str());
  llvm::LoopAnalysisManager lam;
  llvm::FunctionAnalysisManager fam;
  llvm::CGSCCAnalysisManager cgam;
  llvm::ModuleAnalysisManager mam;
  llvm::PassBuilder pb(tm.get());
  pb.registerModuleAnalyses(mam);
  pb.registerCGSCCAnalyses(cgam);
  pb.registerFunctionAnalyses(fam);
  pb.registerLoopAnalyses(lam);
  pb.crossRegisterProxies(lam, fam, cgam, mam);
  llvm::ModulePassManager mpm = pb.buildPerModuleDefaultPipeline(llvm::OptimizationLevel::O2);
  mpm.run(*m.module, mam);
}

std::shared_ptr<const JitProgram> jit_compile(LlvmModule m, const std::string &what) {
  std::string key = m.ir_text();
  {
    std::lock_guard<std::mutex> lock(cache().mutex);
    if (auto it = cache().programs.find(key); it != cache().programs.end())
      return it->second;
  }
  auto out = std::make_shared<JitProgram>();
  out->kernels = m.kernels;
  out->ir = key;
  optimise_module(m, what);
  out->optimised_ir = print(*m.module);

  initialise_llvm();
  auto jtmb = take(llvm::orc::JITTargetMachineBuilder::detectHost(), what, "detecting the host CPU");
  std::unique_ptr<llvm::orc::LLJIT> jit =
      take(llvm::orc::LLJITBuilder().setJITTargetMachineBuilder(std::move(jtmb)).create(), what, "creating LLJIT");
  // Generated code calls libm (tanhf, expf, logf): resolve it in this process.
  auto libs =
      take(llvm::orc::DynamicLibrarySearchGenerator::GetForCurrentProcess(jit->getDataLayout().getGlobalPrefix()), what,
           "opening the process's symbols");
  jit->getMainJITDylib().addGenerator(std::move(libs));
  check(jit->addIRModule(llvm::orc::ThreadSafeModule(std::move(m.module), std::move(m.context))), what,
        "adding the module to the JIT");
  for (const CpuKernel &k : out->kernels) {
    auto addr = take(jit->lookup(k.symbol), what + ", step " + k.step, "compiling and looking up the function");
    out->functions.push_back(addr.toPtr<StepFunction>());
  }
  out->jit = std::shared_ptr<void>(jit.release(), [](void *p) { delete static_cast<llvm::orc::LLJIT *>(p); });

  std::lock_guard<std::mutex> lock(cache().mutex);
  return cache().programs.emplace(key, std::move(out)).first->second;
}

} // namespace moeforge::cpu
