// The CUDA backend behind the backend interface (runtime/backend.h): a
// CudaLayer or TrainingLayer on a stream of its own, each call finished
// (synchronised) when it returns and timed by the GPU's events. Each layer
// holds the device, its pipeline and its compiled program. Code that needs
// what only this backend has (caller memory, binding another framework's
// tensors, graphs, streams of its own) uses cuda::CudaLayer and
// cuda::TrainingLayer directly.
#pragma once

#include <memory>

#include "runtime/backend.h"

namespace moeforge::cuda {

// Layers on GPU `ordinal`, compiled for its architecture (sm_90a on a
// Hopper). A UserError saying why where the driver or a GPU is missing
// (gpu_available's reason); CudaError where GPU `ordinal` is not there.
std::unique_ptr<Backend> make_backend(int ordinal = 0);

} // namespace moeforge::cuda
