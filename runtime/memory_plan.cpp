#include "runtime/memory_plan.h"

#include <algorithm>

#include "dsl/error.h"
#include "lowering/in_place.h"

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

namespace {

// The steps that touch each tensor: the first, the last, the first write.
struct Touches {
  std::map<std::string, size_t> first, last, first_write;
  bool crosses(const std::string &t, size_t boundary) const {
    auto w = first_write.find(t);
    return w != first_write.end() && w->second < boundary && last.at(t) >= boundary;
  }
};

Touches touches_of(const KernelProgram &p) {
  Touches t;
  for (size_t s = 0; s < p.steps.size(); ++s) {
    auto touch = [&](const std::string &name) {
      t.first.emplace(name, s);
      t.last[name] = s;
    };
    for (const std::string &r : step_reads(p.steps[s]))
      touch(r);
    for (const std::string &w : step_outputs(p.steps[s])) {
      touch(w);
      t.first_write.emplace(w, s);
    }
  }
  return t;
}

// One tensor's bytes and lifetime (first and last step, inclusive).
struct Member {
  std::string name;
  size_t size, from, to;
};

// What one offset holds: a tensor, or a tensor and the outputs written over
// its bytes (PointwiseStep::in_place), whose lifetimes follow one another.
struct Item {
  std::vector<Member> members;
  size_t size, from, to;
};

Item single(Member m) { return {{m}, m.size, m.from, m.to}; }

size_t aligned(size_t bytes, size_t alignment) { return (bytes + alignment - 1) / alignment * alignment; }

// Items placed in one memory, each with its offset.
using Placed = std::vector<std::pair<const Item *, size_t>>;

// The lowest offset where `it` is clear of every placed item whose lifetime
// meets its own.
size_t lowest_clear_offset(const Placed &placed, const Item &it) {
  std::vector<std::pair<size_t, size_t>> busy; // [offset, offset + size) of overlapping lifetimes
  for (const auto &[q, q_at] : placed)
    if (q->from <= it.to && it.from <= q->to)
      busy.emplace_back(q_at, q_at + q->size);
  std::sort(busy.begin(), busy.end());
  size_t at = 0;
  for (const auto &[b, e] : busy) {
    if (at + it.size <= b)
      break;
    at = std::max(at, e);
  }
  return at;
}

// Largest first, each at the lowest offset clear of every placed item
// whose lifetime meets its own.
void place_by_lifetime(std::vector<Item> items, MemoryPlan &plan) {
  std::stable_sort(items.begin(), items.end(), [](const Item &a, const Item &b) { return a.size > b.size; });
  Placed placed;
  for (const Item &it : items) {
    const size_t at = lowest_clear_offset(placed, it);
    for (const Member &m : it.members) {
      plan.offset[m.name] = at;
      plan.live[m.name] = {m.from, m.to};
      plan.size[m.name] = m.size;
      plan.separate_bytes += m.size;
    }
    plan.arena_bytes = std::max(plan.arena_bytes, at + it.size);
    placed.emplace_back(&it, at);
  }
  internal_check(plan.arena_bytes <= plan.separate_bytes) << "a memory plan larger than no plan";
}

// Joins each output written over an input's bytes to the input's item, where
// both are among `members` and the step's order still allows it.
std::vector<Item> join_in_place(const KernelProgram &p, size_t boundary, const std::vector<Member> &members,
                                MemoryPlan &plan) {
  std::map<std::string, size_t> item_of;
  std::vector<Item> items;
  for (const Member &m : members) {
    item_of[m.name] = items.size();
    items.push_back(single(m));
  }
  std::vector<bool> gone(items.size(), false);
  for (size_t s = 0; s < p.steps.size(); ++s) {
    const auto *pw = std::get_if<PointwiseStep>(&p.steps[s]);
    if (!pw)
      continue;
    for (const auto &[out, in] : pw->in_place) {
      auto o = item_of.find(out), i = item_of.find(in);
      if (o == item_of.end() || i == item_of.end() || o->second == i->second ||
          !may_write_in_place(p, s, out, in, boundary))
        continue;
      const size_t to_item = i->second, from_item = o->second;
      Item &into = items[to_item], &from = items[from_item];
      into.members.insert(into.members.end(), from.members.begin(), from.members.end());
      into.size = std::max(into.size, from.size);
      into.from = std::min(into.from, from.from);
      into.to = std::max(into.to, from.to);
      for (const Member &m : from.members)
        item_of[m.name] = to_item;
      gone[from_item] = true;
      plan.written_over[out] = in;
    }
  }
  std::vector<Item> out;
  for (size_t k = 0; k < items.size(); ++k)
    if (!gone[k])
      out.push_back(std::move(items[k]));
  return out;
}

// Scratch in the caller's outputs before they are written (InOutput): an
// output is the caller's memory for the whole entry point that first
// touches it (steps from `boundary` on for a backward's, from the first for
// a forward's) and holds nothing anyone reads until then, so an item whose
// whole lifetime lies in that entry point, before the output's first touch
// (or the first touch of an intermediate that lives in it element by
// element), may take its bytes: largest first, each at the lowest offset
// clear of the items placed there whose lifetimes meet its own, where it
// fits. An output stored inside a larger tensor (outer_stride) is left
// alone: the bytes between its rows are another tensor's. Returns the items
// left for the workspace.
std::vector<Item> place_in_outputs(const KernelProgram &p, const Touches &touched, size_t boundary,
                                   const std::function<size_t(const TensorDecl &)> &bytes, std::vector<Item> items,
                                   StepMemoryPlan &plan) {
  struct Region {
    std::string output;
    size_t start, busy_from, capacity;
    Placed placed;
  };
  std::vector<Region> regions;
  for (const TensorDecl &t : p.tensors) {
    if (t.is_input || !is_output(p, t.name) || t.outer_stride != 0 || !touched.first.count(t.name))
      continue;
    size_t busy_from = touched.first.at(t.name);
    for (const auto &[in, where] : plan.in_output)
      if (where.output == t.name && touched.first.count(in))
        busy_from = std::min(busy_from, touched.first.at(in));
    regions.push_back({t.name, busy_from >= boundary ? boundary : 0, busy_from, bytes(t), {}});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item &a, const Item &b) { return a.size > b.size; });
  // `items` keeps its order and size from here, so the regions point into it.
  std::vector<bool> taken(items.size(), false);
  for (size_t k = 0; k < items.size(); ++k) {
    const Item &it = items[k];
    for (Region &r : regions) {
      if (it.size == 0 || it.from < r.start || it.to >= r.busy_from)
        continue;
      const size_t at = lowest_clear_offset(r.placed, it);
      if (at + it.size > r.capacity)
        continue;
      r.placed.emplace_back(&it, at);
      for (const Member &m : it.members)
        plan.in_output[m.name] = {r.output, at, true};
      taken[k] = true;
      break;
    }
  }
  std::vector<Item> rest;
  for (size_t k = 0; k < items.size(); ++k)
    if (!taken[k])
      rest.push_back(std::move(items[k]));
  return rest;
}

} // namespace

