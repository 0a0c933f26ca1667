#include "lowering/decompose.h"

#include <algorithm>
#include <functional>
#include <set>

#include "dsl/check.h"
#include "dsl/error.h"
#include "dsl/ops.h"
#include "dsl/printer.h"
#include "dsl/visitor.h"
#include "lowering/rename_indices.h"

namespace moeforge {

namespace {

// How an expression uses each variable: plainly, as token(v) or as expert(v).
struct VarUse {
  bool plain = false, token = false, expert = false;
  bool row() const { return plain || token; } // reaches a row of v's tensor
  bool any() const { return plain || token || expert; }
};

struct UseCollector : IRVisitor {
  std::map<const VarNode *, VarUse> uses;
  void note(const Index &i) {
    VarUse &u = uses[i.var.get()];
    (i.field == RouteField::none ? u.plain : i.field == RouteField::token ? u.token : u.expert) = true;
  }
  void visit_node(const Access &a) override {
    for (const Index &i : a.args)
      note(i);
  }
  void visit_node(const IndexEq &n) override {
    note(n.a);
    note(n.b);
  }
  void visit_node(const RouteSum &n) override {
    uses[n.target.get()].plain = true;
    IRVisitor::visit_node(n);
  }
};

VarUse use_of(const Expr &e, const Var &v) {
  UseCollector c;
  c.visit(e);
  auto it = c.uses.find(v.get());
  return it == c.uses.end() ? VarUse{} : it->second;
}

void flatten_product(const Expr &e, std::vector<Expr> &out) {
  if (auto *b = e.as<Binary>(); b && b->op == BinaryOp::mul) {
    flatten_product(b->a, out);
    flatten_product(b->b, out);
  } else {
    out.push_back(e);
  }
}

Expr product(const std::vector<Expr> &factors) {
  Expr p;
  for (const Expr &f : factors)
    p = p.defined() ? p * f : f;
  return p.defined() ? p : Expr(1.0);
}

// A read of operand `e` is plain when it is one tensor read.
const Access *plain(const std::vector<Expr> &side) { return side.size() == 1 ? side[0].as<Access>() : nullptr; }

bool is_index(const Index &i, const Var &v, RouteField f = RouteField::none) {
  return i.var.same_as(v) && i.field == f;
}

} // namespace

// A sum(k, ...)'s factors, sorted: B holds those that read the column index
// (reaching the row only through expert(row): a per-expert weight), A the rest.
struct Decomposer::Split {
  std::vector<Expr> a, b;
  bool ok = false;
};

Decomposer::Decomposer(const Pipeline &p, bool share_forward_sums)
    : pipeline_(p), share_forward_sums_(share_forward_sums) {
  for (const Func &f : p.funcs())
    if (contains_kind(f.body(), ExprKind::Sum))
      whole_[f.body().get()] = f.node();
}

namespace {

Decomposer::Split split_sum(const Sum &s, const Var &row, const Var &col) {
  Decomposer::Split sp;
  std::vector<Expr> factors;
  flatten_product(s.body, factors);
  bool a_k = false, b_k = false;
  for (const Expr &f : factors) {
    VarUse r = use_of(f, row), c = use_of(f, col), k = use_of(f, s.var);
    if (c.any() && r.row())
      return sp; // reads the row and the column together: not a product of two matrices
    (c.any() ? sp.b : sp.a).push_back(f);
    (c.any() ? b_k : a_k) |= k.any();
  }
  // B may reach the row only as one per-expert weight read.
  bool b_expert = std::any_of(sp.b.begin(), sp.b.end(), [&](const Expr &f) { return use_of(f, row).expert; });
  sp.ok = a_k && b_k && !sp.b.empty() && (!b_expert || plain(sp.b));
  return sp;
}

} // namespace

Expr Decomposer::part(const std::string &name, const std::vector<Var> &args, const Expr &body, DType t,
                      std::vector<FuncPtr> &parts) {
  RenameIndices canon; // compared up to index names; a route's pair index is the same Var everywhere: kept
  for (size_t i = 0; i < args.size(); ++i)
    if (std::none_of(pipeline_.routes().begin(), pipeline_.routes().end(),
                     [&](const RoutingPtr &r) { return r->pair.same_as(args[i]); }))
      canon.to[args[i].get()] = Var("_" + std::to_string(i), args[i].dim());
  std::string key = std::string(dtype_name(t)) + "|" + to_string(canon.mutate(body));
  for (const Var &v : args)
    key += "|" + v.dim().name();
  std::vector<Index> idx(args.begin(), args.end());
  if (auto it = made_.find(key); it != made_.end())
    return Access::make(it->second, idx);
  auto taken = [&](const std::string &n) {
    for (const Func &f : pipeline_.funcs())
      if (f.name() == n)
        return true;
    for (const BufferPtr &b : pipeline_.buffers())
      if (b->name == n)
        return true;
    for (auto &[k, f] : made_)
      if (f->name == n)
        return true;
    return false;
  };
  std::string unique = name;
  for (int n = 2; taken(unique); ++n)
    unique = name + std::to_string(n);
  auto f = std::make_shared<FuncNode>();
  f->name = unique;
  f->args = args;
  f->body = body;
  f->dtype = t;
  f->has_declared_type = true;
  f->schedule_of = owner_; // a schedule naming the Func reaches its GEMMs (d_x's d_x_s, d_x_s2)
  made_[key] = f;
  parts.push_back(f);
  return Access::make(f, idx);
}

bool Decomposer::needs_bf16_copy(const Access *a) const {
  if (a->dtype == DType::bf16)
    return false;
  if (a->buffer)
    return true;
  for (const Func &o : pipeline_.outputs())
    if (o.node() == a->func)
      return true; // an output keeps its declared precision
  return false;
}

void Decomposer::operand_dtype(const Expr &operand) {
  auto *a = operand.as<Access>();
  if (a && a->func && a->func->dtype != DType::bf16)
    bf16_operands_.push_back(a->func->name);
}

// sum(k, A * B) with A and B plain reads: an operand that is an expression
// becomes a bf16 part (an element-wise kernel) the GEMM reads.
Expr Decomposer::plain_operands(const FuncNode &f, const Expr &sum, const Var &row, const Var &col,
                                std::vector<FuncPtr> &parts) {
  const Sum &s = *sum.as<Sum>();
  Split sp = split_sum(s, row, col);
  if (!sp.ok)
    return sum; // the GEMM matcher explains what is wrong with it
  // A: a(row-index, k) read directly, or a dense a(k, row) (transposed).
  Expr a = product(sp.a), b = product(sp.b);
  const Access *pa = plain(sp.a);
  bool a_plain = pa && pa->args.size() == 2 &&
                 ((pa->args[1].is_plain() && pa->args[1].var.same_as(s.var) &&
                   (is_index(pa->args[0], row) || is_index(pa->args[0], row, RouteField::token))) ||
                  (is_index(pa->args[0], s.var) && is_index(pa->args[1], row)));
  // An operand made a part of its own gets its invariant sums hoisted like
  // any Func: a softmax's backward inside it (attention's dS = P (dP -
  // sum(u', P dP))) would otherwise recompute the row sum for every element.
  auto operand_part = [&](const std::string &name, const std::vector<Var> &args, const Expr &e) {
    FuncNode shell;
    shell.name = name;
    shell.args = args;
    return part(name, args, hoist_invariant_sums(shell, e, parts), DType::bf16, parts);
  };
  if (!a_plain || needs_bf16_copy(pa))
    a = operand_part(f.name + "_a", {row, s.var}, a);
  else
    operand_dtype(a);
  const Access *pb = plain(sp.b);
  bool b_plain = pb && pb->args.size() >= 2 && pb->args.size() <= 3;
  if (b_plain && pb->args.size() == 3)
    b_plain = is_index(pb->args[0], row, RouteField::expert);
  if (!b_plain || needs_bf16_copy(pb)) {
    if (use_of(b, row).any())
      return sum; // a per-expert B that is an expression: the matcher names it
    b = operand_part(f.name + "_b", {s.var, col}, b);
  } else {
    operand_dtype(b);
  }
  return Sum::make(s.var, a * b);
}

// f is 2-D with sums at the top: each sum's operands made plain; sums that do
// not share the first one's A become parts of their own (read by the epilogue).
Expr Decomposer::rewrite_gemm_sums(const FuncNode &f, const Expr &body, std::vector<FuncPtr> &parts) {
  const Var &row = f.args[0], &col = f.args[1];
  std::string first_a;
  Dim first_k;
  struct Outer : IRMutator {
    std::function<Expr(const Sum &, const Expr &)> each;
    Expr mutate_node(const Sum &n, const Expr &self) override { return each(n, self); }
  } outer;
  int n = 0;
  outer.each = [&](const Sum &s, const Expr &self) -> Expr {
    Expr plain_sum = plain_operands(f, self, row, col, parts);
    auto *ps = plain_sum.as<Sum>();
    auto *mul = ps ? ps->body.as<Binary>() : nullptr;
    auto *a = mul ? mul->a.as<Access>() : nullptr;
    if (!a)
      return plain_sum;
    if (n++ == 0) {
      first_a = a->target_name();
      first_k = ps->var.dim();
      return plain_sum;
    }
    if (a->target_name() == first_a && ps->var.dim().same_as(first_k))
      return plain_sum;
    std::vector<FuncPtr> inner;
    Expr read = part(f.name + "_s", {row, col}, plain_sum, DType::f32, inner);
    parts.insert(parts.end(), inner.begin(), inner.end());
    return read;
  };
  return outer.mutate(body);
}

// f is not a GEMM: every GEMM-shaped sum in it (two free indices) becomes a
// part of its own; other sums stay as loops of the element-wise kernel.
Expr Decomposer::extract_sums(const FuncNode &f, const Expr &body, std::vector<FuncPtr> &parts) {
  struct Outer : IRMutator {
    std::function<Expr(const Sum &, const Expr &)> each;
    Expr mutate_node(const Sum &n, const Expr &self) override { return each(n, self); }
  } outer;
  outer.each = [&](const Sum &s, const Expr &self) -> Expr {
    std::vector<Var> fv = free_vars(self);
    if (fv.size() != 2 || contains_kind(s.body, ExprKind::Sum) || contains_kind(s.body, ExprKind::Softmax) ||
        contains_kind(s.body, ExprKind::RouteSum))
      return self;
    // Rows: a route's pair index if there is one, else the index f lists first.
    auto rank = [&](const Var &v) {
      for (const RoutingPtr &r : pipeline_.routes())
        if (r->pair.same_as(v))
          return -1;
      for (size_t i = 0; i < f.args.size(); ++i)
        if (f.args[i].same_as(v))
          return static_cast<int>(i);
      return 100;
    };
    if (rank(fv[1]) < rank(fv[0]))
      std::swap(fv[0], fv[1]);
    if (!split_sum(s, fv[0], fv[1]).ok)
      return self;
    auto g = std::make_shared<FuncNode>();
    g->name = f.name + "_s";
    g->args = fv;
    g->dtype = DType::f32;
    std::vector<FuncPtr> inner;
    Expr rewritten = rewrite_gemm_sums(*g, self, inner);
    Expr read = part(f.name + "_s", fv, rewritten, DType::f32, inner);
    parts.insert(parts.end(), inner.begin(), inner.end());
    return read;
  };
  return outer.mutate(body);
}

// expert_sum(route, e, A(r, i) * B(r, j)) over f(e, i, j): plain operands.
Expr Decomposer::expert_reduction(const FuncNode &f, std::vector<FuncPtr> &parts) {
  const RouteSum &rs = *f.body.as<RouteSum>();
  user_check(f.args.size() == 3 && f.args[0].same_as(rs.target))
      << "definition '" << f.name << "': an expert_sum compiles as a per-expert GEMM " << f.name
      << "(e, i, j) = expert_sum(route, e, A(r, i) * B(r, j)); write it over (expert, i, j)";
  const Var &r = rs.route->pair, &i = f.args[1], &j = f.args[2];
  std::vector<Expr> factors, a, b;
  flatten_product(rs.body, factors);
  for (const Expr &x : factors) {
    bool ui = use_of(x, i).any(), uj = use_of(x, j).any();
    user_check(!(ui && uj)) << "definition '" << f.name << "': the factor " << to_string(x) << " reads both "
                            << i.name() << " and " << j.name() << ", so the expert_sum is not a product of two "
                            << "row-indexed matrices; split that factor into its own Func";
    (uj ? b : a).push_back(x);
  }
  user_check(!b.empty()) << "definition '" << f.name << "': no factor of the expert_sum reads " << j.name();
  auto operand = [&](std::vector<Expr> &side, const Var &col, const char *tag) {
    const Access *p = plain(side);
    bool ok = p && p->args.size() == 2 && is_index(p->args[1], col) &&
              (is_index(p->args[0], r) || is_index(p->args[0], r, RouteField::token)) && !needs_bf16_copy(p);
    Expr e = product(side);
    if (!ok)
      return part(f.name + tag, {r, col}, e, DType::bf16, parts);
    operand_dtype(e);
    return e;
  };
  Expr ea = operand(a, i, "_a"), eb = operand(b, j, "_b");
  return RouteSum::make(rs.route, rs.field, rs.target, ea * eb);
}

// Replaces subexpressions that are another definition's whole body by reads
// of that definition (made first).
Expr Decomposer::share_sums(const FuncNode &f, const Expr &body, std::vector<FuncPtr> &parts) {
  struct Share : IRMutator {
    Decomposer *self;
    const FuncNode *f;
    std::vector<FuncPtr> *parts;
    Expr shared(const Expr &e) {
      auto it = self->whole_.find(e.get());
      if (it == self->whole_.end() || it->second.get() == f)
        return Expr();
      const FuncPtr &g = it->second;
      std::vector<Var> fv = free_vars(e);
      bool same_vars = fv.size() == g->args.size() && std::all_of(fv.begin(), fv.end(), [&](const Var &v) {
                         return std::any_of(g->args.begin(), g->args.end(), [&](const Var &a) { return a.same_as(v); });
                       });
      if (!same_vars)
        return Expr();
      std::vector<FuncPtr> made = self->decompose(g);
      parts->insert(parts->end(), made.begin(), made.end());
      return Access::make(g, std::vector<Index>(g->args.begin(), g->args.end()));
    }
#define MOEFORGE_SHARE(n)                                                                                              \
  Expr mutate_node(const n &node, const Expr &self) override {                                                         \
    Expr s = shared(self);                                                                                             \
    return s.defined() ? s : IRMutator::mutate_node(node, self);                                                       \
  }
    MOEFORGE_EXPR_NODES(MOEFORGE_SHARE)
#undef MOEFORGE_SHARE
  } share;
  share.self = this;
  share.f = &f;
  share.parts = &parts;
  return share.mutate(body);
}

// Every sum (outermost first) whose free indices are some, but not all, of
// f's: a part over those indices, in f's order.
Expr Decomposer::hoist_invariant_sums(const FuncNode &f, const Expr &body, std::vector<FuncPtr> &parts) {
  if (f.args.empty() || contains_kind(body, ExprKind::Softmax))
    return body;
  struct Hoist : IRMutator {
    std::function<Expr(const Sum &, const Expr &)> each;
    Expr mutate_node(const Sum &n, const Expr &self) override { return each(n, self); }
    Expr inside(const Sum &n, const Expr &self) { return IRMutator::mutate_node(n, self); }
  } hoist;
  hoist.each = [&](const Sum &s, const Expr &self) -> Expr {
    std::vector<Var> fv = free_vars(self), args;
    for (const Var &a : f.args)
      if (std::any_of(fv.begin(), fv.end(), [&](const Var &v) { return v.same_as(a); }))
        args.push_back(a);
    if (args.size() != fv.size() || args.size() == f.args.size())
      return hoist.inside(s, self); // reads a bound index, or every one of f's
    return part(f.name + "_sum", args, self, DType::f32, parts);
  };
  return hoist.mutate(body);
}

std::vector<FuncPtr> Decomposer::decompose(const FuncPtr &f) {
  if (!done_.insert(f->name).second)
    return {};
  const std::string outer = owner_; // share_sums decomposes other Funcs from inside this one
  owner_ = f->schedule_of.empty() ? f->name : f->schedule_of;
  std::vector<FuncPtr> parts;
  Expr body = share_forward_sums_ ? share_sums(*f, f->body, parts) : f->body;
  // expert_sum over (expert, i, j) is a per-expert GEMM; over (expert, j)
  // (a per-expert bias's gradient: one matrix summed over each expert's
  // rows) it stays an element-wise step that loops over the expert's rows.
  if (auto *rs = body.as<RouteSum>(); rs && rs->field == RouteField::expert && f->args.size() != 2) {
    auto g = std::make_shared<FuncNode>(*f);
    g->body = body;
    body = expert_reduction(*g, parts);
  } else if (f->args.size() == 2 && !contains_kind(body, ExprKind::Softmax) &&
             !contains_kind(body, ExprKind::RouteSum) && contains_kind(body, ExprKind::Sum)) {
    body = rewrite_gemm_sums(*f, body, parts);
  } else if (contains_kind(body, ExprKind::Sum)) {
    body = extract_sums(*f, body, parts);
  }
  if (!body.as<RouteSum>())
    body = hoist_invariant_sums(*f, body, parts);
  if (body.same_as(f->body)) {
    parts.push_back(f);
  } else {
    auto g = std::make_shared<FuncNode>(*f);
    g->body = body;
    parts.push_back(g);
  }
  owner_ = outer;
  return parts;
}

} // namespace moeforge
