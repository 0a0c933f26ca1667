// What every compiled backend offers: a Backend compiles an algebra and a
// schedule into a Layer (the forward) or a TrainingLayer (forward and
// backward) bound to memory for a token count, and both take and give host
// tensors in the reference's layout. The CLI, the tests and Python's generic
// layers run the CPU (LLVM JIT) and CUDA backends through this one interface,
// so a third backend is one more implementation, not one more copy of every
// caller. What only one backend has (the CUDA layer's streams, caller memory,
// binding another framework's tensors, graphs) stays on its own classes
// (cuda::CudaLayer, cuda::TrainingLayer), reached by whoever needs it.
//
// A layer keeps everything it refers to alive (its pipeline and compiled
// program), so it may outlive the Backend and the Pipeline it was made from.
// make_backend(name) (backends/backends.h) makes one by name.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dsl/pipeline.h"
#include "lowering/kernel_program.h"
#include "lowering/training.h"
#include "runtime/tensor.h"
#include "schedules/schedule.h"

namespace moeforge {

// Each step's name and milliseconds, in program order.
using StepTimes = std::vector<std::pair<std::string, double>>;

// A compiled forward bound to memory for tokens() tokens.
class Layer {
public:
  virtual ~Layer() = default;

  virtual const KernelProgram &program() const = 0;
  virtual int64_t tokens() const = 0;
  // The same compiled program bound to `tokens` tokens: no compiling, a new
  // layer with memory (and inputs) of its own.
  virtual std::unique_ptr<Layer> with_tokens(int64_t tokens) const = 0;

  // Every Input and Param (shapes checked against the declared Dims with the
  // token Dim = tokens(), values rounded to each one's dtype).
  virtual void upload(const TensorMap &inputs) = 0;
  // One Input or Param; a UserError naming it when it is not one.
  virtual void upload(const std::string &name, const HostTensor &value) = 0;
  // One Input or Param already in its storage type (encode_values or
  // encode_hashed_random of its elements): a real-size layer's weights as
  // doubles would be four times the bf16 the backend keeps.
  virtual void upload_bytes(const std::string &name, const std::vector<uint8_t> &bytes) = 0;
  // Fills every intermediate and output with NaN, so an element no step
  // writes shows up in any comparison.
  virtual void poison() = 0;
  // The whole forward, finished when it returns; its milliseconds by the
  // backend's own clock (the GPU's events: no host overhead counted).
  virtual double run() = 0;
  // The forward once more with every step timed.
  virtual StepTimes profile() = 0;
  // A Func's values as the reference lays them out (routed rows in pair
  // order, whatever the backend's layout). A UserError for a name the layer
  // does not hold.
  virtual HostTensor download(const std::string &func) const = 0;
  // The experts the last run chose, pair order (r = t * k + slot).
  virtual std::vector<int32_t> routed_experts(const std::string &route) const = 0;
  // The pairs the route dropped at its expert capacity in the last run (0
  // when dropless), and kept[r] = 0 for each of them.
  virtual int64_t dropped_pairs(const std::string &route) const = 0;
  virtual std::vector<uint8_t> kept_pairs(const std::string &route) const = 0;
};

// A compiled training step (lowering/training.h) bound to memory for
// tokens() tokens: forward() keeps what backward() reads; backward() writes
// every Input's and Param's gradient from the upstream gradients.
class TrainingLayer {
public:
  virtual ~TrainingLayer() = default;

  virtual const TrainingProgram &training() const = 0;
  virtual int64_t tokens() const = 0;
  // The same compiled program bound to `tokens` tokens: no compiling, a new
  // layer with memory (and inputs) of its own.
  virtual std::unique_ptr<TrainingLayer> with_tokens(int64_t tokens) const = 0;

  // Every Input and Param of the forward (the upstream gradients apart).
  // New inputs make the saved activations stale: forward() again before the
  // next backward().
  virtual void upload(const TensorMap &inputs) = 0;
  virtual void upload(const std::string &name, const HostTensor &value) = 0;
  // d(loss)/d(output) of forward output `output` ("y", "lb_loss", ...),
  // shaped like it; a UserError naming the outputs for an unknown one.
  virtual void upload_upstream_gradient(const std::string &output, const HostTensor &grad) = 0;
  // The first output's (the layer's own, "y").
  void upload_upstream_gradient(const HostTensor &grad) { upload_upstream_gradient(training().output, grad); }
  // NaN in every intermediate, output and gradient; every upstream gradient
  // must be uploaded again before the next backward().
  virtual void poison() = 0;
  // Each finished when it returns; its milliseconds by the backend's clock.
  // backward() is a UserError without a forward() since the last upload or
  // poison, or without every output's upstream gradient.
  virtual double forward() = 0;
  virtual double backward() = 0;
  virtual StepTimes profile_forward() = 0;
  virtual StepTimes profile_backward() = 0;

  // A forward output by name (the first: training().output).
  virtual HostTensor output(const std::string &name) const = 0;
  HostTensor output() const { return output(training().output); }
  // The gradient of Input or Param `name` ("x", "w1", ...).
  virtual HostTensor gradient(const std::string &name) const = 0;
  // Any Func the program materialises, in the reference's layout.
  virtual HostTensor download(const std::string &func) const = 0;
  virtual std::vector<int32_t> routed_experts(const std::string &route) const = 0;
  virtual int64_t dropped_pairs(const std::string &route) const = 0;
  virtual std::vector<uint8_t> kept_pairs(const std::string &route) const = 0;
  // Bytes the forward keeps for the backward (activations, routing tables).
  virtual int64_t saved_bytes() const = 0;
};

// Compiles layers for one kind of machine.
class Backend {
public:
  virtual ~Backend() = default;
  // "cpu" or "cuda": what make_backend takes.
  virtual std::string name() const = 0;
  // What runs it, for people: "cpu (LLVM JIT, 16 threads)", "cuda on NVIDIA
  // H200 (sm_90a)".
  virtual std::string description() const = 0;
  // Lowers, generates and compiles (cached within the process where the
  // backend caches), then binds the result to `tokens` tokens.
  virtual std::unique_ptr<Layer> layer(const Pipeline &pipeline, const Schedule &schedule, int64_t tokens) = 0;
  // The training step of forward outputs `outputs` (the layer's own first,
  // then any auxiliary losses).
  virtual std::unique_ptr<TrainingLayer> training_layer(const Pipeline &pipeline, const std::vector<Func> &outputs,
                                                        const Schedule &schedule, int64_t tokens) = 0;
};

} // namespace moeforge
