// What the Python training layers of every backend share: the token count
// check, the map from each Input and Param to its gradient's name, and the
// outputs a backward reads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dsl/error.h"
#include "lowering/training.h"

namespace moeforge::python {

inline void check_tokens(int64_t tokens) {
  if (tokens < 1)
    throw UserError("tokens must be at least 1 (got " + std::to_string(tokens) + ")");
}

// Input or Param name -> its gradient's name ("x" -> "d_x").
inline std::map<std::string, std::string> gradient_names(const TrainingProgram &t) {
  std::map<std::string, std::string> out;
  for (size_t g = 0; g < t.gradients.size(); ++g)
    out[t.of[g]] = t.gradients[g];
  return out;
}

// The forward outputs a backward reads: a caller on caller memory keeps them
// (and binds them again) from the forward to the end of its backward.
inline std::vector<std::string> backward_reads(const TrainingProgram &t) {
  std::vector<std::string> read;
  for (const std::string &o : t.outputs)
    for (size_t i = t.forward_steps; i < t.program.steps.size(); ++i) {
      const std::vector<std::string> r = step_reads(t.program.steps[i]);
      if (std::find(r.begin(), r.end(), o) != r.end()) {
        read.push_back(o);
        break;
      }
    }
  return read;
}

} // namespace moeforge::python
