#include "backends/cpu/cpu_training.h"

#include "dsl/error.h"

namespace moeforge::cpu {

CompiledCpuTraining compile_cpu_training(const Pipeline &forward, const std::vector<Func> &outputs,
                                         const Schedule &schedule) {
  CompiledCpuTraining c;
  c.training = lower_training(forward, outputs, schedule);
  std::string names;
  for (const std::string &o : c.training.outputs)
    names += (names.empty() ? "'" : ", '") + o + "'";
  c.layer =
      compile_cpu_program(c.training.program, "training of " + names + " under schedule '" + schedule.name() + "'");
  return c;
}

CompiledCpuTraining compile_cpu_training(const Pipeline &forward, const Func &output, const Schedule &schedule) {
  return compile_cpu_training(forward, std::vector<Func>{output}, schedule);
}

CpuTrainingLayer::CpuTrainingLayer(const CompiledCpuTraining &compiled, int64_t tokens)
    : compiled_(compiled), layer_(compiled.layer, tokens), state_(compiled.training) {}

void CpuTrainingLayer::upload(const TensorMap &inputs) {
  state_.upload_inputs(inputs, [&](const std::string &name, const HostTensor &t) { layer_.upload(name, t); });
}

void CpuTrainingLayer::upload(const std::string &name, const HostTensor &value) {
  layer_.upload(name, value);
  state_.uploaded(name);
}

void CpuTrainingLayer::upload_upstream_gradient(const std::string &output, const HostTensor &grad) {
  layer_.upload(state_.upstream_gradient_of(output), grad);
}

void CpuTrainingLayer::upload_upstream_gradient(const HostTensor &grad) {
  upload_upstream_gradient(compiled_.training.output, grad);
}

void CpuTrainingLayer::poison() {
  layer_.poison();
  state_.poisoned();
}

void CpuTrainingLayer::forward() {
  layer_.run(0, compiled_.training.forward_steps, "forward()");
  state_.forward_ran();
}

void CpuTrainingLayer::backward() {
  state_.check_ready_for_backward();
  layer_.run(compiled_.training.forward_steps, compiled_.training.program.steps.size(), "backward()");
}

std::vector<std::pair<std::string, double>> CpuTrainingLayer::profile_forward() {
  auto steps = layer_.profile(0, compiled_.training.forward_steps, "profile_forward()");
  state_.forward_ran();
  return steps;
}

std::vector<std::pair<std::string, double>> CpuTrainingLayer::profile_backward() {
  state_.check_ready_for_backward();
  return layer_.profile(compiled_.training.forward_steps, compiled_.training.program.steps.size(),
                        "profile_backward()");
}

HostTensor CpuTrainingLayer::output(const std::string &name) const {
  return layer_.download(compiled_.training.outputs[compiled_.training.output_index(name, "output()")]);
}

HostTensor CpuTrainingLayer::gradient(const std::string &name) const {
  return layer_.download(compiled_.training.gradient_of(name));
}

int64_t CpuTrainingLayer::saved_bytes() const { return moeforge::saved_bytes(compiled_.training, layer_.tokens()); }

} // namespace moeforge::cpu
