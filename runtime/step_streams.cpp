#include "runtime/step_streams.h"

#include <algorithm>

#include "dsl/error.h"

namespace moeforge {
namespace {

bool overlap(const std::vector<ByteRange> &a, const std::vector<ByteRange> &b) {
  for (const ByteRange &x : a)
    for (const ByteRange &y : b)
      if (x.first < y.second && y.first < x.second && x.first < x.second && y.first < y.second)
        return true;
  return false;
}

} // namespace

std::vector<StepAccess> step_accesses(const KernelProgram &p, size_t begin, size_t end,
                                      const std::function<ByteRange(const std::string &)> &range_of) {
  internal_check(begin <= end && end <= p.steps.size()) << "step range out of bounds";
  std::vector<StepAccess> out;
  for (size_t i = begin; i < end; ++i) {
    StepAccess a;
    a.barrier = std::holds_alternative<RoutingStep>(p.steps[i]);
    // Names that are not the program's tensors (a GEMM epilogue's reads of
    // its accumulators) are registers, not memory.
    for (const std::string &r : step_reads(p.steps[i]))
      if (p.find(r))
        a.reads.push_back(range_of(r));
    for (const std::string &w : step_outputs(p.steps[i]))
      if (p.find(w))
        a.writes.push_back(range_of(w));
    out.push_back(std::move(a));
  }
  return out;
}

bool steps_conflict(const StepAccess &a, const StepAccess &b) {
  return a.barrier || b.barrier || overlap(a.writes, b.reads) || overlap(a.writes, b.writes) ||
         overlap(a.reads, b.writes);
}

StreamPlan plan_streams(const std::vector<StepAccess> &steps, int max_streams) {
  internal_check(max_streams >= 1) << "plan_streams needs at least one stream";
  const size_t n = steps.size();
  StreamPlan plan;
  plan.steps.resize(n);
  // clock[s][t]: the latest step of stream t known to finish before the next
  // step queued on stream s starts (-1: none). A vector clock, so a wait that
  // an earlier wait already implies is never added.
  std::vector<std::vector<long>> clock(max_streams, std::vector<long>(max_streams, -1));
  std::vector<long> tail(max_streams, -1); // last step queued on each stream
  std::vector<std::vector<long>> step_clock(n);
  int used = 1;
  for (size_t j = 0; j < n; ++j) {
    std::vector<size_t> deps;
    for (size_t i = 0; i < j; ++i)
      if (steps_conflict(steps[i], steps[j]))
        deps.push_back(i);
    // need[t]: the latest step of stream t that j's dependencies already
    // order before j. A stream whose last step is at or before it costs j no
    // false dependency: take the most recently used such stream (the one
    // whose last step j depends on, when there is one), else a fresh
    // stream, else the stream whose last step was queued earliest (likeliest
    // to have finished).
    std::vector<long> need(max_streams, -1);
    for (size_t i : deps)
      for (int t = 0; t < max_streams; ++t)
        need[t] = std::max(need[t], step_clock[i][t]);
    int s = -1;
    for (int t = 0; t < used; ++t)
      if (tail[t] <= need[t] && (s < 0 || tail[t] > tail[s]))
        s = t;
    if (s < 0 && used < max_streams)
      s = used++;
    if (s < 0) {
      s = 0;
      for (int t = 1; t < used; ++t)
        if (tail[t] < tail[s])
          s = t;
    }
    StreamPlan::Placement &p = plan.steps[j];
    p.stream = s;
    std::vector<long> &c = clock[s];
    // Latest dependency on each other stream not yet implied: wait for it.
    for (int t = 0; t < used; ++t) {
      if (t == s)
        continue;
      long latest = -1;
      for (size_t i : deps)
        if (plan.steps[i].stream == t)
          latest = std::max(latest, long(i));
      if (latest <= c[t])
        continue;
      p.waits.push_back(size_t(latest));
      plan.steps[latest].record = true;
      for (int u = 0; u < max_streams; ++u)
        c[u] = std::max(c[u], step_clock[latest][u]);
    }
    c[s] = long(j);
    tail[s] = long(j);
    step_clock[j] = c;
  }
  plan.streams = used;
  // Every other stream joins the caller's at the end, even one already
  // ordered before it: a graph capture ends only with every forked stream
  // joined back.
  for (int t = 1; t < used; ++t) {
    plan.joins.push_back(size_t(tail[t]));
    plan.steps[tail[t]].record = true;
  }
  return plan;
}

bool ordered_before(const StreamPlan &plan, size_t i, size_t j) {
  // Walk j's predecessors: the previous step on its stream and the steps it
  // waits for.
  std::vector<char> seen(plan.steps.size(), 0);
  std::vector<size_t> todo{j};
  while (!todo.empty()) {
    size_t x = todo.back();
    todo.pop_back();
    auto visit = [&](size_t y) {
      if (!seen[y]) {
        seen[y] = 1;
        todo.push_back(y);
      }
    };
    for (size_t w : plan.steps[x].waits)
      visit(w);
    for (size_t y = x; y-- > 0;)
      if (plan.steps[y].stream == plan.steps[x].stream) {
        visit(y);
        break;
      }
  }
  return seen[i] != 0;
}

StepOrder::StepOrder(const KernelProgram &p, const std::vector<size_t> &boundaries, int max_streams) {
  const size_t n = p.steps.size();
  before_.assign(n, std::vector<char>(n, 0));
  // Tensor k of the program on bytes [k, k + 1): names only, no placement yet.
  auto own_bytes = [&](const std::string &name) {
    const uint64_t k = uint64_t(p.find(name) - p.tensors.data());
    return ByteRange{k, k + 1};
  };
  std::vector<size_t> cuts{0};
  for (size_t b : boundaries)
    if (b > cuts.back() && b < n)
      cuts.push_back(b);
  cuts.push_back(n);
  for (size_t c = 0; c + 1 < cuts.size(); ++c) {
    const size_t begin = cuts[c], end = cuts[c + 1];
    StreamPlan plan = plan_streams(step_accesses(p, begin, end, own_bytes), max_streams);
    for (size_t i = begin; i < end; ++i) {
      for (size_t j = i + 1; j < end; ++j)
        before_[i][j] = ordered_before(plan, i - begin, j - begin);
      for (size_t j = end; j < n; ++j) // a later entry point starts after this one ends
        before_[i][j] = 1;
    }
  }
}

} // namespace moeforge
