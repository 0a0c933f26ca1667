// Training on the CPU: a layer's forward and backward compiled as one
// training program (lowering/training.h), JIT-compiled like any CPU layer
// (cpu_layer.h) and bound to host memory, with the two entry points a
// training loop calls: the API of cuda::TrainingLayer. The forward leaves
// the activations the backward needs (TrainingProgram::saved) and the
// routing tables in the layer's buffers; the backward reads them and the
// upstream gradient and writes every Input's and Param's gradient. A
// backward can run again after a new upstream gradient without a new forward.
#pragma once

#include <string>
#include <vector>

#include "backends/cpu/cpu_layer.h"
#include "lowering/training.h"

namespace moeforge::cpu {

struct CompiledCpuTraining {
  TrainingProgram training;
  CompiledCpuLayer layer; // layer.program is training.program
};

// Lowers (forward output `output` of `forward`) for training under
// `schedule`, generates LLVM IR and JIT-compiles it (cached in the process).
CompiledCpuTraining compile_cpu_training(const Pipeline &forward, const Func &output, const Schedule &schedule);

class CpuTrainingLayer {
public:
  // `compiled` must outlive the layer.
  CpuTrainingLayer(const CompiledCpuTraining &compiled, int64_t tokens);

  // Every Input and Param of the forward (the upstream gradient is separate).
  // New inputs make the saved activations stale: forward() again before the
  // next backward().
  void upload(const TensorMap &inputs);
  // The upstream gradient d(loss)/d(output), shaped like the output.
  void upload_upstream_gradient(const HostTensor &grad);
  // Fills every intermediate, output and gradient with NaN (so an element no
  // step writes shows up); the saved activations with them.
  void poison();
  // Routing, then every step the output needs.
  void forward();
  // Every gradient, from the forward's saved tensors and the upstream
  // gradient. UserError when no forward ran since the last upload or poison.
  void backward();

  HostTensor output() const { return layer_.download(compiled_.training.output); }
  // The gradient of Input or Param `name` ("x", "w1", ...); UserError naming
  // the known names otherwise.
  HostTensor gradient(const std::string &name) const;
  // Any Func the program materialises (the output, a gradient, an
  // intermediate such as d_h), in the reference's layout.
  HostTensor download(const std::string &func) const { return layer_.download(func); }
  std::vector<int32_t> routed_experts(const std::string &route) const { return layer_.routed_experts(route); }
  // Bytes the forward keeps for the backward (activations and routing tables).
  int64_t saved_bytes() const;

  const CpuLayer &layer() const { return layer_; }
  const TrainingProgram &training() const { return compiled_.training; }

private:
  const CompiledCpuTraining &compiled_;
  CpuLayer layer_;
  bool forward_ran_ = false; // since the last upload() or poison()
};

} // namespace moeforge::cpu
