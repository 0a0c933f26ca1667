#include "lowering/pair_order.h"

#include <algorithm>
#include <map>

namespace moeforge {

namespace {

// Who reads a tensor: a step at or after `boundary`, and a step that is no
// element-wise one (a GEMM loads its rows in tile order).
struct Readers {
  bool after = false, by_gemm = false;
};

Readers readers_of(const KernelProgram &p, const std::string &name, size_t boundary) {
  Readers r;
  for (size_t i = 0; i < p.steps.size(); ++i) {
    const std::vector<std::string> reads = step_reads(p.steps[i]);
    if (std::find(reads.begin(), reads.end(), name) == reads.end())
      continue;
    r.after |= i >= boundary;
    r.by_gemm |= !std::holds_alternative<PointwiseStep>(p.steps[i]);
  }
  return r;
}

// Rows a routed GEMM's epilogue may store in the pair order: one row at a
// time (no TMA tile, no atomic add onto token rows), over the route's own
// tiles (not an expert reduction, whose output is per expert, nor a window
// of them).
bool stores_rows(const GemmStep &g) {
  return g.route && !g.expert_k && !g.tiling.tma_store && !g.out_add && !g.windowed && g.out_rows == RowMap::direct;
}

void store_in_pair_order(TensorDecl &t, GemmStep &writer) {
  t.layout = RowLayout::pair;
  t.zero_padding = false;
  if (writer.output == t.name)
    writer.out_rows = RowMap::gather_pair; // the epilogue stores row sorted_pair[p]
}

} // namespace

std::vector<std::string> save_in_pair_order(KernelProgram &p, size_t forward_steps,
                                            const std::function<bool(const std::string &)> &store) {
  std::map<std::string, GemmStep *> writer; // a forward routed GEMM's outputs and further outputs
  for (size_t i = 0; i < forward_steps; ++i)
    if (auto *g = std::get_if<GemmStep>(&p.steps[i]);
        g && g->route && !g->expert_k && !g->tiling.tma_store && !g->extra.empty()) {
      writer[g->output] = g;
      for (const GemmStep::Extra &e : g->extra)
        writer[e.output] = g;
    }
  std::vector<std::string> candidates;
  for (TensorDecl &t : p.tensors) {
    auto w = writer.find(t.name);
    if (t.layout != RowLayout::padded || !t.route || w == writer.end() || p.routing(t.route).drops())
      continue;
    const Readers r = readers_of(p, t.name, forward_steps);
    if (!r.after || r.by_gemm)
      continue;
    candidates.push_back(t.name);
    if (!store(t.name))
      continue;
    store_in_pair_order(t, *w->second);
  }
  return candidates;
}

void backward_rows_in_pair_order(KernelProgram &p, size_t forward_steps) {
  for (size_t i = forward_steps; i < p.steps.size(); ++i) {
    auto *g = std::get_if<GemmStep>(&p.steps[i]);
    if (!g || !stores_rows(*g) || !g->extra.empty())
      continue;
    TensorDecl *t = p.find(g->output);
    // Rows of a run-time length (attention's scores) keep the padded order:
    // pad_dynamic_rows gives them a padded stride, which the pair order's
    // stores and reads are not written for.
    if (!t || t->layout != RowLayout::padded || t->route != g->route || t->stride8 || t->dims.size() != 2 ||
        t->dims.back().is_dynamic() || is_output(p, t->name) || p.routing(t->route).drops())
      continue;
    const Readers r = readers_of(p, t->name, forward_steps);
    if (!r.after || r.by_gemm)
      continue;
    store_in_pair_order(*t, *g);
  }
}

} // namespace moeforge
