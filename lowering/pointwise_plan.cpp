#include "lowering/pointwise_plan.h"

#include <algorithm>

#include "dsl/error.h"
#include "dsl/visitor.h"

namespace moeforge {

bool sums_over_routes_of(const Expr &e, const Var &v) {
  struct Finder : IRVisitor {
    const VarNode *v;
    bool found = false;
    void visit_node(const RouteSum &n) override {
      found |= n.target.get() == v;
      IRVisitor::visit_node(n);
    }
  } f;
  f.v = v.get();
  f.visit(e);
  return f.found;
}

bool has_long_reduction(const Expr &e) {
  struct Finder : IRVisitor {
    bool found = false;
    void visit_node(const Sum &n) override {
      found |= n.var.dim().is_dynamic() || n.var.dim().extent() >= 64;
      IRVisitor::visit_node(n);
    }
  } f;
  f.visit(e);
  return f.found;
}

namespace {

// Every output of s with its value: the step's own, then the merged ones.
struct Output {
  const TensorDecl *t;
  const Expr *value;
  bool row_sum;
};
std::vector<Output> outputs_of(const KernelProgram &prog, const PointwiseStep &s) {
  std::vector<Output> outs{{&prog.tensor(s.output), &s.body, false}};
  for (const ExtraOutput &e : s.extra)
    outs.push_back({&prog.tensor(e.output), &e.value, e.row_sum});
  return outs;
}

// Pairs in pair order keep a token's k pairs together, so its rows of the
// inputs (d_y, say) are read from cache after the first; in sorted order each
// came from DRAM again (fine64's d_o: 0.27 -> 0.43 ms): a padded-order result
// walks the pairs by slot, not the padded rows.
// Where some outputs are stored sorted (lowering/sorted_rows.h) beside a
// padded one, the walk is still the padded one's, whose padding rows it
// zeroes; the sorted outputs have none.
bool over_padded_rows(const std::vector<Output> &outs, const PointwiseStep &s) {
  const TensorDecl &out = *outs[0].t;
  const bool padded = std::any_of(outs.begin(), outs.end(), [&](const Output &o) {
    return !o.row_sum && o.t->layout == RowLayout::padded && o.t->route == out.route;
  });
  return padded && (out.layout == RowLayout::padded || out.layout == RowLayout::sorted) && s.vars.size() == 2 &&
         out.route && s.vars[0].same_as(out.route->pair);
}

// Row sums ride along element-wise values: a warp per row, its lanes along
// the row, each row's sums reduced over the warp.
PointwisePlan plan_row_sums(const KernelProgram &prog, const PointwiseStep &s) {
  const std::vector<Output> outs = outputs_of(prog, s);
  internal_check(s.vars.size() >= 2 && !s.body.as<Softmax>() && !has_long_reduction(s.body))
      << s.name << ": row sums ride along element-wise values over two or more indices";
  const Var &col = s.vars.back();
  user_check(!col.dim().is_dynamic()) << "step " << s.name << ": a row sum over " << col.name()
                                      << " needs a static row length on the CUDA backend";
  PointwisePlan p;
  p.walk = ElementWalk::warp_per_row;
  const bool vectorize = col.dim().extent() % 8 == 0 && std::all_of(outs.begin(), outs.end(), [](const Output &o) {
                           return o.row_sum || (o.t->dtype != DType::f16 && !o.t->stride8);
                         });
  p.per_thread = vectorize ? 8 : 1;
  p.padded_rows = over_padded_rows(outs, s);
  return p;
}

} // namespace

bool padded_order_serves(const PointwiseStep &s) {
  return !s.body.as<Softmax>() && !has_long_reduction(s.body) && !s.vars[1].dim().is_dynamic();
}

PointwisePlan plan_pointwise(const KernelProgram &prog, const PointwiseStep &s) {
  if (std::any_of(s.extra.begin(), s.extra.end(), [](const ExtraOutput &e) { return e.row_sum; }))
    return plan_row_sums(prog, s);
  const std::vector<Output> outs = outputs_of(prog, s);
  const TensorDecl &out = *outs[0].t;
  const Softmax *softmax = s.body.as<Softmax>();
  internal_check(s.extra.empty() || (!softmax && !has_long_reduction(s.body)))
      << s.name << ": merged element-wise steps are plain element-wise values";
  PointwisePlan p;
  p.padded_rows = over_padded_rows(outs, s) && !softmax;
  // Dot products and sums over the tokens: a warp per element (coalesced
  // reads along the reduced index, and 32x the parallelism of a thread each).
  // A softmax splits its row over the lanes itself.
  const bool warp_split = !softmax && has_long_reduction(s.body);
  // Few elements, each a long reduction (a bias's gradient, a sum over every
  // token): a block per element, or most SMs would sit idle while a warp
  // each walked its reduction.
  long long elements = 1;
  for (const Var &v : s.vars)
    if (!softmax || !v.same_as(softmax->var))
      elements = v.dim().is_dynamic() ? 1LL << 40 : elements * v.dim().extent();
  p.walk = warp_split && elements <= 4096 ? ElementWalk::block
           : softmax || warp_split        ? ElementWalk::warp
                                          : ElementWalk::thread;
  user_check(!p.padded_rows || padded_order_serves(s))
      << "definition '" << s.output << "': padded_elementwise stores it in the padded row order, which the CUDA "
      << "backend does for element-wise values over a static row length only (not reductions): drop "
      << "padded_elementwise";
  // Eight consecutive elements of the innermost index per thread, when its
  // extent is a static multiple of eight (and not a padded tensor's row
  // index): the index arithmetic (64-bit divisions, one per index) is done
  // once, reads along that index are 16-byte loads and the store one, where
  // a thread per element spent more instructions on indices than on data.
  const bool vectorize =
      p.walk == ElementWalk::thread && !s.vars.empty() && !s.vars.back().dim().is_dynamic() &&
      s.vars.back().dim().extent() % 8 == 0 &&
      std::all_of(outs.begin(), outs.end(),
                  [&](const Output &o) {
                    return o.t->dtype != DType::f16 && !o.t->stride8 && !sums_over_routes_of(*o.value, s.vars.back());
                  }) &&
      !(s.vars.size() == 1 && (out.layout == RowLayout::padded || out.layout == RowLayout::sorted));
  p.per_thread = vectorize ? 8 : 1;
  return p;
}

} // namespace moeforge
