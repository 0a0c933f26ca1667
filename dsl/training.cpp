#include "dsl/training.h"

#include "dsl/error.h"

namespace moeforge {

TrainingAlgebra training_algebra(const Pipeline &p, const std::vector<Func> &outputs) {
  user_check(!outputs.empty()) << "a training step needs at least one output to differentiate: "
                               << "give the layer's outputs (its y, and any loss)";
  Gradients g = grad(p, outputs);
  internal_check(g.seeds.size() == outputs.size())
      << "grad() gave " << g.seeds.size() << " seeds for " << outputs.size() << " outputs";
  TrainingAlgebra t{Pipeline(outputs), {}, {}, {}, {}, {}, {}};
  t.seeds = g.seeds;
  for (const Func &f : outputs)
    t.outputs.push_back(f.name());
  t.output = t.outputs[0];
  t.seed = t.seeds[0];
  std::vector<Func> all = outputs;
  for (const BufferPtr &b : p.buffers()) {
    auto it = g.of.find(b->name);
    if (it == g.of.end())
      continue; // no output depends on it
    all.push_back(it->second);
    t.gradients.push_back(it->second.name());
    t.of.push_back(b->name);
  }
  t.pipeline = Pipeline(all);
  return t;
}

TrainingAlgebra training_algebra(const Pipeline &p, const Func &output) {
  return training_algebra(p, std::vector<Func>{output});
}

} // namespace moeforge
