#include "backends/cuda/runtime/module.h"

#include "dsl/error.h"

#include <cstdlib>
#include <utility>

namespace moeforge::cuda {

namespace {
// Runs a driver call and, on failure, adds which kernel or module it was about.
void check_about(CUresult result, const char *call, const std::string &about) {
  try {
    check_driver(result, call);
  } catch (const CudaError &e) {
    throw CudaError(std::string(e.what()) + " [" + about + "]", e.code());
  }
}
} // namespace

void Kernel::set_max_dynamic_shared_memory(int bytes) const {
  check_about(driver().cuFuncSetAttribute(function_, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes),
              "cuFuncSetAttribute", "kernel '" + name_ + "', max dynamic shared memory " + std::to_string(bytes));
}

KernelAttributes Kernel::attributes() const {
  auto get = [&](CUfunction_attribute which) {
    int value = 0;
    check_about(driver().cuFuncGetAttribute(&value, which, function_), "cuFuncGetAttribute", "kernel '" + name_ + "'");
    return value;
  };
  KernelAttributes a;
  a.registers = get(CU_FUNC_ATTRIBUTE_NUM_REGS);
  a.local_bytes = get(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES);
  a.static_shared_bytes = get(CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES);
  a.const_bytes = get(CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES);
  a.max_threads_per_block = get(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK);
  a.max_dynamic_shared_bytes = get(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES);
  return a;
}

bool early_launches_enabled() {
  static const bool on = std::getenv("MOEFORGE_NO_EARLY_LAUNCH") == nullptr;
  return on;
}

void Kernel::launch(Dim3 grid, Dim3 block, unsigned shared_bytes, const Stream &stream, void **args) const {
  // An empty grid is a caller's bug the driver would only call "invalid value".
  internal_check(grid.x && grid.y && grid.z && block.x && block.y && block.z)
      << "kernel '" << name_ << "' launched with an empty grid or block (" << grid.x << "x" << grid.y << "x" << grid.z
      << ", " << block.x << "x" << block.y << "x" << block.z << ")";
  auto about = [&] {
    return "kernel '" + name_ + "', grid " + std::to_string(grid.x) + "x" + std::to_string(grid.y) + "x" +
           std::to_string(grid.z) + ", block " + std::to_string(block.x) + "x" + std::to_string(block.y) + "x" +
           std::to_string(block.z) + ", " + std::to_string(shared_bytes) + " bytes dynamic shared memory";
  };
  if (!early_ || !early_launches_enabled()) {
    check_about(driver().cuLaunchKernel(function_, grid.x, grid.y, grid.z, block.x, block.y, block.z, shared_bytes,
                                        stream.handle(), args, nullptr),
                "cuLaunchKernel", about());
    return;
  }
  CUlaunchAttribute early{};
  early.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  early.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig config{};
  config.gridDimX = grid.x;
  config.gridDimY = grid.y;
  config.gridDimZ = grid.z;
  config.blockDimX = block.x;
  config.blockDimY = block.y;
  config.blockDimZ = block.z;
  config.sharedMemBytes = shared_bytes;
  config.hStream = stream.handle();
  config.attrs = &early;
  config.numAttrs = 1;
  check_about(driver().cuLaunchKernelEx(&config, function_, args, nullptr), "cuLaunchKernelEx",
              about() + ", launched early (programmatic stream serialisation)");
}

Module::Module(const std::vector<char> &cubin, std::string name) : name_(std::move(name)) {
  check_about(driver().cuModuleLoadData(&module_, cubin.data()), "cuModuleLoadData", "module '" + name_ + "'");
}

Module::~Module() {
  if (module_)
    driver().cuModuleUnload(module_);
}

Module::Module(Module &&other) noexcept
    : module_(std::exchange(other.module_, nullptr)), name_(std::move(other.name_)) {}

Module &Module::operator=(Module &&other) noexcept {
  std::swap(module_, other.module_);
  std::swap(name_, other.name_);
  return *this;
}

Kernel Module::kernel(const std::string &kernel) const {
  internal_check(module_ != nullptr) << "kernel '" << kernel << "' asked of an unloaded module";
  CUfunction f = nullptr;
  check_about(driver().cuModuleGetFunction(&f, module_, kernel.c_str()), "cuModuleGetFunction",
              "kernel '" + kernel + "' in module '" + name_ + "'");
  return Kernel(f, kernel);
}

std::pair<CUdeviceptr, size_t> Module::global(const std::string &name) const {
  internal_check(module_ != nullptr) << "global '" << name << "' asked of an unloaded module";
  CUdeviceptr ptr = 0;
  size_t bytes = 0;
  check_about(driver().cuModuleGetGlobal(&ptr, &bytes, module_, name.c_str()), "cuModuleGetGlobal",
              "global '" + name + "' in module '" + name_ + "'");
  return {ptr, bytes};
}

} // namespace moeforge::cuda
