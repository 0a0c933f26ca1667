#include "dsl/printer.h"

#include <cmath>
#include <sstream>

namespace moeforge {

namespace {

// Binding strength, for parentheses: atoms and calls bind tightest.
int precedence(const Expr &e) {
  if (auto *b = e.as<Binary>()) {
    switch (b->op) {
    case BinaryOp::add:
    case BinaryOp::sub:
      return 1;
    case BinaryOp::mul:
    case BinaryOp::div:
      return 2;
    case BinaryOp::max:
      return 4;
    }
  }
  if (auto *u = e.as<Unary>(); u && u->op == UnaryOp::neg)
    return 3;
  if (auto *c = e.as<Const>(); c && c->value < 0)
    return 3;
  return 4;
}

void print(std::ostream &os, const Expr &e, int context) {
  bool parens = precedence(e) < context;
  if (parens)
    os << "(";
  switch (e.kind()) {
  case ExprKind::Const: {
    double v = e.as<Const>()->value;
    if (v == std::floor(v) && std::fabs(v) < 1e15)
      os << static_cast<long long>(v);
    else
      os << v;
    break;
  }
  case ExprKind::Access: {
    auto *a = e.as<Access>();
    os << a->target_name() << "(";
    for (size_t i = 0; i < a->args.size(); ++i)
      os << (i ? ", " : "") << a->args[i];
    os << ")";
    break;
  }
  case ExprKind::Unary: {
    auto *u = e.as<Unary>();
    if (u->op == UnaryOp::neg) {
      os << "-";
      // -(-x), not --x: that would read as a decrement in the DSL's syntax.
      print(os, u->a, precedence(u->a) == 3 ? 4 : 3);
    } else {
      os << unary_op_name(u->op) << "(";
      print(os, u->a, 0);
      os << ")";
    }
    break;
  }
  case ExprKind::Binary: {
    auto *b = e.as<Binary>();
    if (b->op == BinaryOp::max) {
      os << "max(";
      print(os, b->a, 0);
      os << ", ";
      print(os, b->b, 0);
      os << ")";
    } else {
      int p = precedence(e);
      print(os, b->a, p);
      os << " " << binary_op_name(b->op) << " ";
      // a - (b - c) and a / (b * c) need their parentheses on the right.
      bool right_assoc_matters = b->op == BinaryOp::sub || b->op == BinaryOp::div;
      print(os, b->b, right_assoc_matters ? p + 1 : p);
    }
    break;
  }
  case ExprKind::Sum: {
    auto *s = e.as<Sum>();
    os << "sum(" << s->var.name() << ", ";
    print(os, s->body, 0);
    os << ")";
    break;
  }
  case ExprKind::Softmax: {
    auto *s = e.as<Softmax>();
    os << "softmax(" << s->var.name() << ", ";
    print(os, s->body, 0);
    os << ")";
    break;
  }
  case ExprKind::RouteSum: {
    auto *s = e.as<RouteSum>();
    os << (s->field == RouteField::token ? "combine(" : "expert_sum(") << s->route->name << ", " << s->target.name()
       << ", ";
    print(os, s->body, 0);
    os << ")";
    break;
  }
  case ExprKind::IndexEq: {
    auto *q = e.as<IndexEq>();
    os << "[" << q->a << " == " << q->b << "]";
    break;
  }
  case ExprKind::Extent:
    os << "extent(" << e.as<Extent>()->dim.name() << ")";
    break;
  }
  if (parens)
    os << ")";
}

} // namespace

std::ostream &operator<<(std::ostream &os, const Expr &e) {
  if (!e.defined())
    return os << "<undefined>";
  print(os, e, 0);
  return os;
}

std::ostream &operator<<(std::ostream &os, const Index &i) {
  if (i.is_plain())
    return os << i.var.name();
  return os << route_field_name(i.field) << "(" << i.var.name() << ")";
}

std::ostream &operator<<(std::ostream &os, const Dim &d) {
  if (!d.defined())
    return os << "<no dim>";
  const DimNode *n = d.get();
  if (n->base)
    return os << n->name << " = " << n->base->name << " * " << n->factor;
  os << n->name;
  if (n->extent < 0)
    return os << " (dynamic)";
  return os << " = " << n->extent;
}

std::ostream &operator<<(std::ostream &os, const Var &v) { return os << v.name() << " in " << v.dim().name(); }

std::ostream &operator<<(std::ostream &os, const Func &f) {
  os << f.name() << "(";
  for (size_t i = 0; i < f.args().size(); ++i)
    os << (i ? ", " : "") << f.args()[i].name();
  os << ") = " << f.body();
  return os;
}

std::ostream &operator<<(std::ostream &os, const Buffer &b) {
  (void)b.name(); // a default-constructed Input or Param: the user error that says so
  return os << *b.node();
}

std::ostream &operator<<(std::ostream &os, const BufferNode &b) {
  os << (b.kind == BufferKind::input ? "input " : "param ") << b.name << "(";
  for (size_t i = 0; i < b.dims.size(); ++i)
    os << (i ? ", " : "") << b.dims[i].name();
  os << ") : " << dtype_name(b.dtype);
  if (b.outer_stride > 0)
    os << ", " << b.dims[0].name() << " every " << b.outer_stride << " elements";
  return os;
}

std::ostream &operator<<(std::ostream &os, const RoutingNode &r) {
  os << r.name << " = top_k(" << r.probs->name << ", " << r.expert_var.name() << ", k = " << r.k;
  if (r.groups > 1)
    os << ", groups = " << r.groups << ", top_groups = " << r.top_groups;
  return os << ")  -- pairs " << r.pair.name() << " over " << r.pairs.name() << " = " << r.token_dim().name() << " * "
            << r.k;
}

std::string to_string(const Expr &e) {
  std::ostringstream s;
  s << e;
  return s.str();
}

std::string to_string(const Func &f) {
  std::ostringstream s;
  s << f;
  return s.str();
}

} // namespace moeforge
