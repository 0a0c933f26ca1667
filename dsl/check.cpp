#include "dsl/check.h"

#include <algorithm>
#include <sstream>

#include "dsl/error.h"
#include "dsl/printer.h"

namespace moeforge {

namespace {

bool contains(const std::vector<Var> &vs, const Var &v) {
  return std::any_of(vs.begin(), vs.end(), [&](const Var &u) { return u.same_as(v); });
}

void add_unique(std::vector<Var> &vs, const Var &v) {
  if (!contains(vs, v))
    vs.push_back(v);
}

void remove_var(std::vector<Var> &vs, const Var &v) {
  vs.erase(std::remove_if(vs.begin(), vs.end(), [&](const Var &u) { return u.same_as(v); }), vs.end());
}

std::string describe_dim(const Dim &d) {
  std::ostringstream s;
  s << d.name();
  if (!d.is_dynamic())
    s << " (" << d.extent() << ")";
  return s.str();
}

// Walks a definition's body: checks every node against its context and
// collects the free variables. `bound` holds the variables bound by enclosing
// sums, so that a sum cannot rebind one.
class DefinitionChecker {
public:
  explicit DefinitionChecker(const std::string &func) : func_(func) {}

  std::vector<Var> visit(const Expr &e, std::vector<Var> &bound) {
    switch (e.kind()) {
    case ExprKind::Const:
    case ExprKind::Extent: // a number known when the layer runs: no free index
      return {};
    case ExprKind::Access:
      return visit_access(*e.as<Access>(), e);
    case ExprKind::Unary:
      return visit(e.as<Unary>()->a, bound);
    case ExprKind::Binary: {
      auto *b = e.as<Binary>();
      auto fa = visit(b->a, bound);
      for (const Var &v : visit(b->b, bound))
        add_unique(fa, v);
      return fa;
    }
    case ExprKind::Sum: {
      auto *s = e.as<Sum>();
      user_check(!contains(bound, s->var))
          << "in definition of '" << func_ << "': sum over '" << s->var.name()
          << "', which is already bound by an enclosing sum or the left side; use a new Var for the inner sum";
      bound.push_back(s->var);
      auto fv = visit(s->body, bound);
      bound.pop_back();
      user_check(contains(fv, s->var)) << "in definition of '" << func_ << "': sum over '" << s->var.name()
                                       << "' but the summand " << to_string(s->body) << " does not use '"
                                       << s->var.name() << "': index the summand by it or drop the sum";
      remove_var(fv, s->var);
      return fv;
    }
    case ExprKind::Softmax: {
      auto *s = e.as<Softmax>();
      auto fv = visit(s->body, bound);
      user_check(contains(fv, s->var)) << "in definition of '" << func_ << "': softmax along '" << s->var.name()
                                       << "' but " << to_string(s->body) << " does not use '" << s->var.name()
                                       << "': normalise along an index the expression has";
      return fv;
    }
    case ExprKind::RouteSum:
      return visit_route_sum(*e.as<RouteSum>(), bound);
    case ExprKind::IndexEq: {
      auto *q = e.as<IndexEq>();
      user_check(q->a.dim().same_as(q->b.dim()))
          << "in definition of '" << func_ << "': " << to_string(e) << " compares indices over "
          << describe_dim(q->a.dim()) << " and " << describe_dim(q->b.dim()) << ": compare indices over one Dim";
      std::vector<Var> fv{q->a.var};
      add_unique(fv, q->b.var);
      return fv;
    }
    }
    internal_check(false) << "unknown expression kind";
  }

private:
  std::vector<Var> visit_access(const Access &a, const Expr &e) {
    const std::string &name = a.target_name();
    if (a.func) {
      user_check(a.func->defined()) << "in definition of '" << func_ << "': '" << name
                                    << "' is used before it is defined: define " << name << "(...) first";
    }
    size_t rank = a.target_rank();
    if (a.args.size() != rank) {
      std::ostringstream dims;
      for (size_t i = 0; i < rank; ++i)
        dims << (i ? ", " : "") << a.target_dim(i).name();
      user_error << "in definition of '" << func_ << "': '" << name << "' has " << rank << " dimension"
                 << (rank == 1 ? "" : "s") << " (" << dims.str() << ") but " << to_string(e) << " gives "
                 << a.args.size() << " ind" << (a.args.size() == 1 ? "ex" : "ices") << ": give one index per dimension";
    }
    std::vector<Var> fv;
    for (size_t i = 0; i < rank; ++i) {
      const Index &ix = a.args[i];
      Dim want = a.target_dim(i);
      if (!ix.dim().same_as(want)) {
        std::string what = ix.is_plain() ? "index '" + ix.var.name() + "'"
                                         : std::string(route_field_name(ix.field)) + "(" + ix.var.name() + ")";
        user_error << "in definition of '" << func_ << "': " << what << " ranges over " << describe_dim(ix.dim())
                   << " but dimension " << i << " of '" << name << "' is " << describe_dim(want) << " in "
                   << to_string(e) << ": index it with a variable over " << want.name() << " (or reorder the indices)";
      }
      add_unique(fv, ix.var);
    }
    return fv;
  }

