// moeforge in one include: the algebra (dsl/moeforge.h), schedules and their
// presets, the Eigen reference and host tensors, lowering, and the layer API
// of each backend whose target is linked (moeforge::cpu defines
// MOEFORGE_HAVE_CPU_BACKEND, moeforge::cuda defines MOEFORGE_HAVE_CUDA).
//
//   #include <moeforge/moeforge.h>
//   find_package(moeforge) + target_link_libraries(app moeforge::moeforge moeforge::cpu)
//
// The headers it includes are still named from the repository root ("dsl/...",
// installed under include/moeforge/), so both include/ and include/moeforge/
// are on the targets' include path; a later change prefixes them with moeforge/.
#pragma once

// The algebra: Dim, Var, Input, Param, Func, sum, the element-wise ops,
// softmax, top_k, combine, expert_sum, Pipeline, grad, the auxiliary losses.
#include "dsl/moeforge.h"
#include "dsl/training.h"

// Schedules: how a Pipeline is computed (megablocks(), scattermoe(), your own).
#include "schedules/presets.h"
#include "schedules/schedule.h"

// The Eigen reference: evaluate(pipeline, inputs), host tensors, error metrics.
#include "backends/reference/evaluate.h"
#include "runtime/tensor.h"

// Lowering: algebra + schedule -> kernel program (lower, lower_training).
#include "lowering/lower.h"
#include "lowering/training.h"

// The backends through one interface: make_backend("cpu" or "cuda") compiles
// a Layer (the forward) or a TrainingLayer, for whichever backend is linked.
#include "backends/backends.h"
#include "runtime/backend.h"

#ifdef MOEFORGE_HAVE_CPU_BACKEND
// The LLVM CPU backend's own classes: cpu::compile_cpu_layer, cpu::CpuLayer, cpu::CpuTrainingLayer.
#include "backends/cpu/cpu_layer.h"
#include "backends/cpu/cpu_training.h"
#endif

#ifdef MOEFORGE_HAVE_CUDA
// The CUDA backend's own classes (streams, caller memory, binding another
// framework's tensors): cuda::compile_layer, cuda::CudaLayer, cuda::TrainingLayer.
#include "backends/cuda/runtime/layer.h"
#include "backends/cuda/runtime/training_layer.h"
#endif
