// The algebra of one training step: the layer's forward outputs and the
// gradients of everything they read, as one Pipeline that backends compile
// once. The forward Funcs appear once and the backward reads them (or, under
// a recompute schedule, recomputes what it needs); a runtime splits the
// compiled steps into a forward and a backward entry point (see
// lowering/training.h).
//
// A layer trains with one output (y) or several: the layer's output and its
// auxiliary losses (examples/aux_loss_example.h), each with its own upstream
// gradient Input (the seed; a 0-D loss gets a 0-D seed, usually 1.0).
#pragma once

#include <string>
#include <vector>

#include "dsl/autodiff.h"

namespace moeforge {

struct TrainingAlgebra {
  Pipeline pipeline;                  // outputs: the forward outputs, then one gradient per Input and Param
  std::vector<std::string> outputs;   // the forward outputs ("y", "lb_loss", ...), in the order given
  std::vector<std::string> seeds;     // seeds[k]: the upstream gradient Input of outputs[k] ("d_y", ...)
  std::string output;                 // outputs[0]
  std::string seed;                   // seeds[0]
  std::vector<std::string> gradients; // "d_x", "d_w1", ... in the order of buffers()
  std::vector<std::string> of;        // the Input or Param each gradient belongs to
};

// The training algebra of `outputs` (Funcs of p): grad(p, outputs), one seed
// per output, with only the gradients of Inputs and Params kept as outputs
// (intermediate adjoints such as d_h are internal to the backward).
TrainingAlgebra training_algebra(const Pipeline &p, const std::vector<Func> &outputs);
// One output: training_algebra(p, {output}).
TrainingAlgebra training_algebra(const Pipeline &p, const Func &output);

} // namespace moeforge
