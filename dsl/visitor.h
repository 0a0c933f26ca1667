// Walking and rewriting expressions. The node list in ir.h generates one
// method per kind; the defaults recurse into children. An IRMutator returns
// the same node when no child changed, so a pass that changes nothing costs
// nothing and "unchanged" can be detected with Expr::same_as.
#pragma once

#include "dsl/ir.h"

namespace moeforge {

class IRVisitor {
public:
  virtual ~IRVisitor() = default;
  void visit(const Expr &e);

protected:
#define MOEFORGE_VISIT(n) virtual void visit_node(const n &node);
  MOEFORGE_EXPR_NODES(MOEFORGE_VISIT)
#undef MOEFORGE_VISIT
};

class IRMutator {
public:
  virtual ~IRMutator() = default;
  Expr mutate(const Expr &e);

protected:
#define MOEFORGE_MUTATE(n) virtual Expr mutate_node(const n &node, const Expr &self);
  MOEFORGE_EXPR_NODES(MOEFORGE_MUTATE)
#undef MOEFORGE_MUTATE
};

// Whether e has a node of `kind` anywhere in it (e itself included).
bool contains_kind(const Expr &e, ExprKind kind);

} // namespace moeforge
