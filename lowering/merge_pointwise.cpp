#include "lowering/merge_pointwise.h"

#include <algorithm>
#include <map>

#include "dsl/ops.h"
#include "dsl/printer.h"
#include "dsl/visitor.h"
#include "lowering/rename_indices.h"

namespace moeforge {

size_t merge_sibling_pointwise(KernelProgram &p, size_t begin, size_t end, const Schedule &schedule) {
  auto producer = [&](const std::string &name) { return step_writing(p, name); };
  auto plain = [&](const Expr &e) {
    return !contains_kind(e, ExprKind::Sum) && !contains_kind(e, ExprKind::Softmax) &&
           !contains_kind(e, ExprKind::RouteSum);
  };
  auto elementwise = [&](const PointwiseStep &s) {
    return plain(s.body) && s.extra.empty() && schedule.for_func(s.output).fuse_epilogue;
  };
  // Same index Dims, and outputs stored alike (one grid walks both).
  auto siblings = [&](const PointwiseStep &x, const PointwiseStep &y) {
    if (x.vars.size() != y.vars.size())
      return false;
    for (size_t i = 0; i < x.vars.size(); ++i)
      if (!x.vars[i].dim().same_as(y.vars[i].dim()))
        return false;
    const TensorDecl &a = p.tensor(x.output), &b = p.tensor(y.output);
    return a.layout == b.layout && a.route == b.route && a.stride8 == b.stride8 && a.zero_padding == b.zero_padding &&
           a.outer_stride == b.outer_stride;
  };
  // y(i...) = sum(j, e(i..., j)) over x's index Dims, j over x's last: y
  // rides along x as a row sum (e element-wise).
  auto row_sum_of = [&](const PointwiseStep &x, const PointwiseStep &y) -> const Sum * {
    const Sum *sum = y.body.as<Sum>();
    if (!sum || !y.extra.empty() || y.vars.size() + 1 != x.vars.size() || !plain(sum->body) ||
        !sum->var.dim().same_as(x.vars.back().dim()) || !schedule.for_func(y.output).fuse_epilogue)
      return nullptr;
    for (size_t i = 0; i < y.vars.size(); ++i)
      if (!y.vars[i].dim().same_as(x.vars[i].dim()))
        return nullptr;
    return sum;
  };
  // y's summand over x's indices: the row sum's value.
  auto summand = [&](const PointwiseStep &x, const PointwiseStep &y, const Sum &sum) {
    RenameIndices vars;
    for (size_t v = 0; v < y.vars.size(); ++v)
      vars.to[y.vars[v].get()] = x.vars[v];
    vars.to[sum.var.get()] = x.vars.back();
    return vars.mutate(sum.body);
  };
  // Everything step j reads is ready at step i: made before it, or (`inline`
  // set) one of step i's own element-wise outputs, read at its indices,
  // whose value then replaces the read.
  auto ready_at = [&](size_t i, size_t j, std::map<std::string, Expr> *inline_values) {
    std::vector<std::string> written = step_outputs(p.steps[i]);
    for (const std::string &r : step_reads(p.steps[j]))
      if (std::find(written.begin(), written.end(), r) != written.end() ? !inline_values || !inline_values->count(r)
                                                                        : producer(r) >= static_cast<long>(i))
        return false;
    return true;
  };
  for (size_t i = begin; i < end; ++i) {
    auto *g = std::get_if<PointwiseStep>(&p.steps[i]);
    if (!g)
      continue;
    // A row sum before its element-wise sibling (the gate gradient before
    // the activation's backward): the sibling moves up to it and takes the
    // sum along.
    if (!elementwise(*g)) {
      bool moved = false;
      for (size_t j = i + 1; j < end && !moved; ++j) {
        auto *h = std::get_if<PointwiseStep>(&p.steps[j]);
        const Sum *sum = h && elementwise(*h) ? row_sum_of(*h, *g) : nullptr;
        if (!sum || !ready_at(i, j, nullptr))
          continue;
        PointwiseStep merged = *h;
        merged.extra.push_back({g->output, summand(*h, *g, *sum), /*row_sum=*/true});
        merged.name += "_" + g->output;
        p.steps[i] = std::move(merged);
        p.steps.erase(p.steps.begin() + static_cast<long>(j));
        --end;
        moved = true;
      }
      if (!moved)
        continue;
      g = &std::get<PointwiseStep>(p.steps[i]);
    }
    for (size_t j = i + 1; j < end; ++j) {
      auto *h = std::get_if<PointwiseStep>(&p.steps[j]);
      if (!h)
        continue;
      // h moves up to step i: everything it reads must be ready there. What
      // it reads of g's own element-wise outputs (at their indices) it reads
      // as g computes them: the values replace the reads (the gate
      // gradient's row sum over the h that recompute_elementwise makes
      // again; s(r) * that h for dW2).
      const Sum *sum = nullptr;
      Expr value;
      if (elementwise(*h) && siblings(*g, *h)) {
        RenameIndices vars;
        for (size_t v = 0; v < g->vars.size(); ++v)
          vars.to[h->vars[v].get()] = g->vars[v];
        value = vars.mutate(h->body);
      } else if ((sum = row_sum_of(*g, *h))) {
        value = summand(*g, *h, *sum);
      } else {
        continue;
      }
      std::map<std::string, Expr> values{{g->output, g->body}};
      for (const ExtraOutput &e : g->extra)
        if (!e.row_sum)
          values[e.output] = e.value;
      if (!ready_at(i, j, &values))
        continue;
      struct Inline : IRMutator {
        const std::map<std::string, Expr> *values;
        const std::vector<Var> *at;
        int failed = 0;
        Expr mutate_node(const Access &a, const Expr &self) override {
          auto it = values->find(a.target_name());
          if (it == values->end())
            return self;
          bool same = a.args.size() == at->size();
          for (size_t v = 0; same && v < a.args.size(); ++v)
            same = a.args[v].is_plain() && a.args[v].var.same_as((*at)[v]);
          failed += same ? 0 : 1;
          return same ? it->second : self;
        }
      } in;
      in.values = &values;
      in.at = &g->vars;
      value = in.mutate(value);
      if (in.failed)
        continue;
      g->extra.push_back({h->output, value, /*row_sum=*/sum != nullptr});
      g->name += "_" + h->output;
      p.steps.erase(p.steps.begin() + static_cast<long>(j));
      --j;
      --end;
    }
  }
  // A merged step's element-wise output that nothing reads any more (the h
  // recompute_elementwise makes, once every value made from it is computed
  // in place) is not stored; a primary output so dropped gives its place to
  // the step's next element-wise value.
  for (size_t k = begin; k < end; ++k) {
    auto *g = std::get_if<PointwiseStep>(&p.steps[k]);
    if (!g || g->extra.empty())
      continue;
    for (size_t e = 0; e < g->extra.size();) {
      if (g->extra[e].row_sum || !unwanted(p, g->extra[e].output)) {
        ++e;
        continue;
      }
      erase_tensor(p, g->extra[e].output);
      g->extra.erase(g->extra.begin() + static_cast<long>(e));
    }
    auto next = std::find_if(g->extra.begin(), g->extra.end(), [](const ExtraOutput &e) { return !e.row_sum; });
    if (next != g->extra.end() && unwanted(p, g->output)) {
      erase_tensor(p, g->output);
      g->output = next->output;
      g->body = next->value;
      g->extra.erase(next);
    }
    g->name = pointwise_name(*g); // named after what it writes
  }
  return end;
}

} // namespace moeforge
