// Compiled device code: a `Module` is a loaded cubin, a `Kernel` one of its
// __global__ functions, ready to launch on a stream.
#pragma once

#include "backends/cuda/runtime/driver.h"
#include "backends/cuda/runtime/stream.h"

#include <string>
#include <utility>
#include <vector>

namespace moeforge::cuda {

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

// What the loaded kernel needs per thread and per block, as the driver
// reports it (the same numbers ptxas printed at compile time).
struct KernelAttributes {
  int registers = 0;                // per thread
  int local_bytes = 0;              // per thread: stack frame and spills
  int static_shared_bytes = 0;      // per block, declared __shared__
  int const_bytes = 0;              // user __constant__ data
  int max_threads_per_block = 0;    // the most this kernel can launch with
  int max_dynamic_shared_bytes = 0; // the current opt-in limit
};

// A kernel of a Module; valid while the Module lives.
// Whether kernels marked launch_early() are launched so: yes, unless the
// environment sets MOEFORGE_NO_EARLY_LAUNCH (to time the difference, or to
// rule early launches out when hunting a race).
bool early_launches_enabled();

class Kernel {
public:
  Kernel() = default;
  Kernel(CUfunction function, std::string name) : function_(function), name_(std::move(name)) {}

  CUfunction handle() const { return function_; }
  const std::string &name() const { return name_; }

  // Dynamic shared memory above 48 KiB needs this opt-in before launch, up
  // to Device::max_shared_memory_optin().
  void set_max_dynamic_shared_memory(int bytes) const;
  KernelAttributes attributes() const;

  // Queues the kernel. `args` holds one pointer per kernel parameter, to a
  // host copy of its value (for a device pointer: DeviceBuffer::arg()).
  void launch(Dim3 grid, Dim3 block, unsigned shared_bytes, const Stream &stream, void **args) const;

  // Launches from now on with programmatic stream serialisation: the GPU
  // may schedule this kernel while the one before it in the stream runs.
  // Only for a kernel whose first statement is mf::wait_for_previous_grid()
  // (tiles/grid_dependency.cuh); any other would race its predecessor.
  Kernel &launch_early() {
    early_ = true;
    return *this;
  }

private:
  CUfunction function_ = nullptr;
  std::string name_;
  bool early_ = false;
};

class Module {
public:
  Module() = default;
  // Loads a cubin into the current context. `name` appears in errors.
  Module(const std::vector<char> &cubin, std::string name);
  ~Module();
  Module(Module &&other) noexcept;
  Module &operator=(Module &&other) noexcept;
  Module(const Module &) = delete;
  Module &operator=(const Module &) = delete;

  // The __global__ function named `kernel` (as compiled: use extern "C" or
  // the mangled name).
  Kernel kernel(const std::string &kernel) const;
  // The device address and size of the __device__ variable `name` (as
  // compiled: extern "C" or a plain global), e.g. a debugging buffer.
  std::pair<CUdeviceptr, size_t> global(const std::string &name) const;
  const std::string &name() const { return name_; }

private:
  CUmodule module_ = nullptr;
  std::string name_;
};

} // namespace moeforge::cuda
