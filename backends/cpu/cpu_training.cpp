#include "backends/cpu/cpu_training.h"

#include "dsl/error.h"

namespace moeforge::cpu {

CompiledCpuTraining compile_cpu_training(const Pipeline &forward, const Func &output, const Schedule &schedule) {
  CompiledCpuTraining c;
  c.training = lower_training(forward, output, schedule);
  c.layer = compile_cpu_program(c.training.program,
                                "training of '" + output.name() + "' under schedule '" + schedule.name() + "'");
  return c;
}

CpuTrainingLayer::CpuTrainingLayer(const CompiledCpuTraining &compiled, int64_t tokens)
    : compiled_(compiled), layer_(compiled.layer, tokens) {}

void CpuTrainingLayer::upload(const TensorMap &inputs) {
  for (const TensorDecl &t : compiled_.training.program.tensors)
    if (t.is_input && t.name != compiled_.training.seed) {
      auto it = inputs.find(t.name);
      user_check(it != inputs.end()) << "no tensor given for input '" << t.name << "'";
      layer_.upload(t.name, it->second);
    }
  forward_ran_ = false;
}

void CpuTrainingLayer::upload_upstream_gradient(const HostTensor &grad) {
  layer_.upload(compiled_.training.seed, grad);
}

void CpuTrainingLayer::poison() {
  layer_.poison();
  forward_ran_ = false;
}

void CpuTrainingLayer::forward() {
  layer_.run(0, compiled_.training.forward_steps);
  forward_ran_ = true;
}

void CpuTrainingLayer::backward() {
  user_check(forward_ran_) << "backward() before forward(): the backward reads the activations the forward keeps "
                           << "for it; run forward() first (again after upload() of new inputs or poison())";
  layer_.run(compiled_.training.forward_steps, compiled_.training.program.steps.size());
}

HostTensor CpuTrainingLayer::gradient(const std::string &name) const {
  const TrainingProgram &t = compiled_.training;
  for (size_t i = 0; i < t.of.size(); ++i)
    if (t.of[i] == name)
      return layer_.download(t.gradients[i]);
  std::string known;
  for (const std::string &o : t.of)
    known += (known.empty() ? "" : ", ") + o;
  user_error << "no gradient for '" << name << "': the layer's output depends on " << known;
}

int64_t CpuTrainingLayer::saved_bytes() const { return moeforge::saved_bytes(compiled_.training, layer_.tokens()); }

} // namespace moeforge::cpu