MemoryPlan plan_memory(const KernelProgram &p, const std::function<size_t(const TensorDecl &)> &bytes, size_t boundary,
                       size_t alignment) {
  MemoryPlan plan;
  const size_t end = p.steps.empty() ? 0 : p.steps.size() - 1;
  plan.last_step = end;
  const Touches touched = touches_of(p);
  std::vector<Item> items;
  for (const TensorDecl &t : p.tensors) {
    if (t.is_input)
      continue;
    const bool touches = touched.first.count(t.name) > 0;
    size_t from = touches ? touched.first.at(t.name) : 0, to = touches ? touched.last.at(t.name) : end;
    if (is_output(p, t.name) || touched.crosses(t.name, boundary) || !touches)
      to = end; // kept: read after the run, or by a later part of it
    items.push_back(single({t.name, aligned(bytes(t), alignment), from, to}));
  }
  place_by_lifetime(std::move(items), plan);
  return plan;
}

StepMemoryPlan plan_step_memory(const KernelProgram &p, const std::function<size_t(const TensorDecl &)> &bytes,
                                size_t boundary, size_t alignment, OutputScratch scratch) {
  StepMemoryPlan plan;
  const size_t end = p.steps.empty() ? 0 : p.steps.size() - 1;
  plan.saved.last_step = plan.workspace.last_step = end;
  const Touches touched = touches_of(p);
  std::vector<Member> transient;
  for (const TensorDecl &t : p.tensors) {
    if (t.is_input || is_output(p, t.name))
      continue;
    const size_t size = aligned(bytes(t), alignment);
    if (touched.crosses(t.name, boundary)) {
      // Live from its write to the backward's end: nothing in this region
      // could share its bytes, so the tensors follow one another.
      plan.saved.offset[t.name] = plan.saved.arena_bytes;
      plan.saved.size[t.name] = size;
      plan.saved.live[t.name] = {touched.first_write.at(t.name), end};
      plan.saved.arena_bytes += size;
      plan.saved.separate_bytes += size;
      continue;
    }
    // A tensor no step touches holds no value: it takes no bytes (a
    // zero-length lifetime at the first step, clear of every real one, but
    // given an address all the same).
    if (!touched.first.count(t.name)) {
      transient.push_back({t.name, 0, 0, 0});
      continue;
    }
    transient.push_back({t.name, size, touched.first.at(t.name), touched.last.at(t.name)});
  }
  // Backward outputs written over a saved tensor live on its bytes, in the
  // saved region (same dtype, dims and layout: the same size).
  const std::map<std::string, std::string> over_saved = written_over_saved(p, boundary);
  transient.erase(std::remove_if(transient.begin(), transient.end(),
                                 [&](const Member &m) {
                                   auto it = over_saved.find(m.name);
                                   if (it == over_saved.end() || !plan.saved.offset.count(it->second))
                                     return false;
                                   internal_check(m.size == plan.saved.size.at(it->second))
                                       << "'" << m.name << "' written over '" << it->second << "' of another size";
                                   plan.saved.offset[m.name] = plan.saved.offset.at(it->second);
                                   plan.saved.size[m.name] = m.size;
                                   plan.saved.live[m.name] = {m.from, m.to};
                                   plan.saved.written_over[m.name] = it->second;
                                   return true;
                                 }),
                  transient.end());
  // Intermediates that live in an output's memory take no workspace.
  for (size_t s = 0; s < p.steps.size(); ++s)
    if (const auto *pw = std::get_if<PointwiseStep>(&p.steps[s]))
      for (const auto &[out, in] : pw->in_place)
        if (may_live_in_output(p, s, out, in, boundary))
          plan.in_output[in] = {out, 0, false};
  transient.erase(std::remove_if(transient.begin(), transient.end(),
                                 [&](const Member &m) { return plan.in_output.count(m.name) > 0; }),
                  transient.end());
  std::vector<Item> items = join_in_place(p, boundary, transient, plan.workspace);
  if (scratch == OutputScratch::on)
    items = place_in_outputs(p, touched, boundary, bytes, std::move(items), plan);
  place_by_lifetime(std::move(items), plan.workspace);
  for (const Member &it : transient) {
    if (plan.in_output.count(it.name))
      continue; // scratch in an output (place_in_outputs)
    const size_t top = plan.workspace.offset.at(it.name) + it.size;
    size_t &part = it.from < boundary ? plan.workspace_before : plan.workspace_after;
    internal_check(it.from >= boundary || it.to < boundary)
        << "'" << it.name << "' lives across the boundary but is not saved";
    part = std::max(part, top);
  }
  return plan;
}

