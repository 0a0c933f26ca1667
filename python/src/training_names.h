// What the Python training layers of every backend share: the token count
// check and the map from each Input and Param to its gradient's name.
#pragma once

#include <cstdint>
#include <map>
#include <string>

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

} // namespace moeforge::python
