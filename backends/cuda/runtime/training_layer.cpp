#include "backends/cuda/runtime/training_layer.h"

#include <algorithm>

#include "dsl/error.h"

namespace moeforge::cuda {

CompiledTraining compile_training(const Pipeline &forward, const std::vector<Func> &outputs, const Schedule &schedule,
                                  const std::string &arch) {
  CompiledTraining c;
  check_vector_alignment(training_algebra(forward, outputs).pipeline); // the gradients' contractions too
  c.training = lower_training(forward, outputs, schedule);
  c.layer = compile_program(c.training.program, arch);
  return c;
}

CompiledTraining compile_training(const Pipeline &forward, const Func &output, const Schedule &schedule,
                                  const std::string &arch) {
  return compile_training(forward, std::vector<Func>{output}, schedule, arch);
}

TrainingLayer::TrainingLayer(const Device &device, const CompiledTraining &compiled, int64_t tokens, LayerMemory memory)
    : compiled_(compiled), layer_(device, compiled.layer, tokens, compiled.training.forward_steps, memory),
      state_(compiled.training) {}

void TrainingLayer::check_memory(bool caller, const char *call) const {
  if (caller)
    user_check(layer_.memory() == LayerMemory::caller)
        << call << " with memory: this layer holds memory of its own; call " << call << "(stream)";
  else
    user_check(layer_.memory() == LayerMemory::owned)
        << call << "(stream): this layer runs on caller memory; call " << call << "(stream, saved, workspace)";
}

void TrainingLayer::upload(const TensorMap &inputs) {
  state_.upload_inputs(inputs, [&](const std::string &name, const HostTensor &t) { layer_.upload(name, t); });
}

void TrainingLayer::upload(const std::string &name, const HostTensor &value) {
  layer_.upload(name, value);
  state_.uploaded(name);
}

void TrainingLayer::upload_repeated(const std::string &name, const HostTensor &pattern) {
  layer_.upload_repeated(name, pattern);
  state_.uploaded(name);
}

void TrainingLayer::upload_upstream_gradient(const std::string &output, const HostTensor &grad) {
  layer_.upload(state_.upstream_gradient_of(output), grad);
}

void TrainingLayer::upload_upstream_gradient(const HostTensor &grad) {
  upload_upstream_gradient(compiled_.training.output, grad);
}

void TrainingLayer::copy_in(const std::string &name, CUdeviceptr src, size_t bytes, const Stream &stream) {
  layer_.copy_in(name, src, bytes, stream);
  state_.uploaded(name);
}

void TrainingLayer::bind(const std::string &name, CUdeviceptr ptr, size_t bytes) {
  layer_.bind(name, ptr, bytes);
  if (const TensorDecl *t = compiled_.training.program.find(name); t && t->is_input)
    state_.uploaded(name); // new values: a seed counts as given, an input needs a new forward
}

void TrainingLayer::copy_gradient(const std::string &of, CUdeviceptr dst, size_t bytes, const Stream &stream) const {
  layer_.copy_out(compiled_.training.gradient_of(of), dst, bytes, stream);
}

void TrainingLayer::poison() {
  layer_.poison();
  state_.poisoned();
}

void TrainingLayer::forward(const Stream &stream) {
  check_memory(false, "forward");
  replay_.run(layer_, 0, compiled_.training.forward_steps, stream, "forward()", replay_on_);
  state_.forward_ran();
}

void TrainingLayer::backward(const Stream &stream) {
  check_memory(false, "backward");
  state_.check_ready_for_backward();
  replay_.run(layer_, compiled_.training.forward_steps, compiled_.training.program.steps.size(), stream, "backward()",
              replay_on_);
}

void TrainingLayer::forward(const Stream &stream, const SavedParts &saved, CUdeviceptr workspace) {
  check_memory(true, "forward");
  layer_.place(saved, workspace);
  replay_.run(layer_, 0, compiled_.training.forward_steps, stream, "forward()", replay_on_);
  forwards_.forward_wrote(saved, layer_.tokens());
}

void TrainingLayer::backward(const Stream &stream, const SavedParts &saved, CUdeviceptr workspace) {
  check_memory(true, "backward");
  forwards_.check_backward(compiled_.training, saved, layer_.tokens());
  // The saved memory is that forward's, whatever was bound since.
  state_.forward_ran();
  state_.check_ready_for_backward();
  layer_.place(saved, workspace);
  replay_.run(layer_, compiled_.training.forward_steps, compiled_.training.program.steps.size(), stream, "backward()",
              replay_on_);
  forwards_.backward_ran(compiled_.training, saved, layer_.tokens());
}

std::vector<std::pair<std::string, double>> TrainingLayer::profile_forward(const Stream &stream) {
  state_.forward_ran();
  return layer_.profile(stream, 0, compiled_.training.forward_steps);
}

std::vector<std::pair<std::string, double>> TrainingLayer::profile_backward(const Stream &stream) {
  state_.check_ready_for_backward();
  return layer_.profile(stream, compiled_.training.forward_steps, compiled_.training.program.steps.size());
}

HostTensor TrainingLayer::download(const std::string &func) const {
  const auto &over = compiled_.training.written_over_saved;
  const bool overwritten = std::any_of(over.begin(), over.end(), [&](const auto &o) { return o.second == func; });
  user_check(!overwritten || !forwards_.spent(layer_.saved_at(), layer_.tokens()))
      << "download('" << func << "'): the backward wrote a gradient over it (gradients_over_saved(true)); "
      << "download it between the forward and the backward";
  return layer_.download(func);
}

HostTensor TrainingLayer::output(const std::string &name) const {
  return layer_.download(compiled_.training.outputs[compiled_.training.output_index(name, "output()")]);
}

HostTensor TrainingLayer::gradient(const std::string &name) const {
  return layer_.download(compiled_.training.gradient_of(name));
}

int64_t TrainingLayer::saved_bytes() const { return moeforge::saved_bytes(compiled_.training, layer_.tokens()); }

} // namespace moeforge::cuda
