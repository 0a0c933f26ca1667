#include "backends/cpu/cpu_backend.h"

#include <chrono>

#include "backends/cpu/cpu_layer.h"
#include "backends/cpu/cpu_training.h"
#include "runtime/forwarding_layers.h"

namespace moeforge::cpu {

namespace {

using Clock = std::chrono::steady_clock;

template <typename F> double timed_ms(F &&f) {
  const Clock::time_point start = Clock::now();
  f();
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// The compiled forward with the pipeline whose nodes its program points at.
struct ForwardProgram {
  Pipeline pipeline;
  CompiledCpuLayer compiled;
  ForwardProgram(const Pipeline &p, const Schedule &s) : pipeline(p), compiled(compile_cpu_layer(pipeline, s)) {}
};

class BoundLayer final : public ForwardingLayer<CpuLayer> {
public:
  BoundLayer(std::shared_ptr<const ForwardProgram> program, int64_t tokens)
      : program_(std::move(program)), layer_(program_->compiled, tokens) {}

  const KernelProgram &program() const override { return program_->compiled.program; }
  std::unique_ptr<Layer> with_tokens(int64_t tokens) const override {
    return std::make_unique<BoundLayer>(program_, tokens);
  }
  double run() override {
    return timed_ms([&] { layer_.run(); });
  }
  StepTimes profile() override { return layer_.profile(0, program().steps.size()); }

private:
  CpuLayer &inner() override { return layer_; }
  const CpuLayer &inner() const override { return layer_; }
  std::shared_ptr<const ForwardProgram> program_;
  CpuLayer layer_;
};

struct TrainingStep {
  Pipeline pipeline;
  CompiledCpuTraining compiled;
  TrainingStep(const Pipeline &p, const std::vector<Func> &outputs, const Schedule &s)
      : pipeline(p), compiled(compile_cpu_training(pipeline, outputs, s)) {}
};

class BoundTraining final : public ForwardingTrainingLayer<CpuTrainingLayer> {
public:
  BoundTraining(std::shared_ptr<const TrainingStep> step, int64_t tokens)
      : step_(std::move(step)), layer_(step_->compiled, tokens) {}

  const TrainingProgram &training() const override { return step_->compiled.training; }
  std::unique_ptr<TrainingLayer> with_tokens(int64_t tokens) const override {
    return std::make_unique<BoundTraining>(step_, tokens);
  }
  double forward() override {
    return timed_ms([&] { layer_.forward(); });
  }
  double backward() override {
    return timed_ms([&] { layer_.backward(); });
  }
  StepTimes profile_forward() override { return layer_.profile_forward(); }
  StepTimes profile_backward() override { return layer_.profile_backward(); }

private:
  CpuTrainingLayer &inner() override { return layer_; }
  const CpuTrainingLayer &inner() const override { return layer_; }
  std::shared_ptr<const TrainingStep> step_;
  CpuTrainingLayer layer_;
};

class CpuBackend final : public Backend {
public:
  std::string name() const override { return "cpu"; }
  std::string description() const override {
    const int64_t n = cpu_threads();
    return "cpu (LLVM JIT, " + std::to_string(n) + (n == 1 ? " thread)" : " threads)");
  }
  std::unique_ptr<Layer> layer(const Pipeline &pipeline, const Schedule &schedule, int64_t tokens) override {
    return std::make_unique<BoundLayer>(std::make_shared<const ForwardProgram>(pipeline, schedule), tokens);
  }
  std::unique_ptr<TrainingLayer> training_layer(const Pipeline &pipeline, const std::vector<Func> &outputs,
                                                const Schedule &schedule, int64_t tokens) override {
    return std::make_unique<BoundTraining>(std::make_shared<const TrainingStep>(pipeline, outputs, schedule), tokens);
  }
};

} // namespace

std::unique_ptr<Backend> make_backend() { return std::make_unique<CpuBackend>(); }

} // namespace moeforge::cpu
