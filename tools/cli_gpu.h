// The parts of the CLI that need the CUDA backend; built only with the CUDA
// toolkit (MOEFORGE_HAVE_CUDA). cli.cpp calls them and says what is missing
// when they are not built.
#pragma once

#include <ostream>
#include <string>

#include "backends/reference/host_tensor.h"
#include "examples/examples.h"
#include "lowering/kernel_program.h"
#include "schedules/schedule.h"

namespace moeforge {

// True when a GPU is usable; otherwise `why` says what is missing.
bool cli_gpu_available(std::string *why);
// The generated CUDA C++ of a kernel program.
std::string cli_cuda_source(const KernelProgram &program);
// Compiles and runs the example on the GPU, prints routing, time and
// checksum; with `check`, compares every materialised Func with the float64
// reference. Returns 0, or 1 for a failed check.
int cli_run_on_gpu(const Example &ex, const ExampleShape &shape, const TensorMap &inputs, const Schedule &schedule,
                   bool check, std::ostream &out);

} // namespace moeforge
