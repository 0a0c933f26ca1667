#include "lowering/fuse_attention.h"

#include <algorithm>
#include <string>

namespace moeforge {

const char *const kFusedAttentionNotApplied =
    "fused_attention(true) is not applied: this layer has no softmax over the tokens between two contractions whose "
    "scores nothing else reads (a forward alone; a training backward reads them)";

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
         !g.out_add && !g.windowed && stores_plain_accumulator(g);
}

// Dense [T, F] rows over the token dim `t`.
bool dense_over(const TensorDecl *t, const Dim &tokens) {
  return t && t->layout == RowLayout::dense && !t->stride8 && t->outer_stride == 0 && t->dims.size() == 2 &&
         t->dims[0].same_as(tokens) && !t->dims[1].is_dynamic();
}

} // namespace

KernelProgram fuse_attention(KernelProgram p, const Schedule &schedule) {
  if (!schedule.fused_attention())
    return p;
  bool fused = false;
  for (size_t i = 0; i < p.steps.size(); ++i) {
    const auto *pw = std::get_if<PointwiseStep>(&p.steps[i]);
    std::string scores;
    double scale = 1;
    if (!pw || !scaled_scores(*pw, scores, scale))
      continue;
    const std::string probs = pw->output;
    const Var tokens_var = pw->vars[1];
    if (is_output(p, scores) || is_output(p, probs) || reads_of(p, scores) != 1 || reads_of(p, probs) != 1)
      continue;
    const long s_at = step_writing(p, scores);
    const auto *g1 = s_at >= 0 ? std::get_if<GemmStep>(&p.steps[s_at]) : nullptr;
    // The scores: q key^T, N over the tokens.
    if (!g1 || !plain_gemm(*g1) || !g1->b_trans || !g1->n.same_as(tokens_var.dim()))
      continue;
    // The one reader of p: p value, K over the tokens.
    long z_at = -1;
    for (size_t k = i + 1; k < p.steps.size(); ++k)
      for (const std::string &r : step_reads(p.steps[k]))
        if (r == probs)
          z_at = static_cast<long>(k);
    const auto *g2 = z_at >= 0 ? std::get_if<GemmStep>(&p.steps[z_at]) : nullptr;
    if (!g2 || !plain_gemm(*g2) || g2->b_trans || g2->a != probs || !g2->k.same_as(tokens_var.dim()) ||
        g2->route != g1->route)
      continue;
    const TensorDecl *q = p.find(g1->a), *key = p.find(g1->b[0]), *value = p.find(g2->b[0]), *z = p.find(g2->output);
    if (!q || !z || q->layout != z->layout || q->route != z->route || q->stride8 || z->stride8 ||
        q->outer_stride != 0 || z->outer_stride != 0 || q->dims.size() != 2 || z->dims.size() != 2 ||
        !dense_over(key, tokens_var.dim()) || !dense_over(value, tokens_var.dim()) ||
        key->dims[1].extent() != q->dims[1].extent() || value->dims[1].extent() != z->dims[1].extent())
      continue;
    if (q->layout != RowLayout::dense && q->layout != RowLayout::padded && q->layout != RowLayout::pair)
      continue;
    AttentionStep a;
    a.name = "attention_" + z->name;
    a.output = z->name;
    a.q = q->name;
    a.key = key->name;
    a.value = value->name;
    a.scale = scale;
    // Padded rows need the route's tables (which rows are padding); pair
    // order and dense rows are all real.
    a.route = q->layout == RowLayout::padded ? q->route : nullptr;
    // In the place of p value (value is made by then), the scores' GEMM and
    // the softmax gone.
    p.steps[z_at] = a;
    for (long at : {std::max(s_at, static_cast<long>(i)), std::min(s_at, static_cast<long>(i))})
      p.steps.erase(p.steps.begin() + at);
    for (const std::string &gone : {scores, probs})
      erase_tensor(p, gone);
    fused = true;
    i = static_cast<size_t>(-1); // again from the start: the steps moved
  }
  if (!fused)
    p.not_applied.push_back(kFusedAttentionNotApplied);
  return p;
}

} // namespace moeforge
