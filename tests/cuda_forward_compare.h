// Shared by the CUDA forward tests: a layer compiled and run on the GPU,
// outputs poisoned first, against the float64 reference.
#pragma once

#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/layer.h"
#include "backends/cuda/runtime/stream.h"
#include "layer_compare.h"

namespace moeforge::testing {

// Compiles and runs ex on the GPU (optionally through a captured CUDA graph,
// poisoned again between two replays) and compares it with the reference
// under the schedule's capacity.
inline Outcome cuda_forward_and_compare(const Example &ex, const TensorMap &inputs, int64_t tokens,
                                        const Schedule &schedule, bool use_graph = false) {
  static cuda::Device device;
  cuda::CompiledLayer compiled = cuda::compile_layer(ex.pipeline, schedule, device.arch_specific());
  cuda::CudaLayer layer(device, compiled, tokens);
  layer.upload(inputs);
  layer.poison();
  cuda::Stream stream;
  if (use_graph) {
    cuda::CudaGraph g = cuda::CudaGraph::capture(stream, [&] { layer.enqueue(stream); });
    g.launch(stream);
    stream.synchronize();
    layer.poison(); // a replay must rewrite everything by itself
    g.launch(stream);
  } else {
    layer.enqueue(stream);
  }
  stream.synchronize();
  return compare_with_reference(ex, inputs, compiled.program, layer, schedule.to_text(), 2e-2,
                                /*floor_fraction=*/0, schedule.capacity());
}

} // namespace moeforge::testing
