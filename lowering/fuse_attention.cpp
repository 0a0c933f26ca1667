#include "lowering/fuse_attention.h"

#include <algorithm>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace moeforge {

const char *const kFusedAttentionNotApplied =
    "fused_attention(true) is not applied: this layer has no softmax over the tokens between two contractions whose "
    "scores and probabilities nothing else reads (in training: nothing but the backward's steps from them to the "
    "query's, key's and value's gradients)";

namespace {

bool plain_at(const Index &x, const Var &v) { return x.is_plain() && x.var.same_as(v); }

// p(r, u) = softmax(u, S(r, u) * c) (or c * S, or S alone): S's name and c.
bool scaled_scores(const PointwiseStep &pw, std::string &scores, double &scale) {
  if (pw.vars.size() != 2 || !pw.extra.empty() || !pw.in_place.empty())
    return false;
  const Softmax *sm = pw.body.as<Softmax>();
  if (!sm || !sm->var.same_as(pw.vars[1]))
    return false;
  const Access *s = sm->body.as<Access>();
  scale = 1;
  if (const Binary *b = sm->body.as<Binary>(); b && b->op == BinaryOp::mul) {
    const Const *c = b->b.as<Const>() ? b->b.as<Const>() : b->a.as<Const>();
    s = b->b.as<Const>() ? b->a.as<Access>() : b->b.as<Access>();
    if (!c)
      return false;
    scale = c->value;
  }
  if (!s || s->args.size() != 2 || !plain_at(s->args[0], pw.vars[0]) || !plain_at(s->args[1], pw.vars[1]))
    return false;
  scores = s->target_name();
  return true;
}

// A GEMM that stores its one accumulator as it is. How it maps its rows
// (the scores' and p's orders) does not matter: the fused step computes
// each row of the output from the same pair's row of q, which lie in one
// order (checked below).
bool plain_gemm(const GemmStep &g) {
  return g.b.size() == 1 && !g.expert_k && !g.a_trans && !g.b_per_expert && g.extra.empty() && !g.chained &&
         !g.out_add && !g.windowed && !g.fp8 && stores_plain_accumulator(g);
}

// Dense [T, F] rows over the token dim `t`.
bool dense_over(const TensorDecl *t, const Dim &tokens) {
  return t && t->layout == RowLayout::dense && !t->stride8 && t->outer_stride == 0 && t->dims.size() == 2 &&
         t->dims[0].same_as(tokens) && !t->dims[1].is_dynamic();
}

// A row tensor of the step: 2-D, its columns static, stored plainly.
bool plain_rows(const TensorDecl *t) {
  return t && t->dims.size() == 2 && !t->stride8 && t->outer_stride == 0 && !t->dims[1].is_dynamic();
}

// The rows the step walks for row tensors `rows`: all dense, or all one
// route's in pair order or padded. The route whose padded slots it walks
// where any is padded, null where their own rows serve; nullopt where they
// share no rows.
std::optional<const RoutingNode *> row_space(const std::vector<const TensorDecl *> &rows) {
  const RoutingNode *padded = nullptr;
  for (const TensorDecl *t : rows) {
    if (!plain_rows(t) || (t->layout == RowLayout::dense) != (rows[0]->layout == RowLayout::dense) ||
        t->route != rows[0]->route || !t->dims[0].same_as(rows[0]->dims[0]))
      return std::nullopt;
    if (t->layout != RowLayout::dense && t->layout != RowLayout::pair && t->layout != RowLayout::padded)
      return std::nullopt;
    if (t->layout == RowLayout::padded)
      padded = t->route;
  }
  return padded;
}

// A [rows] f32 tensor beside row tensor `like` (each row's log-sum-exp, or
// delta): padded where the step walks padded slots, else like's rows.
TensorDecl row_values(KernelProgram &p, std::string name, const TensorDecl &like, const RoutingNode *space) {
  while (p.find(name))
    name += "_";
  TensorDecl t;
  t.name = name;
  t.dtype = DType::f32;
  t.dims = {like.dims[0]};
  t.route = like.route;
  t.layout = space ? RowLayout::padded : like.layout;
  return t;
}

// One attention of the forward: the scores' GEMM, the softmax over the
// tokens and p value, at softmax_at.
struct Match {
  size_t softmax_at = 0, scores_at = 0, z_at = 0;
  std::string scores, probs, q, key, value, z;
  Var tokens;
  double scale = 1;
  const RoutingNode *route = nullptr; // the forward's row space
};

// The attention whose softmax is step i, its steps within [0, end); p is
// read by p value alone there, and elsewhere only where `training` (the
// backward's steps, which fuse_attention_training takes along).
std::optional<Match> match_attention(const KernelProgram &p, size_t i, size_t end, bool training) {
  const auto *pw = std::get_if<PointwiseStep>(&p.steps[i]);
  Match m;
  if (!pw || !scaled_scores(*pw, m.scores, m.scale))
    return std::nullopt;
  m.softmax_at = i;
  m.probs = pw->output;
  m.tokens = pw->vars[1];
  int forward_reads = 0;
  for (size_t k = 0; k < end; ++k)
    for (const std::string &r : step_reads(p.steps[k]))
      forward_reads += r == m.probs;
  if (is_output(p, m.scores) || is_output(p, m.probs) || reads_of(p, m.scores) != 1 || forward_reads != 1 ||
      (!training && reads_of(p, m.probs) != 1))
    return std::nullopt;
  const long s_at = step_writing(p, m.scores);
  const auto *g1 = s_at >= 0 && static_cast<size_t>(s_at) < end ? std::get_if<GemmStep>(&p.steps[s_at]) : nullptr;
  // The scores: q key^T, N over the tokens.
  if (!g1 || !plain_gemm(*g1) || !g1->b_trans || !g1->n.same_as(m.tokens.dim()))
    return std::nullopt;
  m.scores_at = static_cast<size_t>(s_at);
  // The one reader of p in the forward: p value, K over the tokens.
  const GemmStep *g2 = nullptr;
  for (size_t k = i + 1; k < end; ++k)
    for (const std::string &r : step_reads(p.steps[k]))
      if (r == m.probs) {
        g2 = std::get_if<GemmStep>(&p.steps[k]);
        m.z_at = k;
      }
  if (!g2 || !plain_gemm(*g2) || g2->b_trans || g2->a != m.probs || !g2->k.same_as(m.tokens.dim()) ||
      g2->route != g1->route)
    return std::nullopt;
  const TensorDecl *q = p.find(g1->a), *key = p.find(g1->b[0]), *value = p.find(g2->b[0]), *z = p.find(g2->output);
  if (!q || !z || !dense_over(key, m.tokens.dim()) || !dense_over(value, m.tokens.dim()) || q->dims.size() != 2 ||
      z->dims.size() != 2 || key->dims[1].extent() != q->dims[1].extent() ||
      value->dims[1].extent() != z->dims[1].extent())
    return std::nullopt;
  const auto space = row_space({q, z});
  if (!space)
    return std::nullopt;
  m.route = *space;
  m.q = q->name;
  m.key = key->name;
  m.value = value->name;
  m.z = z->name;
  return m;
}

AttentionStep forward_step(const Match &m, const std::string &lse) {
  AttentionStep a;
  a.name = "attention_" + m.z;
  a.output = m.z;
  a.q = m.q;
  a.key = m.key;
  a.value = m.value;
  a.scale = m.scale;
  a.route = m.route;
  a.lse = lse;
  return a;
}

// The backward's steps of one matched attention as two AttentionSteps
// (fuse_attention_training's comment says when); false, p untouched, where
// they do not apply.
bool fuse_backward(KernelProgram &p, size_t &forward_steps, const Match &m,
                   const std::function<std::string(const std::string &)> &gradient,
                   const std::map<std::string, std::string> &copies) {
  const std::string gz = gradient(m.z), gq = gradient(m.q), gk = gradient(m.key), gv = gradient(m.value);
  for (const std::string &g : {gz, gq, gk, gv})
    if (g.empty() || !p.find(g))
      return false;
  const size_t n = p.steps.size();
  // Every backward step on a path from {p, d_z} to {d_q, d_key, d_value}.
  std::set<std::string> reached = {m.probs, gz}, needed = {gq, gk, gv};
  std::vector<bool> from(n, false), to(n, false);
  for (size_t k = forward_steps; k < n; ++k)
    for (const std::string &r : step_reads(p.steps[k]))
      if (reached.count(r)) {
        from[k] = true;
        for (const std::string &o : step_outputs(p.steps[k]))
          reached.insert(o);
        break;
      }
  for (size_t k = n; k-- > forward_steps;)
    for (const std::string &o : step_outputs(p.steps[k]))
      if (needed.count(o)) {
        to[k] = true;
        for (const std::string &r : step_reads(p.steps[k]))
          needed.insert(r);
        break;
      }
  std::vector<bool> in_set(n, false);
  std::set<std::string> written, read;
  for (size_t k = forward_steps; k < n; ++k) {
    if (!from[k] || !to[k])
      continue;
    in_set[k] = true;
    const Step &s = p.steps[k];
    if (const auto *g = std::get_if<GemmStep>(&s); g && (g->out_add || g->chained || g->windowed || g->fp8))
      return false;
    if (std::holds_alternative<RoutingStep>(s) || std::holds_alternative<AttentionStep>(s))
      return false;
    for (const std::string &o : step_outputs(s))
      written.insert(o);
    for (const std::string &r : step_reads(s))
      if (p.find(r)) // not a GEMM's accumulators, which its epilogue reads
        read.insert(r);
  }
  for (const std::string &g : {gq, gk, gv})
    if (!written.count(g))
      return false;
  // q, key and value as the steps read them: the forward's or the
  // backward's recomputed copy, not both.
  auto read_as = [&](const std::string &name) -> std::string {
    const auto c = copies.find(name);
    const bool copy = c != copies.end() && read.count(c->second);
    return copy && read.count(name) ? "" : copy ? c->second : name;
  };
  const std::string q = read_as(m.q), key = read_as(m.key), value = read_as(m.value);
  if (q.empty() || key.empty() || value.empty())
    return false;
  for (const std::string &r : read)
    if (!written.count(r) && r != m.probs && r != gz && r != q && r != key && r != value)
      return false;
  // Nothing else reads what the steps write but the three gradients, and
  // nothing else reads p.
  for (size_t k = 0; k < n; ++k) {
    if (in_set[k])
      continue;
    for (const std::string &r : step_reads(p.steps[k]))
      if ((written.count(r) && r != gq && r != gk && r != gv) || (r == m.probs && k != m.z_at))
        return false;
  }
  for (const std::string &w : written)
    if (is_output(p, w) && w != gq && w != gk && w != gv)
      return false;
  const TensorDecl *Q = p.find(q), *Z = p.find(m.z), *GQ = p.find(gq), *GZ = p.find(gz);
  const TensorDecl *K = p.find(key), *V = p.find(value), *GK = p.find(gk), *GV = p.find(gv);
  const auto space = row_space({Q, Z, GQ, GZ});
  if (!space || !dense_over(K, m.tokens.dim()) || !dense_over(V, m.tokens.dim()) || !dense_over(GK, m.tokens.dim()) ||
      !dense_over(GV, m.tokens.dim()) || GQ->dims[1].extent() != Q->dims[1].extent() ||
      GZ->dims[1].extent() != Z->dims[1].extent() || GK->dims[1].extent() != K->dims[1].extent() ||
      GV->dims[1].extent() != V->dims[1].extent())
    return false;

  const TensorDecl lse = row_values(p, m.z + "_lse", *Z, m.route);
  const TensorDecl delta = row_values(p, m.z + "_delta", *Z, *space);
  AttentionStep qg;
  qg.part = AttentionStep::Part::query_gradient;
  qg.name = "attention_" + gq;
  qg.output = gq;
  qg.q = q;
  qg.key = key;
  qg.value = value;
  qg.scale = m.scale;
  qg.route = *space;
  qg.lse = lse.name;
  qg.z = m.z;
  qg.d_z = gz;
  qg.delta = delta.name;
  AttentionStep kg = qg;
  kg.part = AttentionStep::Part::key_gradient;
  kg.name = "attention_" + gk;
  kg.output = gk;
  kg.d_value = gv;

  // The program without the forward's three steps and the backward's set,
  // the forward's attention in place of p value.
  std::vector<Step> steps;
  size_t forward = 0;
  for (size_t k = 0; k < n; ++k) {
    if (k == m.scores_at || k == m.softmax_at || in_set[k])
      continue;
    steps.push_back(k == m.z_at ? Step(forward_step(m, lse.name)) : p.steps[k]);
    forward += k < forward_steps;
  }
  // The gradients go after whatever writes what they read (z's gradient,
  // recomputed copies), and must come before whatever reads them.
  size_t at = forward;
  for (size_t k = 0; k < steps.size(); ++k)
    for (const std::string &o : step_outputs(steps[k]))
      if (o == gz || o == q || o == key || o == value || o == m.z || o == lse.name)
        at = std::max(at, k + 1);
  for (size_t k = 0; k < at; ++k)
    for (const std::string &r : step_reads(steps[k]))
      if (r == gq || r == gk || r == gv)
        return false;
  steps.insert(steps.begin() + static_cast<long>(at), {Step(qg), Step(kg)});
  p.steps = std::move(steps);
  forward_steps = forward;
  for (const std::string &w : written)
    if (w != gq && w != gk && w != gv)
      erase_tensor(p, w);
  for (const std::string &gone : {m.scores, m.probs})
    erase_tensor(p, gone);
  p.tensors.push_back(lse);
  p.tensors.push_back(delta);
  return true;
}

} // namespace

