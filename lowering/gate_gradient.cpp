#include "lowering/gate_gradient.h"

#include <algorithm>
#include <optional>
#include <set>

#include "dsl/visitor.h"
#include "lowering/rename_indices.h"

namespace moeforge {

namespace {

bool is_plain_var(const Index &i, const Var &v) { return i.is_plain() && i.var.same_as(v); }

// D(token(r), i): a read of a token-indexed matrix at pair r's token.
const Access *token_row_read(const Expr &e, const Var &r, const Var &i) {
  const Access *a = e.as<Access>();
  if (!a || a->args.size() != 2 || a->args[0].field != RouteField::token || !a->args[0].var.same_as(r) ||
      !is_plain_var(a->args[1], i))
    return nullptr;
  return a;
}

// Replaces reads of d_h(r', j') by scale(r') * u(r', j'); `failed` counts
// reads it cannot replace (not at plain indices).
struct ScaleReads : IRMutator {
  std::string d_h, u;
  DType u_dtype = DType::f32;
  Expr scale;
  Var scale_row;
  int failed = 0;
  Expr mutate_node(const Access &a, const Expr &self) override {
    if (a.target_name() != d_h)
      return IRMutator::mutate_node(a, self);
    if (a.args.size() != 2 || !a.args[0].is_plain() || !a.args[1].is_plain()) {
      ++failed;
      return self;
    }
    RenameIndices at;
    at.to[scale_row.get()] = a.args[0].var;
    return Binary::make(BinaryOp::mul, at.mutate(scale), tensor_read(u, u_dtype, a.args));
  }
};

// The pattern, found before anything changes.
struct Match {
  size_t gate = 0, dh = 0, d_o = 0; // steps: d_s's, the dH GEMM's, d_o's
  std::string dy, h;                // dy's tensor; the contraction's h (or its copy)
  Var pair;                         // d_s's row variable
  Dim reduced;                      // h's columns (j)
  Expr scale;                       // s(r), over d_o's row variable
  Var scale_row;
  Expr dy_read; // dy(token(r), i) as d_o reads it
};

std::optional<Match> find_pattern(const KernelProgram &p, size_t forward_steps,
                                  const std::map<std::string, std::string> &copies) {
  for (size_t gi = forward_steps; gi < p.steps.size(); ++gi) {
    const auto *gate = std::get_if<PointwiseStep>(&p.steps[gi]);
    if (!gate || gate->vars.size() != 1 || !gate->extra.empty())
      continue;
    const Sum *sum = gate->body.as<Sum>();
    const Binary *prod = sum ? sum->body.as<Binary>() : nullptr;
    if (!prod || prod->op != BinaryOp::mul)
      continue;
    const Var &r = gate->vars[0];
    const Access *dy = token_row_read(prod->a, r, sum->var), *o = prod->b.as<Access>();
    if (!dy) {
      dy = token_row_read(prod->b, r, sum->var);
      o = prod->a.as<Access>();
    }
    if (!dy || !o || o->args.size() != 2 || !is_plain_var(o->args[0], r) || !is_plain_var(o->args[1], sum->var))
      continue;
    // o's GEMM in the forward: o(r, i) = sum(j, h(r, j) * W(expert(r), j, i)).
    const GemmStep *fwd = nullptr;
    for (size_t i = 0; i < forward_steps; ++i)
      if (auto *g = std::get_if<GemmStep>(&p.steps[i]); g && g->output == o->target_name())
        fwd = g;
    if (!fwd || !fwd->route || fwd->expert_k || fwd->b.size() != 1 || !fwd->b_per_expert || fwd->b_trans ||
        fwd->a_trans || !stores_plain_accumulator(*fwd))
      continue;
    const TensorDecl *h = p.find(fwd->a);
    if (!h || h->route != fwd->route || h->dims.size() != 2) // h must be indexed by the pair
      continue;
    // The dH GEMM in the backward: d_h(r, j) = sum(i, d_o(r, i) * W(expert(r), j, i)),
    // with d_o(r, i) = s(r) * dy(token(r), i).
    for (size_t di = forward_steps; di < p.steps.size(); ++di) {
      const auto *dh = std::get_if<GemmStep>(&p.steps[di]);
      if (!dh || dh->route != fwd->route || dh->expert_k || dh->b != fwd->b || !dh->b_per_expert || !dh->b_trans ||
          dh->a_trans || !dh->extra.empty() || !stores_plain_accumulator(*dh))
        continue;
      for (size_t oi = forward_steps; oi < di; ++oi) {
        const auto *d_o = std::get_if<PointwiseStep>(&p.steps[oi]);
        if (!d_o || d_o->output != dh->a || d_o->vars.size() != 2 || !d_o->extra.empty())
          continue;
        const Binary *scaled = d_o->body.as<Binary>();
        if (!scaled || scaled->op != BinaryOp::mul)
          continue;
        const Var &row = d_o->vars[0], &col = d_o->vars[1];
        Expr dy_read = scaled->b, scale = scaled->a;
        if (!token_row_read(dy_read, row, col)) {
          std::swap(dy_read, scale);
          if (!token_row_read(dy_read, row, col))
            continue;
        }
        if (dy_read.as<Access>()->target_name() != dy->target_name() || uses_var(scale, col))
          continue;
        // Every reader of d_h must be element-wise, at plain indices.
        bool readers_ok = true;
        for (size_t si = forward_steps; si < p.steps.size(); ++si) {
          if (si == di)
            continue;
          const auto reads = step_reads(p.steps[si]);
          if (std::find(reads.begin(), reads.end(), dh->output) != reads.end())
            readers_ok &= std::holds_alternative<PointwiseStep>(p.steps[si]);
        }
        if (!readers_ok)
          continue;
        auto copy = copies.find(fwd->a);
        return Match{gi,    di,  oi,     dy->target_name(), copy == copies.end() ? fwd->a : copy->second, r, fwd->k,
                     scale, row, dy_read};
      }
    }
  }
  return std::nullopt;
}

// Under recompute_elementwise, h is made again in the backward anyway: the
// weight gradient dW2 = sum over r of h(r)^T d_o(r), with d_o = s(r) dy's
// rows, reads s(r) * h (made in the same kernel as h, which
// merge_sibling_pointwise puts together) against dy's rows as the dH GEMM
// reads them (its per-pair copy, or dy gathered by token): d_o (T*k x d) is
// then not made at all. Returns
// whether d_o's step went.
bool scale_made_again_h(KernelProgram &p, size_t forward_steps, const Match &m, const std::string &d_o,
                        const std::string &dy_rows) {
  size_t reduction = p.steps.size(), readers = 0;
  for (size_t i = forward_steps; i < p.steps.size(); ++i) {
    const std::vector<std::string> reads = step_reads(p.steps[i]);
    if (std::find(reads.begin(), reads.end(), d_o) == reads.end())
      continue;
    ++readers;
    if (auto *g = std::get_if<GemmStep>(&p.steps[i]);
        g && g->expert_k && g->b == std::vector<std::string>{d_o} && g->a == m.h && !g->a_trans)
      reduction = i;
  }
  if (reduction == p.steps.size() || readers != 1)
    return false;
  auto &dw = std::get<GemmStep>(p.steps[reduction]);
  TensorDecl scaled = p.tensor(m.h);
  scaled.name = m.h + "_gated";
  p.tensors.push_back(scaled);
  const Var j("j", m.reduced);
  PointwiseStep make{"pointwise_" + scaled.name,
                     scaled.name,
                     {m.scale_row, j},
                     Binary::make(BinaryOp::mul, m.scale, tensor_read(m.h, p.tensor(m.h).dtype, {m.scale_row, j})),
                     {},
                     {}};
  dw.a = scaled.name;
  dw.b = {dy_rows};
  // dy itself, not its per-pair copy: the reduction gathers its rows by token.
  if (p.tensor(dy_rows).layout == RowLayout::dense)
    dw.b_rows = RowMap::gather_token;
  p.steps.insert(p.steps.begin() + static_cast<long>(reduction), std::move(make));
  p.steps.erase(std::remove_if(p.steps.begin() + static_cast<long>(forward_steps), p.steps.end(),
                               [&](const Step &s) { return step_output(s) == d_o; }),
                p.steps.end());
  return true;
}

} // namespace

bool gate_gradient_from_dh(KernelProgram &p, size_t forward_steps, const Schedule &schedule,
                           const std::map<std::string, std::string> &copies) {
  std::optional<Match> m = find_pattern(p, forward_steps, copies);
  if (!m)
    return false;
  const std::string d_h = std::get<GemmStep>(p.steps[m->dh]).output;
  const std::string u = d_h + "_ungated";
  TensorDecl u_decl = p.tensor(d_h);
  u_decl.name = u;
  p.tensors.push_back(u_decl);

  // The element-wise readers of d_h read s(r) * u instead; if one cannot,
  // nothing changes (the match checked the readers' kinds, not their indices).
  std::vector<Step> steps = p.steps;
  ScaleReads scale;
  scale.d_h = d_h;
  scale.u = u;
  scale.u_dtype = u_decl.dtype;
  scale.scale = m->scale;
  scale.scale_row = m->scale_row;
  for (size_t i = forward_steps; i < steps.size(); ++i)
    if (auto *pw = std::get_if<PointwiseStep>(&steps[i])) {
      pw->body = scale.mutate(pw->body);
      for (ExtraOutput &e : pw->extra)
        e.value = scale.mutate(e.value);
    }
  if (scale.failed) {
    p.tensors.pop_back();
    return false;
  }

  // d_s(r) = sum(j, h(r, j) * u(r, j)).
  auto &gate = std::get<PointwiseStep>(steps[m->gate]);
  const Var j("j", m->reduced);
  gate.body = Sum::make(j, Binary::make(BinaryOp::mul, tensor_read(m->h, p.tensor(m->h).dtype, {m->pair, j}),
                                        tensor_read(u, u_decl.dtype, {m->pair, j})));

  // The dH GEMM computes u from dy's rows: from a per-pair copy of them made
  // beside d_o (one kernel once merge_sibling_pointwise has run), laid out as
  // d_o is; or, where the schedule gathers rows inside GEMMs and d_o is not
  // in the padded order, gathered by token in the GEMM (dy converted to bf16
  // once, T x d, as a GEMM reads bf16). Not under padded_elementwise: the
  // copy is then read by TMA, and a gathered A cost mixtral's dH GEMM 0.3 ms
  // (H200) against 0.04 ms for writing the copy, unless the schedule asks
  // for the memory back (gather_in_gemms, gather_upstream_in_gemms).
  auto &dh = std::get<GemmStep>(steps[m->dh]);
  dh.output = u;
  const std::string d_o_name = dh.a;
  std::optional<std::pair<size_t, PointwiseStep>> insert; // a step before step `first`
  const TensorDecl &dy = p.tensor(m->dy);
  if (schedule.permutation() == Permutation::scattered &&
      (!schedule.padded_elementwise() || schedule.gather_in_gemms() || schedule.gather_upstream_in_gemms())) {
    std::string rows = m->dy;
    if (dy.dtype != DType::bf16) {
      TensorDecl bf16 = dy;
      bf16.name = m->dy + "_bf16";
      bf16.dtype = DType::bf16;
      bf16.is_input = false;
      rows = bf16.name;
      p.tensors.push_back(bf16);
      const Var t("t", dy.dims[0]), i("i", dy.dims[1]);
      insert.emplace(m->dh,
                     PointwiseStep{"pointwise_" + rows, rows, {t, i}, tensor_read(m->dy, dy.dtype, {t, i}), {}, {}});
    }
    dh.a = rows;
    dh.a_rows = RowMap::gather_token;
  } else {
    const auto &d_o = std::get<PointwiseStep>(steps[m->d_o]);
    TensorDecl rows = p.tensor(d_o.output);
    rows.name = m->dy + "_rows";
    p.tensors.push_back(rows);
    dh.a = rows.name;
    insert.emplace(m->d_o, PointwiseStep{"pointwise_" + rows.name, rows.name, d_o.vars, m->dy_read, {}, {}});
  }
  const std::string rows = dh.a; // dy's copy, or dy in bf16 (gathered)
  if (insert)
    steps.insert(steps.begin() + static_cast<long>(insert->first), std::move(insert->second));
  p.steps = std::move(steps);
  std::set<std::string> gone{d_h};
  if (schedule.recompute_elementwise() && !schedule.recompute() &&
      scale_made_again_h(p, forward_steps, *m, d_o_name, rows))
    gone.insert(d_o_name);
  p.tensors.erase(
      std::remove_if(p.tensors.begin(), p.tensors.end(), [&](const TensorDecl &t) { return gone.count(t.name) > 0; }),
      p.tensors.end());
  return true;
}

} // namespace moeforge
