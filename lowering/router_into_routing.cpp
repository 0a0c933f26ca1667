#include "lowering/router_into_routing.h"

#include <algorithm>

#include "dsl/ops.h"
#include "dsl/printer.h"
#include "dsl/visitor.h"

namespace moeforge {

namespace {

// A read of the route's scores at its pairs' choices, S(token(r), expert(r)):
// the value top-k selected for pair r.
bool reads_chosen_score(const Expr &e, const RoutingStep &rs) {
  const RoutingNode *r = rs.route;
  auto at = [&](const Index &i, RouteField f) { return i.field == f && i.route.get() == r && i.var.same_as(r->pair); };
  auto *a = e.as<Access>();
  return a && a->target_name() == rs.probs && a->args.size() == 2 && at(a->args[0], RouteField::token) &&
         at(a->args[1], RouteField::expert);
}

// The tensor a renormalised gate divides by: `total` in
// g(r) = S(token(r), expert(r)) / total(token(r)), or "" when body is not that.
std::string renormalising_total(const Expr &body, const RoutingStep &rs) {
  auto *div = body.as<Binary>();
  if (!div || div->op != BinaryOp::div || !reads_chosen_score(div->a, rs))
    return "";
  auto *a = div->b.as<Access>();
  const RoutingNode *r = rs.route;
  if (!a || a->args.size() != 1 || a->args[0].field != RouteField::token || a->args[0].route.get() != r ||
      !a->args[0].var.same_as(r->pair))
    return "";
  return a->target_name();
}

// Whether step `s` is total(t) = route_sum over t's pairs of S(token(r),
// expert(r)): the sum top_k(..., renormalize) divides by.
bool sums_chosen_scores(const Step &s, const std::string &total, const RoutingStep &rs) {
  auto *pw = std::get_if<PointwiseStep>(&s);
  if (!pw || pw->output != total || !pw->extra.empty() || pw->vars.size() != 1)
    return false;
  auto *sum = pw->body.as<RouteSum>();
  return sum && sum->route.get() == rs.route && sum->field == RouteField::token && sum->target.same_as(pw->vars[0]) &&
         reads_chosen_score(sum->body, rs);
}

} // namespace

KernelProgram gate_from_routing(KernelProgram p, const Schedule &) {
  for (size_t i = 0; i < p.steps.size(); ++i) {
    auto *rs = std::get_if<RoutingStep>(&p.steps[i]);
    if (!rs || !rs->gate_output.empty())
      continue;
    // The routing writes gates in pair order (r = t * k + slot) as f32, so the
    // tensor must be stored that way.
    for (size_t j = i + 1; j < p.steps.size(); ++j) {
      auto *pw = std::get_if<PointwiseStep>(&p.steps[j]);
      if (!pw || pw->vars.size() != 1 || !pw->vars[0].same_as(rs->route->pair) || !pw->extra.empty())
        continue;
      const TensorDecl &t = p.tensor(pw->output);
      if (t.dtype != DType::f32 || t.layout != RowLayout::pair || t.route != rs->route || t.stride8)
        continue;
      if (reads_chosen_score(pw->body, *rs)) {
        rs->gate_output = pw->output;
        p.steps.erase(p.steps.begin() + static_cast<long>(j)); // after i: rs stays valid
        break;
      }
      // A renormalised gate: the routing holds a token's k chosen scores
      // together, so it divides by their sum itself, and the sum's step goes
      // too when nothing else reads it. With a capacity the sum skips the
      // pairs dropped after the selection, which the top-k cannot know; the
      // group-limited top-k is another kernel, which does not divide.
      const std::string total = renormalising_total(pw->body, *rs);
      if (total.empty() || rs->drops() || rs->route->groups > 1 || is_output(p, total) || reads_of(p, total) != 1)
        continue;
      auto sum_step = std::find_if(p.steps.begin() + static_cast<long>(i) + 1, p.steps.begin() + static_cast<long>(j),
                                   [&](const Step &s) { return sums_chosen_scores(s, total, *rs); });
      if (sum_step == p.steps.begin() + static_cast<long>(j))
        continue;
      const TensorDecl &sum_tensor = p.tensor(total);
      if (sum_tensor.dtype != DType::f32)
        continue;
      rs->gate_output = pw->output;
      rs->renormalize = true;
      p.steps.erase(p.steps.begin() + static_cast<long>(j)); // after i: rs stays valid
      p.steps.erase(sum_step);                               // between i and j
      erase_tensor(p, total);
      break;
    }
  }
  return p;
}

KernelProgram softmax_into_routing(KernelProgram p, const Schedule &) {
  for (size_t i = 0; i < p.steps.size(); ++i) {
    auto *rs = std::get_if<RoutingStep>(&p.steps[i]);
    // Group-limited routing selects in its own kernel, which takes scores
    // (routing_kernels.cuh, moe_topk_grouped): the softmax stays a step.
    if (!rs || rs->softmax || is_output(p, rs->probs) || rs->route->groups > 1)
      continue;
    const RoutingNode *r = rs->route;
    // The scores' one producer and their readers: the routing must be the
    // only one, or the probabilities have to be stored anyway.
    long producer = -1;
    int producers = 0, readers = 0;
    for (size_t k = 0; k < p.steps.size(); ++k) {
      for (const std::string &o : step_outputs(p.steps[k]))
        if (o == rs->probs) {
          producer = static_cast<long>(k);
          ++producers;
        }
      for (const std::string &n : step_reads(p.steps[k]))
        readers += n == rs->probs;
    }
    if (producers != 1 || readers != 1 || producer > static_cast<long>(i))
      continue;
    // Exactly S(t, e) = softmax(e, L(t, e)) over the route's (token, expert).
    auto *pw = std::get_if<PointwiseStep>(&p.steps[producer]);
    const Softmax *sm = pw ? pw->body.as<Softmax>() : nullptr;
    const Access *l = sm ? sm->body.as<Access>() : nullptr;
    auto plain = [](const Index &x, const Var &v) { return x.is_plain() && x.var.same_as(v); };
    if (!l || pw->vars.size() != 2 || !pw->vars[0].same_as(r->token_var) || !pw->vars[1].same_as(r->expert_var) ||
        !sm->var.same_as(r->expert_var) || l->args.size() != 2 || !plain(l->args[0], r->token_var) ||
        !plain(l->args[1], r->expert_var))
      continue;
    // The routing reads L as it read S: f32 rows of E, densely stored.
    const TensorDecl *logits = p.find(l->target_name());
    if (!logits || logits->dtype != DType::f32 || logits->layout != RowLayout::dense || logits->stride8 ||
        logits->dims.size() != 2 || !logits->dims[0].same_as(r->token_dim()) ||
        !logits->dims[1].same_as(r->expert_dim()))
      continue;
    std::string scores = rs->probs;
    rs->probs = logits->name;
    rs->softmax = true;
    p.steps.erase(p.steps.begin() + producer); // before i: rs is invalid from here
    erase_tensor(p, scores);
    --i;
  }
  return p;
}

} // namespace moeforge
