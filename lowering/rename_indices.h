// Renaming index variables in an expression: a definition's body read at
// other indices (inlined where it is read, compared up to the names of its
// indices, or moved into a GEMM's epilogue over the GEMM's row and column).
#pragma once

#include <map>

#include "dsl/visitor.h"

namespace moeforge {

// Replaces index variables by others over the same Dims, keeping each
// index's route field (token(v) becomes token(w)). plain_only: only plain
// indices (v, not token(v) or expert(v)) are renamed. Unchanged reads are
// returned as they are.
struct RenameIndices : IRMutator {
  std::map<const VarNode *, Var> to;
  bool plain_only = false;

  Index index(const Index &i) const {
    auto it = to.find(i.var.get());
    if (it == to.end() || (plain_only && !i.is_plain()))
      return i;
    return i.is_plain() ? Index(it->second) : Index(i.route, i.field, it->second);
  }
  Expr mutate_node(const Access &a, const Expr &self) override {
    std::vector<Index> args;
    bool changed = false;
    for (const Index &i : a.args) {
      args.push_back(index(i));
      changed |= !args.back().var.same_as(i.var);
    }
    if (!changed)
      return self;
    return a.func ? Access::make(a.func, args) : Access::make(a.buffer, args);
  }
  Expr mutate_node(const IndexEq &n, const Expr &self) override {
    Index x = index(n.a), y = index(n.b);
    return x.var.same_as(n.a.var) && y.var.same_as(n.b.var) ? self : IndexEq::make(x, y);
  }
};

} // namespace moeforge
