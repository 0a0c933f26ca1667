#include "dsl/visitor.h"

#include "dsl/error.h"

namespace moeforge {

void IRVisitor::visit(const Expr &e) {
  internal_check(e.defined()) << "visiting an undefined expression";
  switch (e.kind()) {
#define MOEFORGE_DISPATCH(n)                                                                                           \
  case ExprKind::n:                                                                                                    \
    return visit_node(*e.as<n>());
    MOEFORGE_EXPR_NODES(MOEFORGE_DISPATCH)
#undef MOEFORGE_DISPATCH
  }
}

void IRVisitor::visit_node(const Const &) {}
void IRVisitor::visit_node(const Access &) {}
void IRVisitor::visit_node(const Unary &n) { visit(n.a); }
void IRVisitor::visit_node(const Binary &n) {
  visit(n.a);
  visit(n.b);
}
void IRVisitor::visit_node(const Sum &n) { visit(n.body); }
void IRVisitor::visit_node(const Softmax &n) { visit(n.body); }
void IRVisitor::visit_node(const RouteSum &n) { visit(n.body); }
void IRVisitor::visit_node(const IndexEq &) {}
void IRVisitor::visit_node(const Extent &) {}

Expr IRMutator::mutate(const Expr &e) {
  internal_check(e.defined()) << "mutating an undefined expression";
  switch (e.kind()) {
#define MOEFORGE_DISPATCH(n)                                                                                           \
  case ExprKind::n:                                                                                                    \
    return mutate_node(*e.as<n>(), e);
    MOEFORGE_EXPR_NODES(MOEFORGE_DISPATCH)
#undef MOEFORGE_DISPATCH
  }
  return e;
}

Expr IRMutator::mutate_node(const Const &, const Expr &self) { return self; }
Expr IRMutator::mutate_node(const Access &, const Expr &self) { return self; }
Expr IRMutator::mutate_node(const Unary &n, const Expr &self) {
  Expr a = mutate(n.a);
  return a.same_as(n.a) ? self : Unary::make(n.op, a);
}
Expr IRMutator::mutate_node(const Binary &n, const Expr &self) {
  Expr a = mutate(n.a), b = mutate(n.b);
  return a.same_as(n.a) && b.same_as(n.b) ? self : Binary::make(n.op, a, b);
}
Expr IRMutator::mutate_node(const Sum &n, const Expr &self) {
  Expr b = mutate(n.body);
  return b.same_as(n.body) ? self : Sum::make(n.var, b);
}
Expr IRMutator::mutate_node(const Softmax &n, const Expr &self) {
  Expr b = mutate(n.body);
  return b.same_as(n.body) ? self : Softmax::make(n.var, b);
}
Expr IRMutator::mutate_node(const IndexEq &, const Expr &self) { return self; }
Expr IRMutator::mutate_node(const Extent &, const Expr &self) { return self; }
Expr IRMutator::mutate_node(const RouteSum &n, const Expr &self) {
  Expr b = mutate(n.body);
  return b.same_as(n.body) ? self : RouteSum::make(n.route, n.field, n.target, b);
}

bool contains_kind(const Expr &e, ExprKind kind) {
  struct Finder : IRVisitor {
    ExprKind kind;
    bool found = false;
#define MOEFORGE_FIND(n)                                                                                               \
  void visit_node(const n &node) override {                                                                            \
    found |= node.kind == kind;                                                                                        \
    IRVisitor::visit_node(node);                                                                                       \
  }
    MOEFORGE_EXPR_NODES(MOEFORGE_FIND)
#undef MOEFORGE_FIND
  } f;
  f.kind = kind;
  f.visit(e);
  return f.found;
}

} // namespace moeforge
