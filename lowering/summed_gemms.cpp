#include "lowering/summed_gemms.h"

#include <algorithm>
#include <optional>
#include <variant>
#include <vector>

namespace moeforge {

namespace {

bool plain_var(const Index &i, const Var &v) { return i.is_plain() && i.var.same_as(v); }

// The terms of a sum a + b + ..., in order.
void add_terms(const Expr &e, std::vector<Expr> &out) {
  const Binary *b = e.as<Binary>();
  if (b && b->op == BinaryOp::add) {
    add_terms(b->a, out);
    add_terms(b->b, out);
  } else {
    out.push_back(e);
  }
}

// A term combine(route, t, X(r, c)): the tensor read, else null.
const Access *combined_read(const Expr &term) {
  const RouteSum *rs = term.as<RouteSum>();
  if (!rs)
    return nullptr;
  const Access *a = rs->body.as<Access>();
  if (!a || a->args.size() != 2 || !plain_var(a->args[0], rs->route->pair) || !a->args[1].is_plain())
    return nullptr;
  return a;
}

bool chainable(const GemmStep &g) {
  return g.route && !g.expert_k && !g.operands_in_place && !g.a_trans && !g.chained && g.b.size() == 1 &&
         g.extra.empty() && !g.unfused && stores_plain_accumulator(g);
}

// Whether two GEMMs compute over the same rows and columns with operands
// laid out alike, so one main loop can walk both reductions.
bool alike(const KernelProgram &p, const GemmStep &x, const GemmStep &y) {
  return x.route == y.route && x.m.same_as(y.m) && x.n.same_as(y.n) && x.out_rows == y.out_rows &&
         x.a_rows == y.a_rows && x.b_per_expert == y.b_per_expert && x.b_trans == y.b_trans && x.block == y.block &&
         p.tensor(x.a).dtype == p.tensor(y.a).dtype && p.tensor(x.b[0]).dtype == p.tensor(y.b[0]).dtype &&
         p.tensor(x.a).layout == p.tensor(y.a).layout && p.tensor(x.output).dtype == p.tensor(y.output).dtype &&
         p.tensor(x.output).layout == p.tensor(y.output).layout && x.fp8 == y.fp8;
}

std::optional<size_t> gemm_writing(const KernelProgram &p, const std::string &name) {
  for (size_t i = 0; i < p.steps.size(); ++i)
    if (const auto *g = std::get_if<GemmStep>(&p.steps[i]); g && g->output == name)
      return i;
  return std::nullopt;
}

// One pair found in step `at`'s terms: terms i < j, written by GEMMs at
// steps gi and gj.
struct Pair {
  size_t term_i = 0, term_j = 0, gemm_i = 0, gemm_j = 0;
};

std::optional<Pair> find_pair(const KernelProgram &p, const PointwiseStep &s, const std::vector<Expr> &terms) {
  for (size_t i = 0; i < terms.size(); ++i) {
    const Access *ai = combined_read(terms[i]);
    if (!ai)
      continue;
    for (size_t j = i + 1; j < terms.size(); ++j) {
      const Access *aj = combined_read(terms[j]);
      if (!aj)
        continue;
      const RouteSum &ri = *terms[i].as<RouteSum>(), &rj = *terms[j].as<RouteSum>();
      const std::string &xi = ai->target_name(), &xj = aj->target_name();
      if (xi == xj || ri.route.get() != rj.route.get() || ri.field != rj.field || !ri.target.same_as(rj.target) ||
          !ai->args[1].var.same_as(aj->args[1].var))
        continue;
      std::optional<size_t> gi = gemm_writing(p, xi), gj = gemm_writing(p, xj);
      if (!gi || !gj)
        continue;
      const GemmStep &a = std::get<GemmStep>(p.steps[*gi]), &b = std::get<GemmStep>(p.steps[*gj]);
      const bool outputs = std::find(p.outputs.begin(), p.outputs.end(), xi) != p.outputs.end() ||
                           std::find(p.outputs.begin(), p.outputs.end(), xj) != p.outputs.end();
      // Each output read once, by this term (s's siblings may read them too).
      bool siblings_read = false;
      for (const ExtraOutput &e : s.extra)
        for (const std::string &r : step_reads(PointwiseStep{"", e.output, s.vars, e.value, {}, {}}))
          siblings_read |= r == xi || r == xj;
      if (outputs || siblings_read || !chainable(a) || !chainable(b) || !alike(p, a, b) || reads_of(p, xi) != 1 ||
          reads_of(p, xj) != 1 || a.route != ri.route.get())
        continue;
      return Pair{i, j, *gi, *gj};
    }
  }
  return std::nullopt;
}

} // namespace

int chain_summed_gemms(KernelProgram &p, size_t begin) {
  int chained = 0;
  for (size_t at = begin; at < p.steps.size(); ++at) {
    auto *s = std::get_if<PointwiseStep>(&p.steps[at]);
    if (!s)
      continue;
    std::vector<Expr> terms;
    add_terms(s->body, terms);
    std::optional<Pair> pair = find_pair(p, *s, terms);
    if (!pair)
      continue;
    // The later GEMM takes the earlier one's product: every operand of both
    // is ready by then. Its output now holds X1 + X2, so the step keeps
    // that GEMM's term and drops the other.
    const size_t early = std::min(pair->gemm_i, pair->gemm_j), late = std::max(pair->gemm_i, pair->gemm_j);
    const GemmStep first = std::get<GemmStep>(p.steps[early]);
    GemmStep &second = std::get<GemmStep>(p.steps[late]);
    second.chained = GemmStep::Chained{first.a, first.b[0], first.k};
    second.name = "gemm_" + second.output + "_" + first.output;
    const size_t drop = first.output == terms[pair->term_i].as<RouteSum>()->body.as<Access>()->target_name()
                            ? pair->term_i
                            : pair->term_j;
    terms.erase(terms.begin() + static_cast<long>(drop));
    Expr body = terms[0];
    for (size_t t = 1; t < terms.size(); ++t)
      body = Binary::make(BinaryOp::add, body, terms[t]);
    s->body = body;
    erase_tensor(p, first.output);
    p.steps.erase(p.steps.begin() + static_cast<long>(early));
    ++chained;
    at = begin - 1; // the indices moved: look again from the start
  }
  return chained;
}

} // namespace moeforge
