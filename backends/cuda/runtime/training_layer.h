// Training on the GPU: a layer's forward and backward compiled as one
// training program (lowering/training.h) and bound to device memory, with
// the two entry points a training loop calls. The forward leaves the
// activations the backward needs in the layer's buffers; the backward reads
// them and the upstream gradients (one per output: the layer's and, with
// auxiliary losses, each loss's) and writes every Input's and Param's
// gradient. Neither synchronises with the host, so both can be captured in a
// CUDA graph.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/runtime/graph_replay.h"
#include "backends/cuda/runtime/layer.h"
#include "backends/cuda/runtime/stream.h"
#include "lowering/training.h"
#include "runtime/forwards_in_flight.h"
#include "runtime/training_state.h"

namespace moeforge::cuda {

struct CompiledTraining {
  TrainingProgram training;
  CompiledLayer layer; // layer.program is training.program
};

// Lowers (forward outputs `outputs` of `forward`) for training under
// `schedule`, generates and compiles it. Works without a GPU.
CompiledTraining compile_training(const Pipeline &forward, const std::vector<Func> &outputs, const Schedule &schedule,
                                  const std::string &arch = "sm_90a");
// One output: compile_training(forward, {output}, schedule, arch).
CompiledTraining compile_training(const Pipeline &forward, const Func &output, const Schedule &schedule,
                                  const std::string &arch = "sm_90a");

class TrainingLayer {
public:
  // `compiled` must outlive the layer. With LayerMemory::caller the layer
  // holds no memory: each forward is given the memory for what it saves
  // and a workspace, and its backward the same saved memory and a
  // workspace of its own (forward(stream, saved, workspace) below), so any
  // number of forwards may be in flight, each with its own activations.
  TrainingLayer(const Device &device, const CompiledTraining &compiled, int64_t tokens,
                LayerMemory memory = LayerMemory::owned);

  // Every Input and Param of the forward (the upstream gradient is separate).
  void upload(const TensorMap &inputs);
  // One of them, the others as they were (the autotuner's skewed routing:
  // the router's inputs changed, the weights shared).
  void upload(const std::string &name, const HostTensor &value);
  // Fills an Input or Param (or an upstream gradient, by its seed's name
  // "d_y") with `pattern` repeated (benchmarks: realistic values without
  // gigabytes of host random numbers).
  void upload_repeated(const std::string &name, const HostTensor &pattern);
  // The upstream gradient d(loss)/d(output) of forward output `output`
  // ("y", "lb_loss", ...), shaped like it (a 0-D loss: a 0-D tensor, usually
  // HostTensor({}, 1.0)). UserError naming the outputs for an unknown one.
  void upload_upstream_gradient(const std::string &output, const HostTensor &grad);
  // The first output's (the layer's own, "y").
  void upload_upstream_gradient(const HostTensor &grad);
  // Every upstream gradient must be uploaded again before the next backward().
  void poison();
  // Device-to-device copies for another framework's tensors (CudaLayer's
  // copy_in / copy_out: on `stream`, no host synchronisation). copy_in takes
  // a forward Input or Param, or an upstream gradient by its seed's name
  // ("d_y"); copy_gradient the gradient of Input or Param `of` ("w1").
  void copy_in(const std::string &name, CUdeviceptr src, size_t bytes, const Stream &stream);
  void copy_out(const std::string &name, CUdeviceptr dst, size_t bytes, const Stream &stream) const {
    layer_.copy_out(name, dst, bytes, stream);
  }
  void copy_gradient(const std::string &of, CUdeviceptr dst, size_t bytes, const Stream &stream) const;
  // CudaLayer::bind, for a forward Input or Param, an upstream gradient (by
  // its seed's name), an output, or the gradient of Input or Param `of`.
  void bind(const std::string &name, CUdeviceptr ptr, size_t bytes);
  void bind_gradient(const std::string &of, CUdeviceptr ptr, size_t bytes) {
    layer_.bind(compiled_.training.gradient_of(of), ptr, bytes);
  }
  CudaLayer::TensorInfo info(const std::string &name) const { return layer_.info(name); }
  const TrainingProgram &training() const { return compiled_.training; }
  void forward(const Stream &stream);
  // UserError unless forward() was enqueued since the last upload() or
  // poison() (the backward reads what the forward keeps for it) and every
  // output's upstream gradient was uploaded since the last poison().
  void backward(const Stream &stream);

  // LayerMemory::caller. The token count of the next forward or backward
  // (CudaLayer::set_tokens: any count, no compiling, no memory); what a
  // step at `tokens` needs (saved: kept from a forward to the end of its
  // backward; workspace_before / _after: the forward's and the backward's,
  // only while each runs).
  void set_tokens(int64_t tokens) { layer_.set_tokens(tokens); }
  CudaLayer::StepMemory step_memory(int64_t tokens) const { return layer_.step_memory(tokens); }
  std::optional<std::vector<SizeTerms>> saved_terms() const { return layer_.saved_terms(); }
  // A forward whose activations go to `saved` (step_memory().saved's parts),
  // and a backward that reads them there: the same saved memory, the same token count, and this
  // layer's inputs and parameters as they were then (bound again, with
  // every output and gradient, by the caller). A backward is refused for
  // saved memory that no forward of this count wrote lately (one of the
  // last kRecentForwards), and for saved memory whose backward ran already
  // where that backward writes over it (TrainingProgram::
  // written_over_saved, the default schedule's gradients_over_saved).
  void forward(const Stream &stream, const SavedParts &saved, CUdeviceptr workspace);
  void backward(const Stream &stream, const SavedParts &saved, CUdeviceptr workspace);
  // A routing score that was NaN or infinite in work queued before
  // (CudaLayer::check_routing_scores): forward() and backward() check
  // before they queue anything; a synchronous caller again after its wait.
  void check_routing_scores(const Stream &stream, const std::string &call) {
    layer_.check_routing_scores(stream, call);
  }
  static constexpr size_t kRecentForwards = ForwardsInFlight::kRecent;
  // Replays the forward and the backward each as one CUDA graph instead of
  // one launch per kernel (GraphReplay: the first call at new addresses
  // runs eagerly, the second captures, later ones replay; eagerly inside
  // someone else's capture). Off by default.
  void replay_graphs(bool on) { replay_on_ = on; }
  using GraphCounts = GraphReplay::Counts;
  GraphCounts graph_counts() const { return replay_.counts(); }
  // Per-step times of the forward or the backward (for benchmarks' notes).
  std::vector<std::pair<std::string, double>> profile_forward(const Stream &stream);
  std::vector<std::pair<std::string, double>> profile_backward(const Stream &stream);
  // A timeline build's tile phases of every GEMM, forward and backward
  // (CudaLayer::timeline); empty otherwise.
  std::vector<std::string> timeline(const Stream &stream) { return layer_.timeline(stream); }

  // The first forward output ("y"), or the one named (UserError naming the
  // outputs for an unknown one). Synchronises.
  HostTensor output() const { return layer_.download(compiled_.training.output); }
  HostTensor output(const std::string &name) const;
  // The gradient of Input or Param `name` ("x", "w1", ...). Synchronises.
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

  const CudaLayer &layer() const { return layer_; }

private:
  void check_memory(bool caller, const char *call) const;

  const CompiledTraining &compiled_;
  CudaLayer layer_;
  // LayerMemory::caller: which saved memory a backward may be given.
  ForwardsInFlight forwards_;
  TrainingState state_;
  bool replay_on_ = false;
  GraphReplay replay_;
};

} // namespace moeforge::cuda
