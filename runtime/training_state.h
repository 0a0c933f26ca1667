// What a training runtime tracks between its entry points, for any backend:
// whether the forward ran since the inputs last changed (the backward reads
// the activations it kept) and which outputs' upstream gradients were
// uploaded since the last poison. cuda::TrainingLayer and
// cpu::CpuTrainingLayer both own one, so both refuse the same misuse with
// the same words.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "dsl/error.h"
#include "lowering/training.h"
#include "runtime/tensor.h"

namespace moeforge {

class TrainingState {
public:
  explicit TrainingState(const TrainingProgram &t) : t_(t), seeds_uploaded_(t.seeds.size(), false) {}

  // Uploads every forward Input and Param from `inputs` (not the upstream
  // gradients) through upload(name, tensor); a missing one is a UserError.
  template <typename Upload> void upload_inputs(const TensorMap &inputs, Upload upload) {
    forward_ran_ = false;
    for (const TensorDecl &d : t_.program.tensors)
      if (d.is_input && !t_.is_seed(d.name)) {
        auto it = inputs.find(d.name);
        user_check(it != inputs.end()) << "no tensor given for input '" << d.name << "'";
        upload(d.name, it->second);
      }
  }
  // The upstream-gradient Input of `output`, now counted as uploaded.
  const std::string &upstream_gradient_of(const std::string &output) {
    size_t k = t_.output_index(output, "upload_upstream_gradient");
    seeds_uploaded_[k] = true;
    return t_.seeds[k];
  }
  // Input `name` changed by another route (a benchmark's repeated pattern):
  // a seed counts as uploaded, any other input makes the saved state stale.
  void uploaded(const std::string &name) {
    auto seed = std::find(t_.seeds.begin(), t_.seeds.end(), name);
    if (seed == t_.seeds.end())
      forward_ran_ = false;
    else
      seeds_uploaded_[static_cast<size_t>(seed - t_.seeds.begin())] = true;
  }
  void poisoned() {
    forward_ran_ = false;
    seeds_uploaded_.assign(seeds_uploaded_.size(), false);
  }
  void forward_ran() { forward_ran_ = true; }
  // UserErrors that say what to call first.
  void check_ready_for_backward() const { t_.check_ready_for_backward(forward_ran_, seeds_uploaded_); }

private:
  const TrainingProgram &t_;
  bool forward_ran_ = false;         // since the last upload of an input, or poison
  std::vector<bool> seeds_uploaded_; // per output, since the last poison
};

} // namespace moeforge
