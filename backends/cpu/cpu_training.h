// Training on the CPU: a layer's forward and backward compiled as one
// training program (lowering/training.h), JIT-compiled like any CPU layer
// (cpu_layer.h) and bound to host memory, with the two entry points a
// training loop calls: the API of cuda::TrainingLayer. The forward leaves
// the activations the backward needs (TrainingProgram::saved) and the
// routing tables in the layer's buffers; the backward reads them and the
// upstream gradients (one per output: the layer's and, with auxiliary losses,
// each loss's) and writes every Input's and Param's gradient. A backward can
// run again after a new upstream gradient without a new forward.
#pragma once

#include <string>
#include <vector>

#include "backends/cpu/cpu_layer.h"
#include "lowering/training.h"
#include "runtime/forwards_in_flight.h"
#include "runtime/training_state.h"

namespace moeforge::cpu {

struct CompiledCpuTraining {
  TrainingProgram training;
  CompiledCpuLayer layer; // layer.program is training.program
};

// Lowers (forward outputs `outputs` of `forward`) for training under
// `schedule`, generates LLVM IR and JIT-compiles it (cached in the process).
CompiledCpuTraining compile_cpu_training(const Pipeline &forward, const std::vector<Func> &outputs,
                                         const Schedule &schedule);
// One output: compile_cpu_training(forward, {output}, schedule).
CompiledCpuTraining compile_cpu_training(const Pipeline &forward, const Func &output, const Schedule &schedule);

class CpuTrainingLayer {
public:
  // `compiled` must outlive the layer.
  CpuTrainingLayer(const CompiledCpuTraining &compiled, int64_t tokens, LayerMemory memory = LayerMemory::owned);

  // Every Input and Param of the forward (the upstream gradient is separate).
  // New inputs make the saved activations stale: forward() again before the
  // next backward().
  void upload(const TensorMap &inputs);
  // One of them, the others as they were (cuda::TrainingLayer's upload).
  void upload(const std::string &name, const HostTensor &value);
  // The upstream gradient d(loss)/d(output) of forward output `output`
  // ("y", "lb_loss", ...), shaped like it (a 0-D loss: a 0-D tensor, usually
  // HostTensor({}, 1.0)). UserError naming the outputs for an unknown one.
  void upload_upstream_gradient(const std::string &output, const HostTensor &grad);
  // The first output's (the layer's own, "y").
  void upload_upstream_gradient(const HostTensor &grad);
  // Fills every intermediate, output and gradient with NaN (so an element no
  // step writes shows up); the saved activations with them. Every upstream
  // gradient must be uploaded again before the next backward().
  void poison();
  // Routing, then every step the outputs need.
  void forward();
  // Every gradient, from the forward's saved tensors and the upstream
  // gradients. UserError when no forward ran since the last upload or
  // poison, or when an output's upstream gradient was not uploaded since the
  // last poison (or ever).
  void backward();

  // LayerMemory::caller (cuda::TrainingLayer's calls). What a step at
  // `tokens` needs; the token count of the next forward or backward.
  StepMemory step_memory(int64_t tokens) const { return layer_.step_memory(tokens); }
  std::optional<std::vector<SizeTerms>> saved_terms() const { return layer_.saved_terms(); }
  void set_tokens(int64_t tokens) { layer_.set_tokens(tokens); }
  // Host memory the caller owns for an Input, Param, upstream gradient (by
  // its seed's name, "d_y") or output; for the gradient of Input or Param
  // `of`. Sizes as info() says.
  void bind(const std::string &name, void *ptr, size_t bytes);
  void bind_gradient(const std::string &of, void *ptr, size_t bytes);
  TensorInfo info(const std::string &name) const { return layer_.info(name); }
  // A forward whose activations and routing go to `saved` and a backward
  // that reads them there: the same saved memory, at the same token count,
  // with this layer's inputs and parameters as they were then (bound again
  // by the caller). A backward is refused for saved memory no recent forward
  // of this count wrote, and for a second backward of one forward where the
  // first wrote over what it saved (runtime/forwards_in_flight.h).
  // `saved`: the host addresses of step_memory().saved's parts.
  void forward(const SavedParts &saved, uint8_t *workspace);
  void backward(const SavedParts &saved, uint8_t *workspace);

  // forward() / backward() with each step timed: name and milliseconds, in
  // program order (cuda::TrainingLayer's profile_forward / profile_backward).
  std::vector<std::pair<std::string, double>> profile_forward();
  std::vector<std::pair<std::string, double>> profile_backward();

  // The first forward output ("y"), or the one named (UserError naming the
  // outputs for an unknown one).
  HostTensor output() const { return layer_.download(compiled_.training.output); }
  HostTensor output(const std::string &name) const;
  // The gradient of Input or Param `name` ("x", "w1", ...); UserError naming
  // the known names otherwise.
  HostTensor gradient(const std::string &name) const;
  // Any Func the program materialises (the output, a gradient, an
  // intermediate such as d_h), in the reference's layout.
  // On caller memory, a saved tensor a backward wrote a gradient over
  // (written_over_saved) is refused once that backward ran.
  HostTensor download(const std::string &func) const;
  std::vector<int32_t> routed_experts(const std::string &route) const { return layer_.routed_experts(route); }
  int64_t dropped_pairs(const std::string &route) const { return layer_.dropped_pairs(route); }
  std::vector<uint8_t> kept_pairs(const std::string &route) const { return layer_.kept_pairs(route); }
  // Bytes the forward keeps for the backward (activations and routing tables).
  int64_t saved_bytes() const;

  const CpuLayer &layer() const { return layer_; }
  const TrainingProgram &training() const { return compiled_.training; }

private:
  void check_memory(bool caller, const char *call) const;

  const CompiledCpuTraining &compiled_;
  CpuLayer layer_;
  TrainingState state_;
  ForwardsInFlight forwards_;
};

} // namespace moeforge::cpu
