#include "lowering/split_for_memory.h"

#include <algorithm>

#include "lowering/in_place.h"
#include "lowering/order_for_memory.h"

namespace moeforge {

namespace {

size_t elementwise_outputs(const PointwiseStep &s) {
  size_t n = 1;
  for (const ExtraOutput &e : s.extra)
    n += e.row_sum ? 0 : 1;
  return n;
}

// p with element-wise output `which` of pointwise step s (0: the primary,
// else extra which - 1) made by a step of its own just before s. Each
// value of a merged step reads no output of it, so the new step reads
// only what s reads, all made before s.
KernelProgram split_off(const KernelProgram &p, size_t s, size_t which) {
  KernelProgram q = p;
  auto &merged = std::get<PointwiseStep>(q.steps[s]);
  PointwiseStep alone;
  alone.vars = merged.vars;
  if (which == 0) {
    alone.output = merged.output;
    alone.body = merged.body;
    // The next element-wise value becomes the merged step's primary.
    auto next = std::find_if(merged.extra.begin(), merged.extra.end(), [](const ExtraOutput &e) { return !e.row_sum; });
    merged.output = next->output;
    merged.body = next->value;
    merged.extra.erase(next);
  } else {
    const ExtraOutput e = merged.extra[which - 1];
    alone.output = e.output;
    alone.body = e.value;
    merged.extra.erase(merged.extra.begin() + static_cast<long>(which - 1));
  }
  alone.name = pointwise_name(alone);
  merged.name = pointwise_name(merged);
  merged.in_place.clear();
  q.steps.insert(q.steps.begin() + static_cast<long>(s), std::move(alone));
  return q;
}

// The backward's peak as the memory plan will see it: in its best order,
// with the in-place outputs that order allows.
size_t peak_after_ordering(KernelProgram &q, size_t boundary, const std::vector<std::string> &kept) {
  order_steps_for_memory(q, boundary, q.steps.size(), kept);
  mark_in_place_outputs(q, boundary);
  return peak_live_bytes(q, boundary, q.steps.size(), kept);
}

} // namespace

void split_pointwise_for_memory(KernelProgram &p, size_t boundary, const std::vector<std::string> &kept) {
  KernelProgram now = p;
  size_t best = peak_after_ordering(now, boundary, kept);
  bool any = false;
  for (bool split = true; split;) {
    split = false;
    // Every candidate is tried and the one that lowers the peak most kept,
    // so the order the outputs were merged in does not decide.
    KernelProgram chosen;
    for (size_t s = boundary; s < now.steps.size(); ++s) {
      const auto *pw = std::get_if<PointwiseStep>(&now.steps[s]);
      if (!pw || elementwise_outputs(*pw) < 2)
        continue;
      for (size_t which = 0; which <= pw->extra.size(); ++which) {
        if (which > 0 && pw->extra[which - 1].row_sum)
          continue;
        KernelProgram trial = split_off(now, s, which);
        const size_t peak = peak_after_ordering(trial, boundary, kept);
        if (peak < best) {
          best = peak;
          chosen = std::move(trial);
          split = true;
        }
      }
    }
    if (split)
      now = std::move(chosen);
    any |= split;
  }
  if (any)
    p = std::move(now);
}

} // namespace moeforge
