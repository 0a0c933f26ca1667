#include "dsl/training.h"

namespace moeforge {

TrainingAlgebra training_algebra(const Pipeline &p, const Func &output) {
  Gradients g = grad(p, output);
  std::vector<Func> outputs{output};
  TrainingAlgebra t{Pipeline({output}), output.name(), g.seed, {}, {}};
  for (const BufferPtr &b : p.buffers()) {
    auto it = g.of.find(b->name);
    if (it == g.of.end())
      continue; // the output does not depend on it
    outputs.push_back(it->second);
    t.gradients.push_back(it->second.name());
    t.of.push_back(b->name);
  }
  t.pipeline = Pipeline(outputs);
  return t;
}

} // namespace moeforge