  std::vector<Var> visit_route_sum(const RouteSum &s, std::vector<Var> &bound) {
    const RoutingNode &route = *s.route;
    const Var &r = route.pair;
    const char *field = route_field_name(s.field);
    const Dim &want = s.field == RouteField::token ? route.token_dim() : route.expert_dim();
    user_check(s.target.dim().same_as(want))
        << "in definition of '" << func_ << "': the " << field << " sum of route '" << route.name << "' goes to '"
        << s.target.name() << "', which ranges over " << describe_dim(s.target.dim()) << "; use a variable over "
        << want.name();
    user_check(!contains(bound, r)) << "in definition of '" << func_ << "': a " << field << " sum of route '"
                                    << route.name << "' inside another sum over its pairs '" << r.name()
                                    << "'; sum over the pairs once";
    bound.push_back(r);
    auto fv = visit(s.body, bound);
    bound.pop_back();
    user_check(contains(fv, r)) << "in definition of '" << func_ << "': the summand " << to_string(s.body) << " of the "
                                << field << " sum does not use the pair variable '" << r.name() << "' of route '"
                                << route.name << "': index it by " << r.name() << ", "
                                << "token(" << r.name() << ") or expert(" << r.name() << ")";
    user_check(!contains(fv, s.target)) << "in definition of '" << func_ << "': the summand " << to_string(s.body)
                                        << " uses '" << s.target.name() << "' directly; inside a " << field
                                        << " sum write " << field << "(" << r.name() << ") instead";
    remove_var(fv, r);
    fv.insert(fv.begin(), s.target); // it appears first: combine(route, t, ...)
    return fv;
  }

  const std::string &func_;
};

} // namespace

std::vector<Var> free_vars(const Expr &e) {
  std::vector<Var> bound;
  static const std::string anonymous = "<expression>";
  return DefinitionChecker(anonymous).visit(e, bound);
}

DType check_definition(const FuncNode &func, const std::vector<Index> &args, const Expr &body) {
  const std::string &name = func.name;
  user_check(!func.defined()) << "'" << name << "' is already defined as " << name << "(...) = " << to_string(func.body)
                              << ": a Func is defined once; use a new Func";
  user_check(body.defined()) << "'" << name << "' is defined by an empty expression";
  std::vector<Var> lhs;
  for (const Index &ix : args) {
    user_check(ix.is_plain()) << "the left side of '" << name << "' uses " << route_field_name(ix.field) << "("
                              << ix.var.name() << "); a definition's indices must be plain variables";
    user_check(!contains(lhs, ix.var)) << "the left side of '" << name << "' uses '" << ix.var.name()
                                       << "' twice; each index of a definition must be a distinct variable";
    // The algebra's text tells indices apart by name (f(i, i) would print).
    for (const Var &v : lhs)
      user_check(v.name() != ix.var.name())
          << "the left side of '" << name << "' has two different indices named '" << v.name() << "' (over "
          << v.dim().name() << " and " << ix.var.dim().name() << "): give each Var its own name";
    lhs.push_back(ix.var);
  }
  std::vector<Var> bound = lhs;
  std::vector<Var> fv = DefinitionChecker(name).visit(body, bound);
  for (const Var &v : fv) {
    for (const Var &w : lhs)
      user_check(w.name() != v.name() || w.same_as(v))
          << "in definition of '" << name << "': two different indices are named '" << v.name() << "' (over "
          << w.dim().name() << " on the left and " << v.dim().name()
          << " on the right): give each Var its own name, or use the left side's Var on the right";
    user_check(contains(lhs, v)) << "in definition of '" << name << "': index '" << v.name()
                                 << "' is used on the right side but is not on the left: add it to " << name
                                 << "(...) or sum over it with sum(" << v.name() << ", ...)";
  }
  return func.has_declared_type ? func.dtype : body.dtype();
}

} // namespace moeforge
