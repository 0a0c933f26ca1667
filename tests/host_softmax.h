// The row softmax of [T, E] logits on the host in float, as a test's
// oracle for the device routing's fused softmax (probabilities within a
// few ulps of the device's).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "runtime/routing_format.h"

namespace moeforge::testing {

inline std::vector<float> host_softmax(std::vector<float> v, const RoutingShape &s) {
  for (int64_t t = 0; t < s.tokens; ++t) {
    float *row = &v[static_cast<size_t>(t * s.experts)], mx = -INFINITY, sum = 0.0f;
    for (int e = 0; e < s.experts; ++e)
      mx = std::max(mx, row[e]);
    for (int e = 0; e < s.experts; ++e)
      sum += row[e] = std::exp(row[e] - mx);
    for (int e = 0; e < s.experts; ++e)
      row[e] /= sum;
  }
  return v;
}

} // namespace moeforge::testing
