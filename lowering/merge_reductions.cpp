#include "lowering/merge_reductions.h"

#include "lowering/gemm_plan.h"
#include "lowering/rename_indices.h"

namespace moeforge {

namespace {

// Replaces reads of one accumulator placeholder by another's.
struct RenameAccumulator : IRMutator {
  FuncPtr from, to;
  Expr mutate_node(const Access &a, const Expr &self) override {
    return a.func == from ? Access::make(to, a.args) : self;
  }
};

// A reduction this pass may merge: one B, read in place by the
// warp-specialised loop, nothing fused or added, and both operands loaded
// by TMA as its plan has it (gemm_plan.cpp): the merged loop reads its
// second B by TMA only, and with A gathered by cp.async beside two B the
// consumers' registers run out (8 bytes spilled at d = 64).
bool mergeable(const KernelProgram &p, const GemmStep &g) {
  if (!(g.expert_k && g.operands_in_place && g.b.size() == 1 && g.accumulators.size() == 1 && g.extra.empty() &&
        !g.chained && !g.out_add && !g.windowed && !g.fp8 && !g.unfused && g.tiling.mma == MmaKind::wgmma_ws &&
        g.tiling.tma && g.tiling.tile_n >= 128 && g.tiling.tile_n % 128 == 0 && !g.tiling.narrow_tail))
    return false;
  const GemmPlan plan = plan_gemm(p, g);
  return plan.a_tma_rows() && plan.b_tma_rows();
}

bool same_shape(const TensorDecl &x, const TensorDecl &y) {
  if (x.dims.size() != y.dims.size() || x.dtype != y.dtype || x.outer_stride != y.outer_stride)
    return false;
  for (size_t i = 0; i < x.dims.size(); ++i)
    if (!x.dims[i].same_as(y.dims[i]))
      return false;
  return true;
}

bool siblings(const KernelProgram &p, const GemmStep &x, const GemmStep &y) {
  const TensorDecl &bx = p.tensor(x.b[0]), &by = p.tensor(y.b[0]);
  return x.route == y.route && x.m.same_as(y.m) && x.n.same_as(y.n) && x.k.same_as(y.k) && x.a == y.a &&
         x.a_rows == y.a_rows && x.b_rows == y.b_rows && x.block == y.block && x.tiling == y.tiling &&
         bx.layout == by.layout && bx.dtype == by.dtype && bx.zero_padding == by.zero_padding && bx.route == by.route &&
         same_shape(p.tensor(x.output), p.tensor(y.output));
}

} // namespace

size_t merge_weight_gradients(KernelProgram &p, size_t begin, size_t end) {
  size_t merged = 0;
  for (size_t i = begin; i < end; ++i) {
    auto *g = std::get_if<GemmStep>(&p.steps[i]);
    if (!g || !mergeable(p, *g))
      continue;
    for (size_t j = i + 1; j < end; ++j) {
      auto *h = std::get_if<GemmStep>(&p.steps[j]);
      if (!h || !mergeable(p, *h) || !siblings(p, *g, *h) || step_writing(p, h->b[0]) >= static_cast<long>(i))
        continue;
      RenameIndices vars;
      vars.plain_only = true;
      vars.to[h->col_var.get()] = g->col_var;
      vars.to[h->row_var.get()] = g->row_var;
      RenameAccumulator acc;
      acc.from = h->accumulators[0];
      acc.to = placeholder("acc1", {g->row_var, g->col_var}, DType::f32);
      g->b.push_back(h->b[0]);
      g->accumulators.push_back(acc.to);
      g->extra.push_back({h->output, acc.mutate(vars.mutate(h->epilogue))});
      g->name += "_" + h->output;
      g->tiling.tile_n /= 2; // each B's columns: the wgmma covers both
      p.steps.erase(p.steps.begin() + static_cast<long>(j));
      --end;
      ++merged;
      break; // two B operands at most
    }
  }
  return merged;
}

} // namespace moeforge
