#include "backends/cuda/training_layer.h"

#include <algorithm>

#include "dsl/error.h"

namespace moeforge::cuda {

CompiledTraining compile_training(const Pipeline &forward, const std::vector<Func> &outputs, const Schedule &schedule,
                                  const std::string &arch) {
  CompiledTraining c;
  c.training = lower_training(forward, outputs, schedule);
  c.layer = compile_program(c.training.program, arch);
  return c;
}

CompiledTraining compile_training(const Pipeline &forward, const Func &output, const Schedule &schedule,
                                  const std::string &arch) {
  return compile_training(forward, std::vector<Func>{output}, schedule, arch);
}

TrainingLayer::TrainingLayer(const Device &device, const CompiledTraining &compiled, int64_t tokens)
    : compiled_(compiled), layer_(device, compiled.layer, tokens),
      seeds_uploaded_(compiled.training.seeds.size(), false) {}

void TrainingLayer::upload(const TensorMap &inputs) {
  forward_ran_ = false;
  for (const TensorDecl &t : compiled_.training.program.tensors)
    if (t.is_input && !compiled_.training.is_seed(t.name)) {
      auto it = inputs.find(t.name);
      user_check(it != inputs.end()) << "no tensor given for input '" << t.name << "'";
      layer_.upload(t.name, it->second);
    }
}

void TrainingLayer::upload_repeated(const std::string &name, const HostTensor &pattern) {
  layer_.upload_repeated(name, pattern);
  const std::vector<std::string> &seeds = compiled_.training.seeds;
  auto seed = std::find(seeds.begin(), seeds.end(), name);
  if (seed == seeds.end())
    forward_ran_ = false; // a new input: the saved activations are stale
  else
    seeds_uploaded_[static_cast<size_t>(seed - seeds.begin())] = true;
}

void TrainingLayer::upload_upstream_gradient(const std::string &output, const HostTensor &grad) {
  size_t k = compiled_.training.output_index(output, "upload_upstream_gradient");
  layer_.upload(compiled_.training.seeds[k], grad);
  seeds_uploaded_[k] = true;
}

void TrainingLayer::upload_upstream_gradient(const HostTensor &grad) {
  upload_upstream_gradient(compiled_.training.output, grad);
}

void TrainingLayer::poison() {
  layer_.poison();
  forward_ran_ = false;
  seeds_uploaded_.assign(seeds_uploaded_.size(), false);
}

void TrainingLayer::forward(const Stream &stream) {
  layer_.enqueue(stream, 0, compiled_.training.forward_steps);
  forward_ran_ = true;
}

void TrainingLayer::check_forward_ran() const {
  compiled_.training.check_ready_for_backward(forward_ran_, seeds_uploaded_);
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

HostTensor TrainingLayer::output(const std::string &name) const {
  return layer_.download(compiled_.training.outputs[compiled_.training.output_index(name, "output()")]);
}

HostTensor TrainingLayer::gradient(const std::string &name) const {
  return layer_.download(compiled_.training.gradient_of(name));
}

int64_t TrainingLayer::saved_bytes() const { return moeforge::saved_bytes(compiled_.training, layer_.tokens()); }

} // namespace moeforge::cuda
