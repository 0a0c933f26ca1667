#include "lowering/order_for_memory.h"

#include <algorithm>
#include <map>
#include <set>

#include "dsl/error.h"

namespace moeforge {

namespace {

int64_t estimated_extent(const DimNode *d, int64_t tokens) {
  if (d->base)
    return estimated_extent(d->base.get(), tokens) * d->factor;
  return d->extent < 0 ? tokens : d->extent;
}

size_t estimated_bytes(const TensorDecl &t, int64_t tokens) {
  size_t n = dtype_bytes(t.dtype);
  for (const Dim &d : t.dims)
    n *= static_cast<size_t>(estimated_extent(d.get(), tokens));
  return n;
}

std::vector<std::string> unique(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

// What the pass and the peak both need of a range: each step's distinct reads
// and writes, and the sizes of the tensors whose lifetimes count.
struct RangeTensors {
  std::vector<std::vector<std::string>> reads, writes;
  std::map<std::string, size_t> bytes; // only tensors whose lifetime counts
  // An output marked in place (PointwiseStep::in_place) -> the input whose
  // bytes it takes: the two are one block, live from the input's first
  // step to the output's last reader.
  std::map<std::string, std::string> alias;

  RangeTensors(const KernelProgram &p, size_t begin, size_t end, const std::vector<std::string> &kept, int64_t tokens) {
    internal_check(begin <= end && end <= p.steps.size()) << "step range out of bounds";
    const std::set<std::string> keep(kept.begin(), kept.end());
    for (size_t i = begin; i < end; ++i)
      if (const auto *pw = std::get_if<PointwiseStep>(&p.steps[i]))
        for (const auto &[out, in] : pw->in_place)
          alias[out] = in;
    for (size_t i = begin; i < end; ++i) {
      reads.push_back(unique(step_reads(p.steps[i])));
      writes.push_back(unique(step_outputs(p.steps[i])));
      for (const auto *names : {&reads.back(), &writes.back()})
        for (const std::string &n : *names) {
          const TensorDecl *t = p.find(n);
          if (t && !t->is_input && !keep.count(n) && !alias.count(n))
            bytes[n] = estimated_bytes(*t, tokens);
        }
    }
  }
  // The block tensor n lives in.
  const std::string &block_of(const std::string &n) const {
    auto it = alias.find(n);
    return it == alias.end() ? n : block_of(it->second);
  }
  size_t size_of(const std::string &n) const {
    auto it = bytes.find(n);
    return it == bytes.end() ? 0 : it->second;
  }
};

bool shares_any(const std::vector<std::string> &a, const std::vector<std::string> &b) {
  return std::any_of(a.begin(), a.end(),
                     [&](const std::string &n) { return std::binary_search(b.begin(), b.end(), n); });
}

// The peak and the sum over steps of the live bytes when the range runs in
// `order` (indices into r's steps). A tensor is live from the step writing it
// (or the range's start, when a step reads it first) to its last reader.
std::pair<size_t, size_t> live_bytes(const RangeTensors &r, const std::vector<size_t> &order) {
  std::map<std::string, std::pair<size_t, size_t>> live;
  for (size_t at = 0; at < order.size(); ++at) {
    const size_t j = order[at];
    for (const auto *names : {&r.reads[j], &r.writes[j]})
      for (const std::string &name : *names)
        if (const std::string &t = r.block_of(name); r.bytes.count(t)) {
          auto [it, fresh] = live.emplace(t, std::make_pair(names == &r.reads[j] ? 0 : at, at));
          if (!fresh)
            it->second.second = at;
        }
  }
  size_t peak = 0, area = 0;
  for (size_t at = 0; at < order.size(); ++at) {
    size_t now = 0;
    for (const auto &[t, range] : live)
      if (range.first <= at && at <= range.second)
        now += r.bytes.at(t);
    peak = std::max(peak, now);
    area += now;
  }
  return {peak, area};
}

} // namespace

void order_steps_for_memory(KernelProgram &p, size_t begin, size_t end, const std::vector<std::string> &kept,
                            int64_t tokens) {
  const RangeTensors r(p, begin, end, kept, tokens);
  const size_t n = end - begin;
  // needs[j][i]: step j must follow step i. Every pair of steps that touch a
  // common tensor with at least one writing it keeps its order.
  std::vector<std::vector<bool>> needs(n, std::vector<bool>(n, false));
  for (size_t j = 0; j < n; ++j)
    for (size_t i = 0; i < j; ++i)
      needs[j][i] = shares_any(r.writes[i], r.reads[j]) || shares_any(r.reads[i], r.writes[j]) ||
                    shares_any(r.writes[i], r.writes[j]);
  std::map<std::string, int> readers_left; // steps of the range still to read each tensor
  for (const auto &reads : r.reads)
    for (const std::string &t : reads)
      ++readers_left[t];
  std::vector<bool> done(n, false);
  std::vector<size_t> order;
  while (order.size() < n) {
    size_t best = n;
    long long best_net = 0;
    for (size_t j = 0; j < n; ++j) {
      bool ready = !done[j];
      for (size_t i = 0; i < j && ready; ++i)
        ready = !needs[j][i] || done[i];
      if (!ready)
        continue;
      long long net = 0;
      for (const std::string &t : r.writes[j])
        if (readers_left.count(t)) // a tensor no later step reads is dead as soon as it is written
          net += static_cast<long long>(r.size_of(t));
      for (const std::string &t : r.reads[j])
        if (readers_left.at(t) == 1)
          net -= static_cast<long long>(r.size_of(t));
      if (best == n || net < best_net)
        best = j, best_net = net;
    }
    internal_check(best < n) << "order_steps_for_memory: no step is ready (a dependency cycle)";
    done[best] = true;
    for (const std::string &t : r.reads[best])
      if (--readers_left.at(t) == 0)
        readers_left.erase(t);
    order.push_back(best);
  }
  // The greedy choice is short-sighted: a step that only allocates may run
  // long before its reader because every other step allocated more at that
  // moment. So each step is then moved to the place between its
  // dependencies and its dependents that lowers the peak (or, at the same
  // peak, the bytes held summed over the steps: a temporary made just before
  // its reader), until no move helps.
  auto cost = live_bytes(r, order);
  for (bool moved = true; moved;) {
    moved = false;
    for (size_t from = 0; from < n; ++from) {
      const size_t s = order[from];
      std::vector<size_t> rest = order;
      rest.erase(rest.begin() + static_cast<long>(from));
      // Legal places: after the last step s needs, before the first that needs s.
      size_t lo = 0, hi = rest.size();
      for (size_t at = 0; at < rest.size(); ++at) {
        if (needs[s][rest[at]])
          lo = at + 1;
        if (needs[rest[at]][s] && at < hi)
          hi = at;
      }
      for (size_t to = lo; to <= hi; ++to) {
        std::vector<size_t> trial = rest;
        trial.insert(trial.begin() + static_cast<long>(to), s);
        const auto c = live_bytes(r, trial);
        if (c < cost) {
          cost = c, order = trial, moved = true;
          break;
        }
      }
      if (moved)
        break;
    }
  }
  std::vector<Step> steps;
  steps.reserve(n);
  for (size_t j : order)
    steps.push_back(std::move(p.steps[begin + j]));
  std::move(steps.begin(), steps.end(), p.steps.begin() + static_cast<long>(begin));
}

size_t peak_live_bytes(const KernelProgram &p, size_t begin, size_t end, const std::vector<std::string> &kept,
                       int64_t tokens) {
  const RangeTensors r(p, begin, end, kept, tokens);
  std::vector<size_t> order(end - begin);
  for (size_t j = 0; j < order.size(); ++j)
    order[j] = j;
  return live_bytes(r, order).first;
}

} // namespace moeforge
