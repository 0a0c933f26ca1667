// What top_k selects, as one function every backend that selects on the host
// calls (the reference, the CPU backend's routing, the tests' oracles), so
// that routing is the same function of the scores everywhere.
//
// Plain top-k: the k largest scores, largest first, ties to the lower expert.
// Group-limited (groups > 1, DeepSeek-V3's node-limited routing): the experts
// fall into `groups` contiguous groups of E / groups; a group scores the sum
// of its two largest scores (its one score when a group holds one expert);
// the top_groups best groups (ties to the lower group) are kept and top-k
// selects among their experts only.
//
// A score that is NaN or infinite is a UserError naming the token and the
// expert: a NaN compares false with everything, so any order would choose
// by it silently (one NaN in a selection bias sent every token to one
// expert), and no finite routing follows from an infinite one.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "dsl/error.h"

namespace moeforge {

template <typename S>
void select_top_k(const S *row, int experts, int k, int groups, int top_groups, int32_t *chosen, int64_t token = -1) {
  for (int e = 0; e < experts; ++e)
    user_check(std::isfinite(static_cast<double>(row[e])))
        << "top_k: the routing score of " << (token >= 0 ? "token " + std::to_string(token) + ", " : std::string())
        << "expert " << e << " is " << static_cast<double>(row[e])
        << ", which chooses no expert by any order: find where it comes from (the router's inputs or weights, "
        << "a selection bias)";
  auto better = [&](int32_t a, int32_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); };
  std::vector<int32_t> candidates;
  if (groups <= 1) {
    candidates.resize(static_cast<size_t>(experts));
    std::iota(candidates.begin(), candidates.end(), 0);
  } else {
    const int size = experts / groups;
    std::vector<S> score(static_cast<size_t>(groups));
    for (int g = 0; g < groups; ++g) {
      S first = row[g * size], second = S(0);
      for (int e = g * size + 1; e < (g + 1) * size; ++e) {
        if (row[e] > first) {
          second = first;
          first = row[e];
        } else if (e == g * size + 1 || row[e] > second) {
          second = row[e];
        }
      }
      score[static_cast<size_t>(g)] = size == 1 ? first : first + second;
    }
    std::vector<int32_t> order(static_cast<size_t>(groups));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_groups, order.end(),
                      [&](int32_t a, int32_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); });
    std::sort(order.begin(), order.begin() + top_groups);
    for (int i = 0; i < top_groups; ++i)
      for (int e = 0; e < size; ++e)
        candidates.push_back(order[static_cast<size_t>(i)] * size + e);
  }
  std::partial_sort(candidates.begin(), candidates.begin() + k, candidates.end(), better);
  std::copy(candidates.begin(), candidates.begin() + k, chosen);
}

} // namespace moeforge
