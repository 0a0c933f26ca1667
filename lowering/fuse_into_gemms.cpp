#include "lowering/fuse_into_gemms.h"

#include <algorithm>
#include <map>
#include <optional>

#include "dsl/ops.h"
#include "dsl/printer.h"
#include "dsl/visitor.h"
#include "lowering/rename_indices.h"

namespace moeforge {

namespace {

// Renames plain index variables (a route's pair variable is never renamed:
// the consumer and the GEMM share it).
struct RenameVars : RenameIndices {
  RenameVars() { plain_only = true; }
};

// Replaces reads of each named tensor at exactly (row, col) by its value;
// counts others.
struct Substitute : IRMutator {
  std::map<std::string, Expr> values;
  Var row, col;
  int other_reads = 0;
  Expr mutate_node(const Access &a, const Expr &self) override {
    auto it = values.find(a.target_name());
    if (it == values.end())
      return self;
    if (a.args.size() == 2 && a.args[0].is_plain() && a.args[0].var.same_as(row) && a.args[1].is_plain() &&
        a.args[1].var.same_as(col))
      return it->second;
    ++other_reads;
    return self;
  }
};

// Replaces reads of one accumulator placeholder by another's.
struct RenameAccumulator : IRMutator {
  FuncPtr from, to;
  Expr mutate_node(const Access &a, const Expr &self) override {
    return a.func == from ? Access::make(to, a.args) : self;
  }
};

// combine(route, t, body) over a route with k = 1 sums the one pair r = t of
// each token: it is `body` itself, written at row r. Inlines every such
// combine of `g`'s route into its body and renames t to r, so the result
// reads like an element-wise step over (r, col). For k > 1 a token's k pairs
// sit in different GEMM tiles, so no epilogue sees the whole sum (it would
// need atomics, and lose determinism): those combines are left alone.
struct InlineSinglePairCombine : IRMutator {
  const RoutingNode *route = nullptr;
  Var token;
  bool ok = true; // false: a sum over pairs that is not such a combine
  Expr mutate_node(const RouteSum &n, const Expr &self) override {
    if (n.route.get() != route || route->k != 1 || n.field != RouteField::token || !n.target.same_as(token)) {
      ok = false;
      return self;
    }
    return mutate(n.body);
  }
};

// The body of an element-wise step (t, col) made of k = 1 combines over the
// routed GEMM g's pairs, as an expression over g's (pair, col); nullopt when
// it is not one.
std::optional<Expr> single_pair_combine(const PointwiseStep &pw, const GemmStep &g) {
  const RoutingNode *r = g.route;
  if (!r || g.expert_k || r->k != 1 || !g.row_var.same_as(r->pair) || !pw.vars[0].dim().same_as(r->token_dim()))
    return std::nullopt;
  InlineSinglePairCombine inline_combines;
  inline_combines.route = r;
  inline_combines.token = pw.vars[0];
  Expr body = inline_combines.mutate(pw.body);
  if (!inline_combines.ok || contains_kind(body, ExprKind::RouteSum))
    return std::nullopt;
  RenameVars to_pair; // other reads at token t read at r: the same row when k = 1
  to_pair.to[pw.vars[0].get()] = r->pair;
  return to_pair.mutate(body);
}

// The row map of a GEMM's primary output: tile order for dense GEMMs and
// padded tensors, pair r otherwise (pair order, or a token's row when k = 1).
RowMap output_rows(const GemmStep &g, const TensorDecl &t) {
  return g.route && t.layout != RowLayout::padded ? RowMap::gather_pair : RowMap::direct;
}

} // namespace

size_t merge_sibling_gemms(KernelProgram &p, size_t begin, size_t end) {
  auto producer = [&](const std::string &name) { return step_writing(p, name); };
  auto siblings = [](const GemmStep &x, const GemmStep &y) {
    return x.route == y.route && x.m.same_as(y.m) && x.n.same_as(y.n) && x.k.same_as(y.k) && x.a == y.a &&
           x.a_rows == y.a_rows && x.a_trans == y.a_trans && x.b_per_expert == y.b_per_expert &&
           x.b_trans == y.b_trans && !x.expert_k && !y.expert_k && !x.operands_in_place && !y.operands_in_place &&
           x.out_rows == y.out_rows && x.block == y.block && x.tiling == y.tiling && y.b.size() == 1 &&
           y.accumulators.size() == 1 && !x.unfused && !y.unfused;
  };
  for (size_t i = begin; i < end; ++i) {
    auto *g = std::get_if<GemmStep>(&p.steps[i]);
    if (!g)
      continue;
    for (size_t j = i + 1; j < end; ++j) {
      auto *h = std::get_if<GemmStep>(&p.steps[j]);
      // The merged GEMM holds one accumulator per B: wgmma's registers allow
      // tile_n / 2 of them per thread and B (at most 128).
      const int nb = static_cast<int>(g->b.size()) + 1;
      const bool fits = g->tiling.mma == MmaKind::mma_sync || nb * g->tiling.tile_n / 2 <= 128;
      if (!h || !siblings(*g, *h) || !fits || producer(h->b[0]) >= static_cast<long>(i))
        continue;
      RenameVars vars;
      vars.to[h->col_var.get()] = g->col_var;
      if (!g->route)
        vars.to[h->row_var.get()] = g->row_var;
      RenameAccumulator acc;
      acc.from = h->accumulators[0];
      acc.to = placeholder("acc" + std::to_string(g->accumulators.size()), {g->row_var, g->col_var}, DType::f32);
      auto moved = [&](const Expr &e) { return acc.mutate(vars.mutate(e)); };
      g->b.push_back(h->b[0]);
      g->accumulators.push_back(acc.to);
      g->extra.push_back({h->output, moved(h->epilogue)});
      for (const GemmStep::Extra &e : h->extra)
        g->extra.push_back({e.output, moved(e.value)});
      g->name += "_" + h->output;
      p.steps.erase(p.steps.begin() + static_cast<long>(j));
      --j;
      --end;
    }
  }
  return end;
}

namespace {

// The latest GEMM of steps [begin, i) whose output step i reads (`reads`,
// step_reads of step i); -1 for none.
long latest_gemm_read_by(const KernelProgram &p, size_t begin, size_t i, const std::vector<std::string> &reads) {
  long j = -1;
  for (const std::string &r : reads) {
    long k = step_writing(p, r);
    if (k >= static_cast<long>(begin) && k < static_cast<long>(i) && std::holds_alternative<GemmStep>(p.steps[k]))
      j = std::max(j, k);
  }
  return j;
}

// `body` as g's epilogue computes it: its index variables renamed by
// `rename` to g's (row, col), and its reads of g's outputs (the primary and
// the fused ones) there replaced by their values; nullopt where it reads
// them anywhere else.
std::optional<Expr> in_epilogue(const GemmStep &g, const Expr &body, const RenameVars &rename) {
  Substitute sub;
  sub.values[g.output] = g.epilogue;
  for (const GemmStep::Extra &e : g.extra)
    sub.values[e.output] = e.value;
  sub.row = g.row_var;
  sub.col = g.col_var;
  RenameVars r = rename;
  Expr value = sub.mutate(r.mutate(body));
  if (sub.other_reads)
    return std::nullopt;
  return value;
}

} // namespace

size_t fuse_elementwise_consumers(KernelProgram &p, size_t begin, size_t end, const Schedule &schedule) {
  auto producer = [&](const std::string &name) { return step_writing(p, name); };
  for (size_t i = begin; i < end; ++i) {
    auto *pw = std::get_if<PointwiseStep>(&p.steps[i]);
    if (!pw || pw->vars.size() != 2 || contains_kind(pw->body, ExprKind::Sum) ||
        contains_kind(pw->body, ExprKind::Softmax) || !schedule.for_func(pw->output).fuse_epilogue)
      continue; // fuse_epilogue(f, false) keeps f's own step too (split_unfused_epilogues made it)
    // The latest GEMM of this part whose output the step reads.
    const std::vector<std::string> reads = step_reads(p.steps[i]);
    const long j = latest_gemm_read_by(p, begin, i, reads);
    if (j < 0)
      continue;
    GemmStep &g = std::get<GemmStep>(p.steps[j]);
    const Var &v0 = pw->vars[0], &v1 = pw->vars[1];
    Expr body = pw->body;
    bool rows_match = false;
    if (contains_kind(body, ExprKind::RouteSum)) {
      std::optional<Expr> combine = single_pair_combine(*pw, g);
      rows_match = combine.has_value();
      body = combine.value_or(body);
    } else {
      bool v0_routed =
          std::any_of(p.routes.begin(), p.routes.end(), [&](const RoutingNode *r) { return r->pair.same_as(v0); });
      rows_match = g.route ? v0.same_as(g.row_var) : (!v0_routed && v0.dim().same_as(g.m));
    }
    if (g.expert_k || !rows_match || !v1.dim().same_as(g.n) || !schedule.for_func(g.output).fuse_epilogue)
      continue;
    // Every other read must be ready when the GEMM runs; reads of the
    // GEMM's own outputs (its output and the fused ones) become their values.
    bool ready = true;
    for (const std::string &r : reads)
      ready &= producer(r) <= j;
    if (!ready)
      continue;
    RenameVars rename;
    rename.to[v1.get()] = g.col_var;
    if (!g.route)
      rename.to[v0.get()] = g.row_var;
    std::optional<Expr> value = in_epilogue(g, body, rename);
    if (!value)
      continue; // reads the GEMM's output elsewhere than its own element
    g.extra.push_back({pw->output, *value});
    // A padded output keeps its zero padding when the epilogue writes whole
    // routing blocks, a tile each (its rows past the block's pairs as zeros);
    // tiles that split a block, or clusters (whose idle partner would zero
    // the other block's rows), leave padding rows unwritten.
    TensorDecl &fused = *p.find(pw->output);
    fused.zero_padding &= g.route && g.block == g.tiling.tile_m && g.tiling.cluster_m == 1;
    p.steps.erase(p.steps.begin() + static_cast<long>(i));
    --i;
    --end;
  }
  // A fused output no step reads and the caller does not want is not stored
  // (its value lives on in the outputs it was substituted into).
  for (size_t k = begin; k < end; ++k) {
    auto *g = std::get_if<GemmStep>(&p.steps[k]);
    if (!g)
      continue;
    for (size_t e = 0; e < g->extra.size();) {
      if (!unwanted(p, g->extra[e].output)) {
        ++e;
        continue;
      }
      erase_tensor(p, g->extra[e].output);
      g->extra.erase(g->extra.begin() + static_cast<long>(e));
    }
  }
  // A GEMM output no step reads and the caller does not want is not stored:
  // its first extra output becomes the primary one.
  for (size_t k = begin; k < end; ++k) {
    auto *g = std::get_if<GemmStep>(&p.steps[k]);
    if (!g || g->extra.empty() || !unwanted(p, g->output))
      continue;
    erase_tensor(p, g->output);
    g->output = g->extra.front().output;
    g->epilogue = g->extra.front().value;
    g->extra.erase(g->extra.begin());
    g->out_rows = output_rows(*g, p.tensor(g->output));
  }
  return end;
}

const char *const kAtomicCombineNotApplied =
    "atomic_combine(true) is not applied: no combine over k > 1 pairs is the only reader of a routed GEMM's "
    "output (a k = 1 combine is a store in the epilogue already; a training backward that reads the expert "
    "outputs keeps them: gate_gradient_from_dh(true) on the wgmma loops takes the gate's gradient from h "
    "instead)";

namespace {

// The step of the dense GEMM whose output `e` reads as it is, w(t, col) at
// the combine step's own indices, when that GEMM stores its accumulator
// plainly in y's dtype and shape and step i is w's only reader; else -1.
// That GEMM can then write y itself, and the combine's adds land on it.
long dense_gemm_onto(const KernelProgram &p, size_t i, const Expr &e, const PointwiseStep &pw) {
  const auto *a = e.as<Access>();
  if (!a || a->args.size() != 2 || !a->args[0].is_plain() || !a->args[1].is_plain() ||
      !a->args[0].var.same_as(pw.vars[0]) || !a->args[1].var.same_as(pw.vars[1]))
    return -1;
  const std::string w = a->target_name();
  const long k = step_writing(p, w);
  const auto *g = k >= 0 ? std::get_if<GemmStep>(&p.steps[k]) : nullptr;
  if (!g || g->route || g->out_add || !g->extra.empty() || g->output != w || is_output(p, w) ||
      !stores_plain_accumulator(*g) || reads_of(p, w) != 1)
    return -1;
  const TensorDecl &wt = p.tensor(w), &yt = p.tensor(pw.output);
  if (wt.dtype != yt.dtype || wt.dims != yt.dims || wt.layout != RowLayout::dense || wt.stride8 != yt.stride8 ||
      wt.outer_stride != yt.outer_stride)
    return -1;
  for (size_t s = 0; s < p.steps.size(); ++s)
    if (s != i && s != static_cast<size_t>(k))
      for (const std::string &o : step_outputs(p.steps[s]))
        if (o == pw.output)
          return -1;
  return k;
}

} // namespace

size_t fuse_atomic_combines(KernelProgram &p, size_t begin, size_t end) {
  auto producer = [&](const std::string &name) { return step_writing(p, name); };
  for (size_t i = begin; i < end; ++i) {
    auto *pw = std::get_if<PointwiseStep>(&p.steps[i]);
    // y(t, col) = combine(route, t, v(r, col)), the whole body, or plus a
    // dense GEMM's output w(t, col) (a training backward's input gradient:
    // the experts' share and the router's): v must not read at t itself
    // (only at the pair), since the epilogue has r alone.
    long onto = -1; // the dense GEMM w's, which then writes y for the adds to land on
    Expr combine = pw ? pw->body : Expr();
    if (pw && !combine.as<RouteSum>())
      if (const auto *add = pw->body.as<Binary>(); add && add->op == BinaryOp::add)
        for (const auto &[sum, other] : {std::pair{add->a, add->b}, std::pair{add->b, add->a}})
          if (sum.as<RouteSum>() && (onto = dense_gemm_onto(p, i, other, *pw)) >= 0) {
            combine = sum;
            break;
          }
    const RouteSum *rs = pw ? combine.as<RouteSum>() : nullptr;
    if (!rs || pw->vars.size() != 2 || !pw->extra.empty() || rs->field != RouteField::token ||
        !rs->target.same_as(pw->vars[0]) || rs->route->k == 1 || uses_var(rs->body, pw->vars[0]))
      continue;
    const RoutingNode *r = rs->route.get();
    // The routed GEMM whose output the combine sums: the latest the sum reads.
    const std::vector<std::string> reads = step_reads(PointwiseStep{"", pw->output, pw->vars, combine, {}, {}});
    long j = latest_gemm_read_by(p, begin, i, reads);
    if (j < 0)
      continue;
    {
      const GemmStep &g = std::get<GemmStep>(p.steps[j]);
      if (g.route != r || g.expert_k || g.windowed || !g.row_var.same_as(r->pair) || !pw->vars[1].dim().same_as(g.n) ||
          is_output(p, g.output))
        continue;
    }
    // The combine must be the GEMM output's only reader (it is not stored
    // any more), and everything else it reads ready when the GEMM runs.
    bool ok = true;
    for (size_t k = 0; k < p.steps.size(); ++k)
      for (const std::string &name : step_reads(p.steps[k]))
        ok &= k == i || name != std::get<GemmStep>(p.steps[j]).output;
    for (const std::string &name : reads)
      ok &= producer(name) <= j;
    // w is written before the adds: its GEMM moves ahead of the routed one
    // when what it reads is ready by then (nothing between reads w).
    if (onto > j)
      for (const std::string &name : step_reads(p.steps[onto]))
        ok &= producer(name) < j;
    if (!ok)
      continue;
    if (onto > j) {
      Step moved = std::move(p.steps[onto]);
      p.steps.erase(p.steps.begin() + onto);
      p.steps.insert(p.steps.begin() + j, std::move(moved));
      onto = j++;
    }
    GemmStep &g = std::get<GemmStep>(p.steps[j]);
    RenameVars rename;
    rename.to[pw->vars[1].get()] = g.col_var;
    std::optional<Expr> value = in_epilogue(g, rs->body, rename);
    if (!value)
      continue;
    erase_tensor(p, g.output);
    g.output = pw->output;
    g.epilogue = *value;
    g.out_rows = RowMap::gather_token;
    g.out_add = true;
    if (onto >= 0) {
      auto &w = std::get<GemmStep>(p.steps[onto]);
      erase_tensor(p, w.output);
      w.output = pw->output;
      g.out_add_onto_written = true;
    }
    p.steps.erase(p.steps.begin() + static_cast<long>(i));
    --i;
    --end;
  }
  return end;
}

} // namespace moeforge