namespace {
// The step plan of a layer on caller memory: each tensor's stored bytes at
// `shapes`' count, regions aligned to kRegionAlignment. What
// caller_memory_layout lays out and caller_saved_terms writes over the count.
StepMemoryPlan caller_step_plan(const KernelProgram &p, const ProgramShapes &shapes, size_t boundary) {
  auto bytes = [&](const TensorDecl &t) { return static_cast<size_t>(shapes.elements(t)) * dtype_bytes(t.dtype); };
  return plan_step_memory(p, bytes, boundary, kRegionAlignment);
}

// Whether a saved tensor goes with the activations (the first saved part)
// rather than with the routing tables (the last): its static extents hold
// at least kRegionAlignment bytes for each row or pair, a feature vector
// (model widths are 128 values and more). The others hold a few values a
// row (a pair's probability, a route's k choices of a token): a small tail
// that a framework's allocator keeps with its small blocks, so that the
// activations' part is their sum alone. In a model that sum can be just the
// size of the blocks the freed weight gradients leave (2 T k f = E d f at
// mixtral's shape): with the tail it would miss all of them and take new
// memory; each activation apart, their halves split those blocks and the
// backward's gradients then miss them.
bool with_activations(const TensorDecl &t) {
  int64_t bytes = dtype_bytes(t.dtype);
  for (const Dim &d : t.dims)
    if (!d.is_dynamic())
      bytes *= d.extent();
  return bytes >= static_cast<int64_t>(kRegionAlignment);
}

// The saved tensors that take bytes of their own (one written over another
// shares that one's), in the program's order: the activations', and the
// tail's.
struct SavedByPart {
  std::vector<const TensorDecl *> activations, tail;
  bool any() const { return !activations.empty() || !tail.empty(); }
};
SavedByPart saved_by_part(const KernelProgram &p, const StepMemoryPlan &plan) {
  SavedByPart out;
  for (const TensorDecl &t : p.tensors)
    if (plan.saved.offset.count(t.name) && !plan.saved.written_over.count(t.name))
      (with_activations(t) ? out.activations : out.tail).push_back(&t);
  return out;
}
} // namespace

