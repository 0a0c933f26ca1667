#include "runtime/memory_plan.h"

#include <algorithm>

#include "dsl/error.h"

namespace moeforge {

bool MemoryPlan::shares(const std::string &name) const {
  auto it = offset.find(name);
  if (it == offset.end())
    return false;
  const size_t begin = it->second, end = begin + size.at(name);
  for (const auto &[other, at] : offset)
    if (other != name && at < end && begin < at + size.at(other))
      return true;
  return false;
}

bool MemoryPlan::outlives_run(const std::string &name) const {
  auto it = live.find(name);
  return it == live.end() || it->second.second == last_step || !shares(name);
}

MemoryPlan plan_memory(const KernelProgram &p, const std::function<size_t(const TensorDecl &)> &bytes, size_t boundary,
                       size_t alignment) {
  MemoryPlan plan;
  const size_t n = p.steps.size();
  const size_t end = n == 0 ? 0 : n - 1;
  plan.last_step = end;
  // Live ranges from the steps that touch each tensor.
  std::map<std::string, size_t> first, last, first_write;
  for (size_t s = 0; s < n; ++s) {
    auto touch = [&](const std::string &t) {
      first.emplace(t, s);
      last[t] = s;
    };
    for (const std::string &r : step_reads(p.steps[s]))
      touch(r);
    for (const std::string &w : step_outputs(p.steps[s])) {
      touch(w);
      first_write.emplace(w, s);
    }
  }
  struct Item {
    std::string name;
    size_t size, from, to;
  };
  std::vector<Item> items;
  for (const TensorDecl &t : p.tensors) {
    if (t.is_input)
      continue;
    size_t from = first.count(t.name) ? first[t.name] : 0, to = last.count(t.name) ? last[t.name] : end;
    const bool output = std::find(p.outputs.begin(), p.outputs.end(), t.name) != p.outputs.end();
    const bool crosses = first_write.count(t.name) && first_write[t.name] < boundary && to >= boundary;
    if (output || crosses || !first.count(t.name))
      to = end; // kept: read after the run, or by a later part of it
    const size_t size = (bytes(t) + alignment - 1) / alignment * alignment;
    items.push_back({t.name, size, from, to});
    plan.live[t.name] = {from, to};
    plan.size[t.name] = size;
    plan.separate_bytes += size;
  }
  // Largest first, each at the lowest offset clear of every placed tensor
  // whose lifetime meets its own.
  std::stable_sort(items.begin(), items.end(), [](const Item &a, const Item &b) { return a.size > b.size; });
  std::vector<const Item *> placed;
  for (const Item &it : items) {
    std::vector<std::pair<size_t, size_t>> busy; // [offset, offset + size) of overlapping lifetimes
    for (const Item *q : placed)
      if (q->from <= it.to && it.from <= q->to)
        busy.emplace_back(plan.offset.at(q->name), plan.offset.at(q->name) + q->size);
    std::sort(busy.begin(), busy.end());
    size_t at = 0;
    for (const auto &[b, e] : busy) {
      if (at + it.size <= b)
        break;
      at = std::max(at, e);
    }
    plan.offset[it.name] = at;
    plan.arena_bytes = std::max(plan.arena_bytes, at + it.size);
    placed.push_back(&it);
  }
  internal_check(plan.arena_bytes <= plan.separate_bytes) << "a memory plan larger than no plan";
  return plan;
}

} // namespace moeforge
