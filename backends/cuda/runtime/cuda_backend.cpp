#include "backends/cuda/runtime/cuda_backend.h"

#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/driver.h"
#include "backends/cuda/runtime/layer.h"
#include "backends/cuda/runtime/stream.h"
#include "backends/cuda/runtime/training_layer.h"
#include "dsl/error.h"
#include "runtime/forwarding_layers.h"

namespace moeforge::cuda {

namespace {

// Enqueues `work` on `stream` between two events and waits for it: the
// milliseconds the GPU spent, not the host's launch overhead.
template <typename F> double timed_ms(const Stream &stream, F &&work) {
  Event start, stop;
  start.record(stream);
  work();
  stop.record(stream);
  stop.synchronize();
  return elapsed_ms(start, stop);
}

// The compiled forward with the pipeline whose nodes its program points at.
struct ForwardProgram {
  Pipeline pipeline;
  CompiledLayer compiled;
  ForwardProgram(const Pipeline &p, const Schedule &s, const std::string &arch)
      : pipeline(p), compiled(compile_layer(pipeline, s, arch)) {}
};

class BoundLayer final : public ForwardingLayer<CudaLayer> {
public:
  BoundLayer(std::shared_ptr<const Device> device, std::shared_ptr<const ForwardProgram> program, int64_t tokens)
      : device_(std::move(device)), program_(std::move(program)), layer_(*device_, program_->compiled, tokens) {}

  const KernelProgram &program() const override { return program_->compiled.program; }
  std::unique_ptr<moeforge::Layer> with_tokens(int64_t tokens) const override {
    return std::make_unique<BoundLayer>(device_, program_, tokens);
  }
  double run() override {
    const double ms = timed_ms(stream_, [&] { layer_.enqueue(stream_, 0, program().steps.size(), "run()"); });
    layer_.check_routing_scores(stream_, "run()");
    return ms;
  }
  StepTimes profile() override { return layer_.profile(stream_); }

private:
  CudaLayer &inner() override { return layer_; }
  const CudaLayer &inner() const override { return layer_; }
  // Declared first, destroyed last: the layer's memory lives in the
  // device's context.
  std::shared_ptr<const Device> device_;
  std::shared_ptr<const ForwardProgram> program_;
  Stream stream_;
  CudaLayer layer_;
};

struct TrainingStep {
  Pipeline pipeline;
  CompiledTraining compiled;
  TrainingStep(const Pipeline &p, const std::vector<Func> &outputs, const Schedule &s, const std::string &arch)
      : pipeline(p), compiled(compile_training(pipeline, outputs, s, arch)) {}
};

class BoundTraining final : public ForwardingTrainingLayer<cuda::TrainingLayer> {
public:
  BoundTraining(std::shared_ptr<const Device> device, std::shared_ptr<const TrainingStep> step, int64_t tokens)
      : device_(std::move(device)), step_(std::move(step)), layer_(*device_, step_->compiled, tokens) {}

  const TrainingProgram &training() const override { return step_->compiled.training; }
  std::unique_ptr<TrainingLayer> with_tokens(int64_t tokens) const override {
    return std::make_unique<BoundTraining>(device_, step_, tokens);
  }
  double forward() override {
    const double ms = timed_ms(stream_, [&] { layer_.forward(stream_); });
    layer_.check_routing_scores(stream_, "forward()");
    return ms;
  }
  double backward() override {
    return timed_ms(stream_, [&] { layer_.backward(stream_); });
  }
  StepTimes profile_forward() override { return layer_.profile_forward(stream_); }
  StepTimes profile_backward() override { return layer_.profile_backward(stream_); }

private:
  cuda::TrainingLayer &inner() override { return layer_; }
  const cuda::TrainingLayer &inner() const override { return layer_; }
  std::shared_ptr<const Device> device_; // first: destroyed after the layer's memory
  std::shared_ptr<const TrainingStep> step_;
  Stream stream_;
  cuda::TrainingLayer layer_;
};

class CudaBackend final : public Backend {
public:
  explicit CudaBackend(int ordinal) : device_(std::make_shared<const Device>(ordinal)) {}
  std::string name() const override { return "cuda"; }
  std::string description() const override {
    return "cuda on " + device_->name() + " (" + device_->arch_specific() + ")";
  }
  std::unique_ptr<moeforge::Layer> layer(const Pipeline &pipeline, const Schedule &schedule, int64_t tokens) override {
    return std::make_unique<BoundLayer>(
        device_, std::make_shared<const ForwardProgram>(pipeline, schedule, device_->arch_specific()), tokens);
  }
  std::unique_ptr<moeforge::TrainingLayer> training_layer(const Pipeline &pipeline, const std::vector<Func> &outputs,
                                                          const Schedule &schedule, int64_t tokens) override {
    return std::make_unique<BoundTraining>(
        device_, std::make_shared<const TrainingStep>(pipeline, outputs, schedule, device_->arch_specific()), tokens);
  }

private:
  std::shared_ptr<const Device> device_;
};

} // namespace

std::unique_ptr<Backend> make_backend(int ordinal) {
  std::string why;
  user_check(gpu_available(&why)) << "the cuda backend needs a GPU: " << why << "; the cpu backend runs anywhere";
  return std::make_unique<CudaBackend>(ordinal);
}

} // namespace moeforge::cuda
