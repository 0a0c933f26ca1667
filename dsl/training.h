// The algebra of one training step: the layer's forward output and the
// gradients of everything it reads, as one Pipeline that backends compile
// once. The forward Funcs appear once and the backward reads them (or, under
// a recompute schedule, recomputes what it needs); a runtime splits the
// compiled steps into a forward and a backward entry point (see
// lowering/training_split.h).
#pragma once

#include <string>
#include <vector>

#include "dsl/autodiff.h"

namespace moeforge {

struct TrainingAlgebra {
  Pipeline pipeline;                  // outputs: the forward output, then one gradient per Input and Param
  std::string output;                 // the forward output's name ("y")
  std::string seed;                   // the upstream gradient Input ("d_y")
  std::vector<std::string> gradients; // "d_x", "d_w1", ... in the order of buffers()
  std::vector<std::string> of;        // the Input or Param each gradient belongs to
};

// The training algebra of `output` in p: grad(p, output) with only the
// gradients of Inputs and Params kept as outputs (intermediate adjoints
// such as d_h are internal to the backward).
TrainingAlgebra training_algebra(const Pipeline &p, const Func &output);

} // namespace moeforge
