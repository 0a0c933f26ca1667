#include "backends/cuda/training_layer.h"

#include "dsl/error.h"

namespace moeforge::cuda {

CompiledTraining compile_training(const Pipeline &forward, const Func &output, const Schedule &schedule,
                                  const std::string &arch) {
  CompiledTraining c;
  c.training = lower_training(forward, output, schedule);
  c.layer = compile_program(c.training.program, arch);
  return c;
}

TrainingLayer::TrainingLayer(const Device &device, const CompiledTraining &compiled, int64_t tokens)
    : compiled_(compiled), layer_(device, compiled.layer, tokens) {}

void TrainingLayer::upload(const TensorMap &inputs) {
  forward_ran_ = false;
  for (const TensorDecl &t : compiled_.training.program.tensors)
    if (t.is_input && t.name != compiled_.training.seed) {
      auto it = inputs.find(t.name);
      user_check(it != inputs.end()) << "no tensor given for input '" << t.name << "'";
      layer_.upload(t.name, it->second);
    }
}

void TrainingLayer::upload_upstream_gradient(const HostTensor &grad) { layer_.upload(compiled_.training.seed, grad); }

void TrainingLayer::forward(const Stream &stream) {
  layer_.enqueue(stream, 0, compiled_.training.forward_steps);
  forward_ran_ = true;
}

void TrainingLayer::check_forward_ran() const {
  user_check(forward_ran_) << "backward() before forward(): the backward reads the activations the forward keeps "
                           << "for it; run forward() first (again after upload() of new inputs or poison())";
}

void TrainingLayer::backward(const Stream &stream) {
  check_forward_ran();
  layer_.enqueue(stream, compiled_.training.forward_steps, compiled_.training.program.steps.size());
}

std::vector<std::pair<std::string, double>> TrainingLayer::profile_forward(const Stream &stream) {
  forward_ran_ = true;
  return layer_.profile(stream, 0, compiled_.training.forward_steps);
}

std::vector<std::pair<std::string, double>> TrainingLayer::profile_backward(const Stream &stream) {
  check_forward_ran();
  return layer_.profile(stream, compiled_.training.forward_steps, compiled_.training.program.steps.size());
}

HostTensor TrainingLayer::gradient(const std::string &name) const {
  const TrainingProgram &t = compiled_.training;
  for (size_t i = 0; i < t.of.size(); ++i)
    if (t.of[i] == name)
      return layer_.download(t.gradients[i]);
  std::string known;
  for (const std::string &o : t.of)
    known += (known.empty() ? "" : ", ") + o;
  user_error << "no gradient for '" << name << "': the layer's output depends on " << known;
}

int64_t TrainingLayer::saved_bytes() const { return moeforge::saved_bytes(compiled_.training, layer_.tokens()); }

} // namespace moeforge::cuda
