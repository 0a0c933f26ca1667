// Shared by the CUDA training tests: one training step of an example on the
// GPU (forward then backward on one stream), poisoned first, every output,
// gradient and kept intermediate against the float64 reference of the
// training algebra (training_compare.h; under the schedule's capacity).
#pragma once

#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/stream.h"
#include "backends/cuda/runtime/training_layer.h"
#include "training_compare.h"

namespace moeforge::testing {

inline Outcome cuda_train_and_compare(const Example &ex, const TensorMap &inputs, int64_t tokens,
                                      const Schedule &schedule) {
  static cuda::Device device;
  cuda::CompiledTraining compiled =
      cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), schedule, device.arch_specific());
  cuda::TrainingLayer layer(device, compiled, tokens);
  return step_and_compare(ex, inputs, compiled.training.program, compiled.training.seed, layer, schedule,
                          [](cuda::TrainingLayer &l) {
                            cuda::Stream stream;
                            l.forward(stream);
                            l.backward(stream);
                            stream.synchronize();
                          });
}

} // namespace moeforge::testing
