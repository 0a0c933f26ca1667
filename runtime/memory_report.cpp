#include "runtime/memory_report.h"

#include <algorithm>
#include <iomanip>
#include <sstream>
#include <vector>

#include "runtime/program_shapes.h"

namespace moeforge {

namespace {

std::string mib(size_t bytes) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(1) << double(bytes) / double(1 << 20) << " MiB";
  return os.str();
}

struct Live {
  std::string name;
  size_t bytes;
};

// The step of [from, to] whose live workspace tensors take the most bytes
// (a tensor written over another's bytes counts once), and those tensors,
// largest first.
std::pair<size_t, std::vector<Live>> fullest_step(const MemoryPlan &w, size_t from, size_t to) {
  size_t best_step = from, best_bytes = 0;
  std::vector<Live> best;
  for (size_t s = from; s < to; ++s) {
    std::vector<Live> live;
    size_t total = 0;
    auto live_at = [&](const std::string &name) {
      const auto &span = w.live.at(name);
      return span.first <= s && s <= span.second;
    };
    for (const auto &[name, span] : w.live) {
      // An output written over an input's bytes counts where the input is
      // no longer live: the block is then the output's.
      auto over = w.written_over.find(name);
      if (!live_at(name) || w.size.at(name) == 0 || (over != w.written_over.end() && live_at(over->second)))
        continue;
      live.push_back({name, w.size.at(name)});
      total += w.size.at(name);
    }
    if (total > best_bytes) {
      best_step = s, best_bytes = total;
      best = std::move(live);
    }
  }
  std::sort(best.begin(), best.end(), [](const Live &a, const Live &b) { return a.bytes > b.bytes; });
  return {best_step, best};
}

void print_part(std::ostream &os, const KernelProgram &p, const MemoryPlan &w, const char *what, size_t touched,
                size_t from, size_t to) {
  os << what << " workspace  " << mib(touched) << "\n";
  if (from >= to)
    return;
  auto [step, live] = fullest_step(w, from, to);
  os << "  fullest at step " << step << " (" << step_name(p.steps[step]) << "):";
  for (const Live &l : live)
    os << " " << l.name << " " << mib(l.bytes);
  os << "\n";
}

} // namespace

std::string memory_report(const KernelProgram &p, size_t boundary, int64_t tokens) {
  const ProgramShapes shapes(p, tokens);
  auto bytes = [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); };
  const StepMemoryPlan plan = plan_step_memory(p, bytes, boundary);
  std::ostringstream os;
  os << "memory at " << tokens << " tokens, as the program places it (its inputs, outputs and gradients are the "
     << "caller's tensors; the caller keeps the saved activations in one part, the small saved values and each route's "
     << "tables in another)\n";
  if (boundary < p.steps.size()) {
    os << "saved      " << mib(plan.saved.arena_bytes) << " (kept from a forward to the end of its backward)\n";
    std::vector<Live> saved;
    for (const auto &[name, size] : plan.saved.size)
      if (!plan.saved.written_over.count(name))
        saved.push_back({name, size});
    std::sort(saved.begin(), saved.end(), [](const Live &a, const Live &b) { return a.bytes > b.bytes; });
    for (const Live &l : saved) {
      os << "  " << std::left << std::setw(24) << l.name << " " << mib(l.bytes);
      // The backward outputs that take its bytes once it is read last.
      for (const auto &[out, in] : plan.saved.written_over)
        if (in == l.name)
          os << ", then " << out;
      os << "\n";
    }
  }
  print_part(os, p, plan.workspace, "forward ", plan.workspace_before, 0, std::min(boundary, p.steps.size()));
  if (boundary < p.steps.size())
    print_part(os, p, plan.workspace, "backward", plan.workspace_after, boundary, p.steps.size());
  for (const auto &[in, where] : plan.in_output) {
    os << "in an output's memory: " << in << " " << mib(bytes(p.tensor(in))) << " (in " << where.output << "'s";
    if (where.scratch)
      os << " at " << mib(where.offset) << ", before " << where.output << " is written)\n";
    else
      os << ", until " << where.output << " is written over it)\n";
  }
  return os.str();
}

} // namespace moeforge
