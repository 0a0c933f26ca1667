// Printing the algebra as readable math, in the DSL's own syntax:
//     h(r, j) = gelu(sum(i, x(token(r), i) * w1(expert(r), i, j)))
#pragma once

#include <ostream>
#include <string>

#include "dsl/ir.h"

namespace moeforge {

std::ostream &operator<<(std::ostream &os, const Expr &e);
std::ostream &operator<<(std::ostream &os, const Index &i);
std::ostream &operator<<(std::ostream &os, const Dim &d);
std::ostream &operator<<(std::ostream &os, const Var &v);
// "h(r, j) = ..." (or "h(r, j) = <undefined>").
std::ostream &operator<<(std::ostream &os, const Func &f);
// "input x(T, D) : bf16" / "param w1(E, D, F) : bf16".
std::ostream &operator<<(std::ostream &os, const Buffer &b);
std::ostream &operator<<(std::ostream &os, const BufferNode &b);
// "route = top_k(probs, e, k = 2)  -- pairs r over route.pairs = T * 2".
std::ostream &operator<<(std::ostream &os, const RoutingNode &r);

std::string to_string(const Expr &e);
std::string to_string(const Func &f);

} // namespace moeforge
