#include "dsl/autodiff.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "dsl/check.h"
#include "dsl/error.h"
#include "dsl/ops.h"
#include "dsl/printer.h"
#include "dsl/visitor.h"

namespace moeforge {

const Func &Gradients::operator[](const std::string &name) const {
  auto it = of.find(name);
  if (it == of.end()) {
    std::string known;
    for (const auto &[n, f] : of)
      known += (known.empty() ? "" : ", ") + n;
    user_error << "no gradient for '" << name << "': the output does not depend on it (gradients exist for " << known
               << ")";
  }
  return it->second;
}

namespace {

bool same_var(const Var &a, const Var &b) { return a.same_as(b); }

bool has(const std::vector<Var> &vs, const Var &v) {
  return std::any_of(vs.begin(), vs.end(), [&](const Var &u) { return same_var(u, v); });
}

// Does e depend on any Input or Param? A subexpression that depends on none
// is a constant and needs no adjoint: numbers, extents, index comparisons,
// and reads of Funcs built from those alone (the per-expert routing counts of
// a load-balancing loss: top-k selection is a constant). `memo` caches the
// answer per Func.
bool reads_anything(const Expr &e, std::map<const FuncNode *, bool> &memo) {
  struct Finder : IRVisitor {
    std::map<const FuncNode *, bool> *memo;
    bool found = false;
    void visit_node(const Access &a) override {
      if (found)
        return;
      if (a.buffer) {
        found = true;
        return;
      }
      auto it = memo->find(a.func.get());
      if (it == memo->end()) {
        Finder inner;
        inner.memo = memo;
        inner.visit(a.func->body);
        it = memo->emplace(a.func.get(), inner.found).first;
      }
      found = it->second;
    }
  } f;
  f.memo = &memo;
  f.visit(e);
  return f.found;
}

// Capture-avoiding substitution of index variables. A plain variable may be
// replaced by any Index (a RouteSum's body sees its target t as token(r));
// a variable that is bound (a sum's, a route's pairs) or named as a softmax
// axis or a RouteSum target can only be renamed to another plain variable.
class Substitute : public IRMutator {
public:
  explicit Substitute(std::map<const VarNode *, Index> m) : map_(std::move(m)) {}

protected:
  Index index(const Index &ix) const {
    auto it = map_.find(ix.var.get());
    if (it == map_.end())
      return ix;
    if (ix.is_plain())
      return it->second;
    internal_check(false) << "substituting the pair variable " << ix.var.name() << " of a routed index";
  }
  Var plain(const Var &v, const char *what) const {
    auto it = map_.find(v.get());
    if (it == map_.end())
      return v;
    user_check(it->second.is_plain()) << "autodiff: cannot differentiate through " << what << " '" << v.name()
                                      << "': its gradient would need it replaced by " << it->second
                                      << " (unsupported: nest the sum in its own Func)";
    return it->second.var;
  }
  bool captures(const Var &v) const {
    return std::any_of(map_.begin(), map_.end(), [&](const auto &kv) { return kv.second.var.same_as(v); });
  }