CallerMemoryLayout caller_memory_layout(const KernelProgram &p, const ProgramShapes &shapes, size_t boundary,
                                        const std::function<size_t(const RoutingShape &)> &table_bytes) {
  auto align = [](size_t n) { return (n + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment; };
  CallerMemoryLayout l;
  l.plan = caller_step_plan(p, shapes, boundary);
  const SavedByPart saved = saved_by_part(p, l.plan);
  // Each saved tensor at `at` in `part`, after the ones before it.
  size_t at = 0;
  auto lay = [&](const std::vector<const TensorDecl *> &tensors, size_t part) {
    for (const TensorDecl *t : tensors) {
      l.saved_at[t->name] = {part, at};
      at += l.plan.saved.size.at(t->name);
    }
  };
  if (saved.any()) {
    lay(saved.activations, 0);
    l.memory.saved.push_back(at);
    at = 0;
  }
  lay(saved.tail, l.memory.saved.size());
  for (const auto &[over, under] : l.plan.saved.written_over)
    l.saved_at[over] = l.saved_at.at(under);
  for (const auto &[r, shape] : shapes.routings()) {
    l.table_offset[r] = at;
    at += align(table_bytes(shape));
  }
  l.memory.saved.push_back(at);
  l.memory.workspace_before = l.plan.workspace_before;
  l.memory.workspace_after = l.plan.workspace_after;
  return l;
}

void check_saved_parts(const std::string &call, const SavedParts &given, const std::vector<size_t> &bytes,
                       size_t alignment) {
  user_check(given.size() == bytes.size())
      << call << ": " << given.size() << " saved parts given; this layer's forward saves " << bytes.size()
      << " (step_memory().saved: the activations, then the routing tables), each its own memory";
  for (size_t i = 0; i < given.size(); ++i) {
    user_check(given[i] != 0 || bytes[i] == 0)
        << call << ": saved part " << i << " (" << bytes[i] << " bytes) has no memory (address 0)";
    user_check(given[i] % alignment == 0) << call << ": saved part " << i << " must start at a " << alignment
                                          << "-byte aligned address (got 0x" << std::hex << given[i] << std::dec << ")";
  }
}

std::optional<std::vector<SizeTerms>>
caller_saved_terms(const KernelProgram &p, const ProgramShapes &shapes, size_t boundary,
                   const std::function<std::optional<SizeTerms>(const RoutingShape &)> &table_terms) {
  const SavedByPart saved = saved_by_part(p, caller_step_plan(p, shapes, boundary));
  // Each tensor aligned, as plan_step_memory sizes it.
  auto add = [&](const std::vector<const TensorDecl *> &tensors, SizeTerms &terms) {
    for (const TensorDecl *t : tensors) {
      std::optional<SizeProduct> b = shapes.bytes_over_tokens(*t);
      if (!b)
        return false;
      terms.push_back({{*b}, static_cast<int64_t>(kRegionAlignment)});
    }
    return true;
  };
  std::vector<SizeTerms> parts;
  if (saved.any()) {
    parts.emplace_back();
    if (!add(saved.activations, parts.back()))
      return std::nullopt;
  }
  parts.emplace_back();
  if (!add(saved.tail, parts.back()))
    return std::nullopt;
  for (const auto &[r, shape] : shapes.routings()) {
    std::optional<SizeTerms> one = table_terms(shape);
    if (!one)
      return std::nullopt;
    for (const SizeTerm &t : *one) // so their sum is the aligned table bytes caller_memory_layout adds
      internal_check(t.align % static_cast<int64_t>(kRegionAlignment) == 0) << "a routing table term's alignment";
    parts.back().insert(parts.back().end(), one->begin(), one->end());
  }
  return parts;
}

} // namespace moeforge
