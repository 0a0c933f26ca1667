// Which routed pairs an expert of fixed capacity keeps, as one function every
// backend that decides on the host calls (the reference, the CPU backend's
// routing, the tests' oracles); the device routing implements the same rule
// (backends/cuda/device/routing_kernels.cuh, moe_capacity_keep).
//
// Pairs are r = t * k + s (slot s = 0 the token's best expert). An expert of
// capacity C keeps its C pairs of highest priority and drops the rest:
//   token order (GShard / Tutel capacity factor): every first choice before
//     every second choice, and so on; within a slot the earlier token first.
//     C = ceil(factor * T * k / E).
//   score (expert choice: each expert takes its top C tokens): the larger
//     score first, ties to the earlier token. Every token offers every expert
//     (k = E), C = min(T, ceil(factor * T / E)): factor is the mean number
//     of experts per token.
// A dropped pair adds nothing to any sum over the pairs (the combine, the
// per-expert reductions, and a renormalised gate's sum over the token's
// pairs, so such gates are renormalised over the kept pairs, as DeepSpeed's
// top-2 gating does), forward and backward alike.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace moeforge {

enum class KeepPriority { token_order, score };

inline int64_t expert_capacity(double factor, int64_t tokens, int k, int experts, KeepPriority priority) {
  const double pairs = priority == KeepPriority::score ? static_cast<double>(tokens) : static_cast<double>(tokens) * k;
  // The product is exact for the factors people use (1.0, 1.25, 2.0); the
  // epsilon keeps e.g. 1.1 * 100 = 110.00000000000001 from rounding up.
  const int64_t c = static_cast<int64_t>(std::ceil(factor * pairs / experts - 1e-9));
  return priority == KeepPriority::score ? std::min<int64_t>(c, tokens) : c;
}

// kept[r] (1 kept, 0 dropped) for the experts expert[r] of P = tokens * k
// pairs; score[r] is read for KeepPriority::score only.
template <typename S>
std::vector<uint8_t> keep_within_capacity(const int32_t *expert, const S *score, int64_t tokens, int k, int experts,
                                          int64_t capacity, KeepPriority priority) {
  const int64_t P = tokens * k;
  std::vector<uint8_t> kept(static_cast<size_t>(P), 0);
  if (priority == KeepPriority::token_order) {
    std::vector<int64_t> taken(static_cast<size_t>(experts), 0);
    for (int s = 0; s < k; ++s)
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t r = t * k + s;
        if (taken[static_cast<size_t>(expert[r])]++ < capacity)
          kept[static_cast<size_t>(r)] = 1;
      }
    return kept;
  }
  std::vector<std::vector<int64_t>> of(static_cast<size_t>(experts));
  for (int64_t r = 0; r < P; ++r) // in r order, so each list is in token order
    of[static_cast<size_t>(expert[r])].push_back(r);
  for (std::vector<int64_t> &rows : of) {
    std::stable_sort(rows.begin(), rows.end(), [&](int64_t a, int64_t b) { return score[a] > score[b]; });
    for (size_t i = 0; i < rows.size() && static_cast<int64_t>(i) < capacity; ++i)
      kept[static_cast<size_t>(rows[i])] = 1;
  }
  return kept;
}

} // namespace moeforge
