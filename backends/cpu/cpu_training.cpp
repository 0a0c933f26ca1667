#include "backends/cpu/cpu_training.h"

#include <algorithm>
#include <cstdint>

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

CpuTrainingLayer::CpuTrainingLayer(const CompiledCpuTraining &compiled, int64_t tokens, LayerMemory memory)
    : compiled_(compiled), layer_(compiled.layer, tokens, compiled.training.forward_steps, memory),
      state_(compiled.training) {}

void CpuTrainingLayer::check_memory(bool caller, const char *call) const {
  if (caller)
    user_check(layer_.memory() == LayerMemory::caller)
        << call << "(saved, workspace): this layer holds memory of its own; call " << call << "()";
  else
    user_check(layer_.memory() == LayerMemory::owned)
        << call << "(): this layer runs on caller memory; call " << call << "(saved, workspace)";
}

void CpuTrainingLayer::bind(const std::string &name, void *ptr, size_t bytes) {
  layer_.bind(name, ptr, bytes);
  if (const TensorDecl *t = compiled_.training.program.find(name); t && t->is_input)
    state_.uploaded(name); // new values: a seed counts as given, an input needs a new forward
}

void CpuTrainingLayer::bind_gradient(const std::string &of, void *ptr, size_t bytes) {
  layer_.bind(compiled_.training.gradient_of(of), ptr, bytes);
}

void CpuTrainingLayer::forward(const SavedParts &saved, uint8_t *workspace) {
  check_memory(true, "forward");
  layer_.place(saved, workspace);
  layer_.run(0, compiled_.training.forward_steps, "forward()");
  forwards_.forward_wrote(saved, layer_.tokens());
}

void CpuTrainingLayer::backward(const SavedParts &saved, uint8_t *workspace) {
  check_memory(true, "backward");
  forwards_.check_backward(compiled_.training, saved, layer_.tokens());
  // The saved memory is that forward's, whatever was bound since.
  state_.forward_ran();
  state_.check_ready_for_backward();
  layer_.place(saved, workspace);
  layer_.run(compiled_.training.forward_steps, compiled_.training.program.steps.size(), "backward()");
  forwards_.backward_ran(compiled_.training, saved, layer_.tokens());
}

HostTensor CpuTrainingLayer::download(const std::string &func) const {
  const auto &over = compiled_.training.written_over_saved;
  const bool overwritten = std::any_of(over.begin(), over.end(), [&](const auto &o) { return o.second == func; });
  user_check(!overwritten || !forwards_.spent(layer_.saved_at(), layer_.tokens()))
      << "download('" << func << "'): the backward wrote a gradient over it (gradients_over_saved(true)); "
      << "download it between the forward and the backward";
  return layer_.download(func);
}

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
  check_memory(false, "forward");
  layer_.run(0, compiled_.training.forward_steps, "forward()");
  state_.forward_ran();
}

void CpuTrainingLayer::backward() {
  check_memory(false, "backward");
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
