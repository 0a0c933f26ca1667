// Checking a definition when it is made: shapes (every index against the
// dimension it indexes), scoping (every index bound), well-formed sums and
// routed sums, and the result dtype. Errors are UserErrors that name the
// definition, the index and the fix.
#pragma once

#include <vector>

#include "dsl/ir.h"

namespace moeforge {

// Checks `func(args) = body` and returns the dtype the Func stores.
DType check_definition(const FuncNode &func, const std::vector<Index> &args, const Expr &body);

// The free index variables of e, in order of first appearance.
std::vector<Var> free_vars(const Expr &e);

} // namespace moeforge