  Expr mutate_node(const Access &a, const Expr &self) override {
    std::vector<Index> args;
    for (const Index &ix : a.args)
      args.push_back(index(ix));
    return a.func ? Access::make(a.func, args) : Access::make(a.buffer, args);
  }
  Expr mutate_node(const IndexEq &q, const Expr &) override { return IndexEq::make(index(q.a), index(q.b)); }
  Expr mutate_node(const Sum &s, const Expr &) override {
    auto saved = map_;
    map_.erase(s.var.get()); // bound here: shadows the outer variable
    Var v = s.var;
    if (captures(v)) { // a replacement would be captured: rename the binder
      Var fresh(v.name() + "'", v.dim());
      map_.insert_or_assign(v.get(), Index(fresh));
      v = fresh;
    }
    Expr body = mutate(s.body);
    map_ = saved;
    return Sum::make(v, body);
  }
  Expr mutate_node(const Softmax &s, const Expr &) override {
    return Softmax::make(plain(s.var, "the softmax axis"), mutate(s.body));
  }
  Expr mutate_node(const RouteSum &s, const Expr &) override {
    Var target = plain(s.target, "the routed sum target");
    const Var &r = s.route->pair;
    user_check(!captures(r)) << "autodiff: a routed sum over '" << s.route->name
                             << "' inside an expression over its own pairs (unsupported)";
    auto saved = map_;
    map_.erase(r.get());
    Expr body = mutate(s.body);
    map_ = saved;
    return RouteSum::make(s.route, s.field, target, body);
  }

private:
  std::map<const VarNode *, Index> map_;
};

Expr substitute(const Expr &e, std::map<const VarNode *, Index> m) {
  for (auto it = m.begin(); it != m.end();) // identity entries change nothing
    it = it->second.is_plain() && it->second.var.get() == it->first ? m.erase(it) : std::next(it);
  return m.empty() ? e : Substitute(std::move(m)).mutate(e);
}

std::string lower(std::string s) {
  for (char &c : s)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// One reverse sweep over a pipeline.
class Differentiator {
public:
  explicit Differentiator(const Pipeline &p) : pipeline_(p) {}

  // The total gradient of sum over k of <seeds[k], outputs[k]>.
  Gradients run(const std::vector<Func> &outputs, const std::vector<std::string> &seeds) {
    std::map<const FuncNode *, size_t> output_at;
    for (size_t k = 0; k < outputs.size(); ++k) {
      const Func &output = outputs[k];
      std::vector<Dim> dims;
      for (const Var &v : output.args())
        dims.push_back(v.dim());
      Input seed(seeds[k], dims, DType::f32); // a 0-D output gets a 0-D seed
      add(output.node().get(), seed(std::vector<Index>(output.args().begin(), output.args().end())));
      output_at.emplace(output.node().get(), k);
    }

    std::map<std::string, Func> of;
    std::vector<Func> outs;
    const auto &steps = pipeline_.steps();
    for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
      if (!it->func)
        continue; // a routing: the selection is a constant
      const FuncNode &f = *it->func;
      auto c = contributions_.find(&f);
      if (c == contributions_.end())
        continue; // no output depends on f
      func_ = it->func;
      std::vector<Var> scope = f.args;
      auto out = output_at.find(&f);
      if (out != output_at.end() && c->second.size() == 1) {
        // An output that no other output reads: its gradient is the seed
        // itself (the first term), no Func to define. The reverse sweep
        // visits f after everything that reads it, so no term is missing.
        back(f.body, c->second.front(), scope);
        continue;
      }
      // An output that another output also reads gets its seed plus those
      // terms, in a Func named after the seed ("d_probs_total").
      Func d = define(out != output_at.end() ? seeds[out->second] + "_total" : "d_" + f.name, f.args, c->second);
      of.emplace(f.name, d);
      outs.push_back(d);
      back(f.body, d(std::vector<Index>(f.args.begin(), f.args.end())), scope);
    }
    for (const BufferPtr &b : pipeline_.buffers()) {
      auto c = contributions_.find(b.get());
      if (c == contributions_.end())
        continue;
      Func d = define("d_" + b->name, buffer_vars(*b), c->second);
      of.emplace(b->name, d);
      outs.push_back(d);
    }
    if (outs.empty()) {
      std::string names;
      for (const Func &o : outputs)
        names += (names.empty() ? "'" : ", '") + o.name() + "'";
      user_error << "grad: " << names << (outputs.size() == 1 ? " reads" : " read")
                 << " no Input or Param: nothing to differentiate";
    }
    return Gradients{seeds.front(), seeds, std::move(of), Pipeline(outs)};
  }

private:
  static Func define(const std::string &name, const std::vector<Var> &args, const std::vector<Expr> &terms) {
    Expr total = terms.front();
    for (size_t i = 1; i < terms.size(); ++i)
      total = total + terms[i];
    // Gradients accumulate in f32 whatever the forward stores.
    Func d(name, DType::f32);
    d(std::vector<Index>(args.begin(), args.end())) = total;
    return d;
  }

  void add(const void *target, const Expr &term) { contributions_[target].push_back(term); }

  // The variables a buffer's gradient is defined over: one per dimension,
  // named after it (x(T, D) -> d_x(t, d)).
  const std::vector<Var> &buffer_vars(const BufferNode &b) {
    auto it = buffer_vars_.find(&b);
    if (it != buffer_vars_.end())
      return it->second;
    std::vector<Var> vs;
    for (const Dim &d : b.dims) {
      // A tensor over a route's pairs (an expert-parallel layer's returned
      // rows) takes the route's own pair variable: its gradient is read
      // through token(r) and expert(r) of that variable, never a copy of it.
      auto route = std::find_if(pipeline_.routes().begin(), pipeline_.routes().end(),
                                [&](const RoutingPtr &rt) { return rt->pairs.same_as(d); });
      if (route != pipeline_.routes().end() && !has(vs, (*route)->pair)) {
        vs.push_back((*route)->pair);
        continue;
      }
      std::string name = lower(d.name());
      while (std::any_of(vs.begin(), vs.end(), [&](const Var &v) { return v.name() == name; }))
        name += "'";
      vs.emplace_back(name, d);
    }
    return buffer_vars_[&b] = vs;
  }

  // one_<Dim>(v) = 1: lets a sum over v be written when the summand does not
  // otherwise use v (the checker rejects such sums; a broadcast still counts).
  Expr one(const Var &v) {
    auto it = ones_.find(v.dim().get());
    if (it == ones_.end()) {
      Func f("one_" + v.dim().name(), DType::f32);
      f(Var(lower(v.dim().name()), v.dim())) = Expr(1.0);
      it = ones_.emplace(v.dim().get(), f).first;
    }
    return it->second(v);
  }

  // The value of forward subexpression e, as the backward reads it: a read of
  // the Func when e is its whole body (stored by the forward); a read or a
  // constant as is; anything else becomes a Func of its own over its free
  // variables ("h_gelu_in(r, j)"), so a derivative that uses it several times
  // (gelu's uses its argument seven times) reads it instead of recomputing it.
  Expr value_of(const Expr &e, const std::vector<Var> &scope, const std::string &what) {
    if (e.same_as(func_->body))
      return Access::make(func_, std::vector<Index>(func_->args.begin(), func_->args.end()));
    if (e.kind() == ExprKind::Access || e.kind() == ExprKind::Const)
      return e;
    std::vector<Var> fv = free_vars(e), args;
    for (const Var &v : scope) // in scope order: the definition's indices first
      if (has(fv, v))
        args.push_back(v);
    if (args.empty())
      return e;
    std::string name = func_->name + "_" + what;
    for (int n = 2; taken(name); ++n)
      name = func_->name + "_" + what + std::to_string(n);
    names_.push_back(name);
    Func f(name, DType::f32);
    f(std::vector<Index>(args.begin(), args.end())) = e;
    f.node()->schedule_of = func_->schedule_of.empty() ? func_->name : func_->schedule_of;
    return f(std::vector<Index>(args.begin(), args.end()));
  }

  bool taken(const std::string &name) const {
    if (std::find(names_.begin(), names_.end(), name) != names_.end())
      return true;
    for (const Func &f : pipeline_.funcs())
      if (f.name() == name)
        return true;
    return std::any_of(pipeline_.buffers().begin(), pipeline_.buffers().end(),
                       [&](const BufferPtr &b) { return b->name == name; });
  }

  // Propagates adj = d(output)/d(e) into e. scope: the variables in scope at
  // e (the definition's indices, then enclosing sums' and routes' variables).
  void back(const Expr &e, const Expr &adj, std::vector<Var> &scope) {
    if (!reads_anything(e, constant_memo_))
      return;
    switch (e.kind()) {
    case ExprKind::Const:
    case ExprKind::IndexEq:
    case ExprKind::Extent: // a count, constant for differentiation
      return;
    case ExprKind::Unary:
      return back_unary(*e.as<Unary>(), e, adj, scope);
    case ExprKind::Binary:
      return back_binary(*e.as<Binary>(), adj, scope);
    case ExprKind::Sum: {
      // Every term of the sum receives the whole adjoint (a broadcast over v).
      auto *s = e.as<Sum>();
      scope.push_back(s->var);
      back(s->body, adj, scope);
      scope.pop_back();
      return;
    }
    case ExprKind::Softmax: {
      // dz(v) = p(v) * (g(v) - sum over v' of p(v') g(v')).
      auto *s = e.as<Softmax>();
      Expr p = value_of(e, scope, "softmax");
      Var v2(s->var.name() + "'", s->var.dim());
      Expr pg = substitute(p * adj, {{s->var.get(), Index(v2)}});
      return back(s->body, p * (adj - sum(v2, pg)), scope);
    }
    case ExprKind::RouteSum: {
      // Each pair r of the sum sees the adjoint of the value it adds to:
      // the target t becomes token(r) (combine) or expert(r) (expert_sum).
      auto *s = e.as<RouteSum>();
      const Var &r = s->route->pair;
      Expr at_r = substitute(adj, {{s->target.get(), Index(s->route, s->field, r)}});
      // Inside, the target is no longer a free index: it is field(r).
      std::vector<Var> inner;
      for (const Var &v : scope)
        if (!v.same_as(s->target))
          inner.push_back(v);
      inner.push_back(r);
      return back(s->body, at_r, inner);
    }
    case ExprKind::Access:
      return back_access(*e.as<Access>(), e, adj, scope);
    }
    internal_check(false) << "autodiff: unknown expression kind";
  }

  void back_unary(const Unary &u, const Expr &e, const Expr &adj, std::vector<Var> &scope) {
    // Recurse into the forward argument u.a; the derivative reads its value
    // (x) or the op's own value (v).
    const Expr &a = u.a;
    std::string op = unary_op_name(u.op);
    auto x = [&] { return value_of(a, scope, op + "_in"); };
    auto v = [&] { return value_of(e, scope, op); };
    switch (u.op) {
    case UnaryOp::neg:
      return back(a, -adj, scope);
    case UnaryOp::exp:
      return back(a, adj * v(), scope);
    case UnaryOp::log:
      return back(a, adj / x(), scope);
    case UnaryOp::tanh: {
      Expr y = v();
      return back(a, adj * (1.0 - y * y), scope);
    }
    case UnaryOp::sigmoid: {
      Expr y = v();
      return back(a, adj * y * (1.0 - y), scope);
    }
    case UnaryOp::relu:
      return back(a, adj * step(x()), scope);
    case UnaryOp::gelu: {
      Expr xa = x();
      // d/dx 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3).
      const double c = 0.7978845608028654, k = 0.044715;
      Expr th = tanh(c * (xa + k * xa * xa * xa));
      Expr d = 0.5 * (1.0 + th) + 0.5 * xa * (1.0 - th * th) * (c * (1.0 + 3.0 * k * xa * xa));
      return back(a, adj * d, scope);
    }
    case UnaryOp::silu: {
      // d/dx x s(x) = s (1 + x (1 - s)).
      Expr xa = x(), s = sigmoid(xa);
      return back(a, adj * (s * (1.0 + xa * (1.0 - s))), scope);
    }
    case UnaryOp::step:
      return;           // zero almost everywhere: a constant
    case UnaryOp::sqrt: // d sqrt(x) = 1 / (2 sqrt(x))
      return back(a, adj * 0.5 / v(), scope);
    case UnaryOp::rsqrt: { // d x^(-1/2) = -x^(-3/2) / 2
      Expr y = v();
      return back(a, adj * (-0.5) * y * y * y, scope);
    }
    }
    internal_check(false) << "autodiff: unknown unary op";
  }

  void back_binary(const Binary &b, const Expr &adj, std::vector<Var> &scope) {
    switch (b.op) {
    case BinaryOp::add:
      back(b.a, adj, scope);
      return back(b.b, adj, scope);
    case BinaryOp::sub:
      back(b.a, adj, scope);
      return back(b.b, -adj, scope);
    case BinaryOp::mul:
      if (reads_anything(b.a, constant_memo_))
        back(b.a, adj * value_of(b.b, scope, "rhs"), scope);
      if (reads_anything(b.b, constant_memo_))
        back(b.b, value_of(b.a, scope, "lhs") * adj, scope);
      return;
    case BinaryOp::div: {
      Expr den = value_of(b.b, scope, "den");
      if (reads_anything(b.a, constant_memo_))
        back(b.a, adj / den, scope);
      if (reads_anything(b.b, constant_memo_))
        back(b.b, -(adj * value_of(b.a, scope, "num")) / (den * den), scope);
      return;
    }
    case BinaryOp::max: {
      // The larger side takes the gradient; a tie goes to b, as the forward
      // (a > b ? a : b) picks b.
      Expr m = step(b.a - b.b);
      back(b.a, adj * m, scope);
      return back(b.b, adj * (1.0 - m), scope);
    }
    }
    internal_check(false) << "autodiff: unknown binary op";
  }

  // The adjoint of a read is a sum into the read tensor's gradient over the
  // scope variables the read does not index; a read through a route sums
  // over the pairs with a combine (token(r)) or an expert_sum (expert(r)).
  void back_access(const Access &a, const Expr &e, const Expr &adj, std::vector<Var> &scope) {
    const std::vector<Var> &targets = a.func ? a.func->args : buffer_vars(*a.buffer);
    std::map<const VarNode *, Index> map;
    std::vector<Var> plain_args;
    RoutingPtr route;
    int token_at = -1, expert_at = -1;
    for (size_t k = 0; k < a.args.size(); ++k) {
      const Index &ix = a.args[k];
      if (ix.is_plain()) {
        user_check(!has(plain_args, ix.var))
            << "autodiff: no rule for " << to_string(e) << ", which reads '" << a.target_name() << "' with the index '"
            << ix.var.name() << "' twice (a diagonal read): read it through a Func with distinct indices";
        plain_args.push_back(ix.var);
        if (!targets[k].same_as(ix.var))
          map.emplace(ix.var.get(), Index(targets[k]));
        continue;
      }
      user_check(!route || route == ix.route)
          << "autodiff: no rule for " << to_string(e) << ", which reads through two routes";
      route = ix.route;
      int &at = ix.field == RouteField::token ? token_at : expert_at;
      user_check(at < 0) << "autodiff: no rule for " << to_string(e) << ", which reads " << route_field_name(ix.field)
                         << "(" << ix.var.name() << ") twice";
      at = static_cast<int>(k);
    }
    if (route) {
      user_check(!has(plain_args, route->pair))
          << "autodiff: no rule for " << to_string(e) << ", which reads the pair variable '" << route->pair.name()
          << "' both plainly and through the route";
    }

    // The scope variables to sum out: not indexed by the read, and not the
    // pairs that the routed sum below runs over.
    std::vector<std::string> target_names;
    for (const Var &t : targets)
      target_names.push_back(t.name());
    Expr term = adj;
    std::vector<Var> free = free_vars(adj);
    std::vector<Var> summed;
    for (const Var &v : scope) {
      if (has(plain_args, v) || (route && v.same_as(route->pair)))
        continue;
      if (!has(free, v))
        term = term * one(v);
      // A summed variable that shares a name (or node) with the gradient's
      // own indices is renamed, so the definition reads unambiguously.
      Var s = v;
      while (has(targets, s) || std::find(target_names.begin(), target_names.end(), s.name()) != target_names.end())
        s = Var(s.name() + "'", v.dim());
      if (!s.same_as(v))
        map.emplace(v.get(), Index(s));
      summed.push_back(s);
    }
    term = substitute(term, map);
    for (auto it = summed.rbegin(); it != summed.rend(); ++it)
      term = sum(*it, term);
    if (route) {
      const Var &r = route->pair;
      if (token_at >= 0 && expert_at >= 0) {
        // The gate read probs(token(r), expert(r)): scatter into (t, e).
        term = RouteSum::make(route, RouteField::token, targets[token_at],
                              term * index_eq(Index(route, RouteField::expert, r), Index(targets[expert_at])));
      } else if (token_at >= 0) {
        term = RouteSum::make(route, RouteField::token, targets[token_at], term);
      } else {
        term = RouteSum::make(route, RouteField::expert, targets[expert_at], term);
      }
    }
    add(a.func ? static_cast<const void *>(a.func.get()) : a.buffer.get(), term);
  }

  const Pipeline &pipeline_;
  FuncPtr func_; // the definition being differentiated
  std::map<const void *, std::vector<Expr>> contributions_;
  std::map<const BufferNode *, std::vector<Var>> buffer_vars_;
  std::map<const DimNode *, Func> ones_;
  std::vector<std::string> names_;                 // Funcs made for forward values
  std::map<const FuncNode *, bool> constant_memo_; // reads_anything, per Func
};

} // namespace

Gradients grad(const Pipeline &p, const Func &output, const std::string &seed_name) {
  return grad(p, std::vector<Func>{output}, std::vector<std::string>{seed_name});
}

Gradients grad(const Pipeline &p, const std::vector<Func> &outputs, const std::vector<std::string> &seed_names) {
  user_check(!outputs.empty())
      << "grad: no output Func given: pass the Funcs to differentiate, e.g. grad(p, {y, loss})";
  user_check(seed_names.empty() || seed_names.size() == outputs.size())
      << "grad: " << outputs.size() << " outputs but " << seed_names.size()
      << " seed names: give one seed name per output (\"\" for the default \"d_<output>\"), or none";
  std::vector<std::string> seeds;
  for (size_t k = 0; k < outputs.size(); ++k) {
    const Func &output = outputs[k];
    user_check(output.node() != nullptr) << "grad: output " << k << " is an empty Func";
    user_check(output.is_defined()) << "grad: the output Func '" << output.name() << "' is not defined";
    bool found = std::any_of(p.steps().begin(), p.steps().end(),
                             [&](const Pipeline::Step &s) { return s.func == output.node(); });
    user_check(found) << "grad: '" << output.name() << "' is not a Func of this pipeline";
    for (size_t j = 0; j < k; ++j)
      user_check(outputs[j].node() != output.node())
          << "grad: '" << output.name() << "' is given twice as an output: list each output once";
    std::string seed = seed_names.empty() || seed_names[k].empty() ? "d_" + output.name() : seed_names[k];
    for (const BufferPtr &b : p.buffers())
      user_check(b->name != seed) << "grad: the seed name '" << seed << "' is already an Input or Param";
    for (const Func &f : p.funcs())
      user_check(f.name() != seed) << "grad: the seed name '" << seed << "' of '" << output.name()
                                   << "' is already a Func of the pipeline: pass another seed name";
    user_check(std::find(seeds.begin(), seeds.end(), seed) == seeds.end())
        << "grad: the seed name '" << seed << "' is given for two outputs: give each output its own seed";
    seeds.push_back(seed);
  }
  return Differentiator(p).run(outputs, seeds);
}

} // namespace moeforge
