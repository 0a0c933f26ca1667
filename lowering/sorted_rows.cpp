#include "lowering/sorted_rows.h"

#include <algorithm>

namespace moeforge {

namespace {

bool reads(const Step &s, const std::string &name) {
  const std::vector<std::string> r = step_reads(s);
  return std::find(r.begin(), r.end(), name) != r.end();
}

// A routed 2-D tensor the pass may re-lay: padded over a dropless route,
// its rows neither of a run-time length nor strided, not the caller's.
bool relayable(const KernelProgram &p, const TensorDecl &t) {
  return t.layout == RowLayout::padded && t.route && !p.routing(t.route).drops() && t.dims.size() == 2 && !t.stride8 &&
         t.outer_stride == 0 && !t.dims.back().is_dynamic() && !is_output(p, t.name);
}

// An expert reduction's A whose rows past an expert's pairs are zero, by
// TMA too: a padded tensor holding zeros there, in whole 64-row boxes.
// (Rows gathered through sorted_pair load as zeros there too, but that loop
// with a shifted B by TMA spilled registers: gather_in_gemms keeps the
// padded order.)
bool zero_past_pairs(const KernelProgram &p, const GemmStep &g) {
  const TensorDecl &a = p.tensor(g.a);
  return g.a_rows == RowMap::direct && a.layout == RowLayout::padded && a.zero_padding && g.block % 64 == 0;
}

// Whether every step that reads `name` reads it as a sorted tensor may be:
// element-wise steps; with `as_operand`, also a routed GEMM's A or chained
// A2 (tile order), and an expert reduction's B (tile order) over an A that
// is zero past each expert's pairs.
bool readers_allow(const KernelProgram &p, const std::string &name, bool as_operand) {
  for (const Step &s : p.steps) {
    if (!reads(s, name) || std::holds_alternative<PointwiseStep>(s))
      continue;
    const auto *g = std::get_if<GemmStep>(&s);
    if (!as_operand || !g || !g->route)
      return false;
    const bool as_a = g->a == name || (g->chained && g->chained->a == name);
    const bool as_b = std::find(g->b.begin(), g->b.end(), name) != g->b.end() || (g->chained && g->chained->b == name);
    if (g->expert_k) {
      // B by TMA (the warp-specialised loop's boxes from the shifted row),
      // as gemm_plan.cpp then plans it.
      const bool b_by_tma =
          g->operands_in_place && g->tiling.mma == MmaKind::wgmma_ws && g->tiling.tma && g->b.size() == 1;
      if (as_a || !b_by_tma || g->b_rows != RowMap::direct || p.tensor(name).dtype != DType::bf16 ||
          !zero_past_pairs(p, *g))
        return false;
    } else if (as_b || g->a_rows != RowMap::direct) {
      return false;
    }
  }
  return true;
}

// The forward routed GEMM that writes `name` in tile order with plain
// stores (its output, or a further one), or null.
const GemmStep *plain_writer(const KernelProgram &p, const std::string &name, size_t forward_steps) {
  for (size_t i = 0; i < forward_steps; ++i) {
    const auto *g = std::get_if<GemmStep>(&p.steps[i]);
    if (!g)
      continue;
    bool writes = g->output == name && g->out_rows == RowMap::direct && !g->out_add;
    for (const GemmStep::Extra &e : g->extra)
      writes |= e.output == name;
    if (writes)
      return g->route && !g->expert_k && !g->tiling.tma_store && !g->windowed ? g : nullptr;
  }
  return nullptr;
}

bool written_element_wise(const KernelProgram &p, const std::string &name) {
  const long i = step_writing(p, name);
  return i >= 0 && std::holds_alternative<PointwiseStep>(p.steps[static_cast<size_t>(i)]);
}

// An expert reduction that may read `name`, stored sorted, as its A: in
// place by TMA in the warp-specialised loop over a B stored sorted, so
// both operands' rows start at the expert's unpadded row.
bool sorted_a_reduction(const KernelProgram &p, const Step &s, const std::string &name) {
  const auto *g = std::get_if<GemmStep>(&s);
  return g && g->expert_k && g->a == name && g->a_rows == RowMap::direct && g->operands_in_place &&
         g->tiling.mma == MmaKind::wgmma_ws && g->tiling.tma && g->b.size() == 1 && !g->chained &&
         g->b_rows == RowMap::direct && g->route == p.tensor(name).route &&
         p.tensor(g->b[0]).layout == RowLayout::sorted && p.tensor(g->b[0]).route == g->route;
}

} // namespace

std::vector<std::string> store_gathers_sorted(KernelProgram &p) {
  std::vector<std::string> stored;
  for (const Step &s : p.steps) {
    const auto *gather = std::get_if<GatherStep>(&s);
    if (!gather)
      continue;
    TensorDecl *t = p.find(gather->dst);
    if (!t || !relayable(p, *t) || t->dtype != DType::bf16 || t->route != gather->route)
      continue;
    int readers = 0;
    bool all = true;
    for (const Step &r : p.steps)
      if (&r != &s && reads(r, gather->dst)) {
        ++readers;
        all &= sorted_a_reduction(p, r, gather->dst);
      }
    if (readers == 0 || !all)
      continue;
    t->layout = RowLayout::sorted;
    t->zero_padding = false;
    stored.push_back(t->name);
  }
  return stored;
}

std::vector<std::string> store_saved_sorted(KernelProgram &p, size_t forward_steps,
                                            const std::map<std::string, std::string> &over_saved) {
  std::vector<std::string> stored;
  for (const auto &[gradient, saved] : over_saved) {
    TensorDecl *s = p.find(saved), *g = p.find(gradient);
    if (!s || !g || !relayable(p, *s) || !relayable(p, *g) || s->route != g->route ||
        !plain_writer(p, saved, forward_steps) || !readers_allow(p, saved, false) ||
        !written_element_wise(p, gradient) || !readers_allow(p, gradient, true))
      continue;
    for (TensorDecl *t : {s, g}) {
      t->layout = RowLayout::sorted;
      t->zero_padding = false;
    }
    stored.push_back(saved);
  }
  return stored;
}

} // namespace moeforge