KernelProgram fuse_attention(KernelProgram p, const Schedule &schedule) {
  if (!schedule.fused_attention())
    return p;
  bool fused = false;
  for (size_t i = 0; i < p.steps.size(); ++i) {
    const std::optional<Match> m = match_attention(p, i, p.steps.size(), false);
    if (!m)
      continue;
    // In the place of p value (value is made by then), the scores' GEMM and
    // the softmax gone.
    p.steps[m->z_at] = forward_step(*m, "");
    for (size_t at : {std::max(m->scores_at, m->softmax_at), std::min(m->scores_at, m->softmax_at)})
      p.steps.erase(p.steps.begin() + static_cast<long>(at));
    for (const std::string &gone : {m->scores, m->probs})
      erase_tensor(p, gone);
    fused = true;
    i = static_cast<size_t>(-1); // again from the start: the steps moved
  }
  if (!fused)
    p.not_applied.push_back(kFusedAttentionNotApplied);
  return p;
}

size_t fuse_attention_training(KernelProgram &p, size_t forward_steps, const Schedule &schedule,
                               const std::function<std::string(const std::string &)> &gradient,
                               const std::map<std::string, std::string> &copies) {
  if (!schedule.fused_attention())
    return forward_steps;
  bool fused = false;
  for (size_t i = 0; i < forward_steps; ++i) {
    const std::optional<Match> m = match_attention(p, i, forward_steps, true);
    if (!m || !fuse_backward(p, forward_steps, *m, gradient, copies))
      continue;
    fused = true;
    i = static_cast<size_t>(-1);
  }
  if (!fused)
    p.not_applied.push_back(kFusedAttentionNotApplied);
  return forward_steps;
}

} // namespace moeforge
