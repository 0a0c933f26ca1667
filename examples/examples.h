// The example layers, written in the algebra. Each builds a Pipeline for the
// given shape; the CLI, the tests and the benchmarks share them.
//
//   moe_mlp        GeLU-MLP MoE (MegaBlocks' layer): softmax router, top-k,
//                  h = gelu(x W1[e]), o = h W2[e], gated combine.
//   swiglu_moe     Mixtral-style SwiGLU MoE with renormalised top-k gates.
//   expert_choice_moe  each expert picks its top tokens (the shape's topk
//                  is the capacity factor: mean experts per token).
//   dense_mlp      a plain GeLU MLP: no routing at all.
//   attention      softmax attention over the token sequence.
//   moa            Mixture-of-Attention: heads as experts around one shared
//                  attention (and the other MoE variants: moeforge list).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dsl/pipeline.h"
#include "runtime/tensor.h"

namespace moeforge {

struct ExampleShape {
  int64_t tokens = 256;
  int64_t experts = 8;
  int64_t topk = 2;
  int64_t d = 64;  // model width
  int64_t f = 128; // expert (or MLP) hidden width
};

struct Example {
  std::string name;
  std::string description;
  Pipeline pipeline;
  std::string output; // the Func that is the layer's result
  std::string route;  // the route's name; empty for a layer without routing
  // Uniform init range of each Input/Param, scaled by fan-in so activations stay O(1).
  std::map<std::string, double> init_scale;

  // Fresh random inputs (bf16-exact values) for every Input and Param.
  TensorMap random_inputs(const ExampleShape &shape, uint64_t seed) const;
  // Input or Param `b`'s shape (the token Dim at shape.tokens).
  std::vector<int64_t> input_shape(const BufferNode &b, const ExampleShape &shape) const;
  // The uniform range [-a, a) of Input or Param `name`'s random values.
  double init_range(const std::string &name) const;
};

// Names of every example, for listings and error messages.
std::vector<std::string> example_names();

// How an impossible shape's error names its sizes: as the CLI's flags
// ("--tokens 5"), or as Python's keyword arguments ("tokens=5").
enum class ShapeSpelling { cli_flags, keywords };

// Builds the named example. Unknown names and impossible shapes are
// UserErrors that name the problem and the fix.
Example make_example(const std::string &name, const ExampleShape &shape,
                     ShapeSpelling spelling = ShapeSpelling::cli_flags);

} // namespace moeforge
