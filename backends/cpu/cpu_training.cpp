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
    : compiled_(compiled), layer_(compiled.layer, tokens), seeds_uploaded_(compiled.training.seeds.size(), false) {}

void CpuTrainingLayer::upload(const TensorMap &inputs) {
  for (const TensorDecl &t : compiled_.training.program.tensors)
    if (t.is_input && !compiled_.training.is_seed(t.name)) {
      auto it = inputs.find(t.name);
      user_check(it != inputs.end()) << "no tensor given for input '" << t.name << "'";
      layer_.upload(t.name, it->second);
    }
  forward_ran_ = false;
}

void CpuTrainingLayer::upload_upstream_gradient(const std::string &output, const HostTensor &grad) {
  size_t k = compiled_.training.output_index(output, "upload_upstream_gradient");
  layer_.upload(compiled_.training.seeds[k], grad);
  seeds_uploaded_[k] = true;
}

void CpuTrainingLayer::upload_upstream_gradient(const HostTensor &grad) {
  upload_upstream_gradient(compiled_.training.output, grad);
}

void CpuTrainingLayer::poison() {
  layer_.poison();
  forward_ran_ = false;
  seeds_uploaded_.assign(seeds_uploaded_.size(), false);
}

void CpuTrainingLayer::forward() {
  layer_.run(0, compiled_.training.forward_steps);
  forward_ran_ = true;
}

void CpuTrainingLayer::backward() {
  compiled_.training.check_ready_for_backward(forward_ran_, seeds_uploaded_);
  layer_.run(compiled_.training.forward_steps, compiled_.training.program.steps.size());
}

HostTensor CpuTrainingLayer::output(const std::string &name) const {
  return layer_.download(compiled_.training.outputs[compiled_.training.output_index(name, "output()")]);
}

HostTensor CpuTrainingLayer::gradient(const std::string &name) const {
  return layer_.download(compiled_.training.gradient_of(name));
}

int64_t CpuTrainingLayer::saved_bytes() const { return moeforge::saved_bytes(compiled_.training, layer_.tokens()); }

} // namespace moeforge::cpu
