#include "dsl/ir.h"

#include "dsl/check.h"
#include "dsl/error.h"
#include "dsl/printer.h"

namespace moeforge {

// ---------------------------------------------------------------- Dim, Var

Dim::Dim(std::string name, int64_t extent) {
  user_check(extent > 0) << "Dim '" << name << "' has extent " << extent
                         << ": a static extent must be positive (for an extent bound at run time, a dynamic "
                         << "Dim: Dim.dynamic(\"" << name << "\") in Python, Dim::dynamic in C++)";
  auto n = std::make_shared<DimNode>();
  n->name = std::move(name);
  n->extent = extent;
  node_ = std::move(n);
}

Dim Dim::dynamic(std::string name) {
  auto n = std::make_shared<DimNode>();
  n->name = std::move(name);
  n->extent = -1;
  return Dim(std::move(n));
}

Dim Dim::scaled(std::string name, const Dim &base, int64_t factor) {
  user_check(base.defined()) << "Dim '" << name << "' is a scaled Dim and needs a base Dim to scale (none was given)";
  user_check(factor > 0) << "Dim '" << name << "' = " << base.name() << " * " << factor
                         << ": the factor must be positive";
  auto n = std::make_shared<DimNode>();
  n->name = std::move(name);
  n->base = base.node();
  n->factor = factor;
  n->extent = base.is_dynamic() ? -1 : base.extent() * factor;
  return Dim(std::move(n));
}

const std::string &Dim::name() const { return node_->name; }
bool Dim::is_dynamic() const { return node_->extent < 0; }
int64_t Dim::extent() const { return node_->extent; }

Var::Var(std::string name, Dim dim) {
  user_check(dim.defined()) << "Var '" << name << "' needs a Dim to range over";
  node_ = std::make_shared<VarNode>(VarNode{std::move(name), std::move(dim)});
}

// ---------------------------------------------------------------- Index

const char *route_field_name(RouteField f) {
  switch (f) {
  case RouteField::none:
    return "";
  case RouteField::token:
    return "token";
  case RouteField::expert:
    return "expert";
  }
  return "?";
}

Index::Index(RoutingPtr r, RouteField f, const Var &pair) : var(pair), field(f), route(std::move(r)) {
  internal_check(route && field != RouteField::none) << "routed Index without a route";
  user_check(pair.same_as(route->pair)) << "route '" << route->name << "': " << route_field_name(f) << "("
                                        << pair.name() << ") needs the route's own pair variable '"
                                        << route->pair.name() << "' (route.pair())";
}

const Dim &Index::dim() const {
  switch (field) {
  case RouteField::token:
    return route->token_dim();
  case RouteField::expert:
    return route->expert_dim();
  case RouteField::none:
    break;
  }
  return var.dim();
}

Index Route::token(const Var &r) const { return Index(node_, RouteField::token, r); }
Index Route::expert(const Var &r) const { return Index(node_, RouteField::expert, r); }

// ---------------------------------------------------------------- Expr nodes

Expr::Expr(double value) : Expr(Const::make(value)) {}

Expr Const::make(double v) {
  auto n = std::make_shared<Const>(v, DType::f32);
  n->weak_type = true;
  return Expr(std::move(n));
}

Expr Const::make(double v, DType t) { return Expr(std::make_shared<Const>(v, t)); }

const std::string &Access::target_name() const { return buffer ? buffer->name : func->name; }
size_t Access::target_rank() const { return buffer ? buffer->dims.size() : func->args.size(); }
Dim Access::target_dim(size_t i) const { return buffer ? buffer->dims.at(i) : func->args.at(i).dim(); }

Expr Access::make(BufferPtr b, std::vector<Index> args) {
  internal_check(b != nullptr) << "access to a null buffer";
  auto n = std::make_shared<Access>(b->dtype);
  n->buffer = std::move(b);
  n->args = std::move(args);
  return Expr(std::move(n));
}

Expr Access::make(FuncPtr f, std::vector<Index> args) {
  internal_check(f != nullptr) << "access to a null func";
  // The type is fixed when the Func is defined; an access made before that is
  // rejected by check_definition, so the placeholder is never observed.
  auto n = std::make_shared<Access>(f->dtype);
  n->func = std::move(f);
  n->args = std::move(args);
  return Expr(std::move(n));
}

const char *unary_op_name(UnaryOp op) {
  switch (op) {
  case UnaryOp::neg:
    return "neg";
  case UnaryOp::exp:
    return "exp";
  case UnaryOp::log:
    return "log";
  case UnaryOp::tanh:
    return "tanh";
  case UnaryOp::sigmoid:
    return "sigmoid";
  case UnaryOp::relu:
    return "relu";
  case UnaryOp::gelu:
    return "gelu";
  case UnaryOp::silu:
    return "silu";
  case UnaryOp::step:
    return "step";
  case UnaryOp::sqrt:
    return "sqrt";
  case UnaryOp::rsqrt:
    return "rsqrt";
  }
  return "?";
}

const char *binary_op_name(BinaryOp op) {
  switch (op) {
  case BinaryOp::add:
    return "+";
  case BinaryOp::sub:
    return "-";
  case BinaryOp::mul:
    return "*";
  case BinaryOp::div:
    return "/";
  case BinaryOp::max:
    return "max";
  }
  return "?";
}

Expr Unary::make(UnaryOp op, Expr a) {
  user_check(a.defined()) << unary_op_name(op) << "() of an undefined expression";
  auto n = std::make_shared<Unary>(op, a);
  n->weak_type = a.get()->weak_type;
  return Expr(std::move(n));
}

Expr Binary::make(BinaryOp op, Expr a, Expr b) {
  user_check(a.defined() && b.defined()) << "operator " << binary_op_name(op) << " on an undefined expression";
  bool wa = a.get()->weak_type, wb = b.get()->weak_type;
  DType t = wa && !wb ? b.dtype() : (wb && !wa ? a.dtype() : promote(a.dtype(), b.dtype()));
  auto n = std::make_shared<Binary>(op, std::move(a), std::move(b), t);
  n->weak_type = wa && wb;
  return Expr(std::move(n));
}

Expr Sum::make(Var v, Expr body) {
  user_check(v.defined() && body.defined()) << "sum() needs a variable and a summand";
  return Expr(std::make_shared<Sum>(std::move(v), std::move(body)));
}

Expr Softmax::make(Var v, Expr body) {
  user_check(v.defined() && body.defined()) << "softmax() needs a variable and an expression";
  return Expr(std::make_shared<Softmax>(std::move(v), std::move(body)));
}

Expr RouteSum::make(RoutingPtr route, RouteField field, Var target, Expr body) {
  user_check(route && target.defined() && body.defined()) << "combine() needs a route, a variable and a summand";
  internal_check(field != RouteField::none) << "RouteSum without a field";
  return Expr(std::make_shared<RouteSum>(std::move(route), field, std::move(target), std::move(body)));
}

Expr IndexEq::make(const Index &a, const Index &b) {
  user_check(a.dim().same_as(b.dim())) << "an index comparison needs two indices over one Dim, but '" << a.var.name()
                                       << "' ranges over " << a.dim().name() << " and '" << b.var.name() << "' over "
                                       << b.dim().name();
  // Weakly typed like a constant: an indicator adopts the type it multiplies.
  auto n = std::make_shared<IndexEq>(a, b, DType::f32);
  n->weak_type = true;
  return Expr(std::move(n));
}

Expr Extent::make(const Dim &d) {
  user_check(d.defined()) << "extent() needs a Dim: pass the Dim whose extent you want (e.g. extent(T))";
  // Weakly typed like a constant: a count adopts the type it divides.
  auto n = std::make_shared<Extent>(d, DType::f32);
  n->weak_type = true;
  return Expr(std::move(n));
}

// ---------------------------------------------------------------- Func

Func::Func(std::string name) {
  user_check(!name.empty()) << "a Func needs a name";
  node_ = std::make_shared<FuncNode>();
  node_->name = std::move(name);
}

Func::Func(std::string name, DType storage_type) : Func(std::move(name)) {
  node_->has_declared_type = true;
  node_->dtype = storage_type;
}

const FuncNode &Func::checked() const {
  user_check(node_ != nullptr) << "a default-constructed Func has no name: make it as Func(\"name\") before "
                               << "defining or reading it";
  return *node_;
}

FuncRef::FuncRef(FuncPtr f, std::vector<Index> args) : func_(std::move(f)), args_(std::move(args)) {
  user_check(func_ != nullptr) << "a default-constructed Func has no name: make it as Func(\"name\") before "
                               << "defining or reading it";
}

void FuncRef::operator=(const Expr &body) {
  DType t = check_definition(*func_, args_, body);
  func_->args.clear();
  for (const Index &i : args_)
    func_->args.push_back(i.var);
  func_->dtype = t;
  func_->body = body;
}

FuncRef::operator Expr() const {
  // Reading a Func needs its type and shape, so it must be defined first; this
  // also rules out a definition that reads itself.
  user_check(func_->defined()) << "'" << func_->name << "' is used before it is defined: define " << func_->name
                               << "(...) = ... before reading it";
  return Access::make(func_, args_);
}

const BufferPtr &Buffer::checked_node() const {
  user_check(node_ != nullptr) << "a default-constructed Input or Param has no name or shape: make it as "
                               << "Input(\"name\", {dims...}) (or Param) before reading it";
  return node_;
}

Buffer::Buffer(BufferKind kind, std::string name, std::vector<Dim> dims, DType t) {
  user_check(!name.empty()) << "an Input or Param needs a name";
  for (size_t i = 0; i < dims.size(); ++i)
    user_check(dims[i].defined()) << "dimension " << i << " of '" << name << "' is an empty Dim";
  node_ = std::make_shared<BufferNode>(BufferNode{std::move(name), kind, std::move(dims), t});
}

int64_t BufferNode::first_dim_stride() const {
  if (outer_stride > 0)
    return outer_stride;
  int64_t inner = 1;
  for (size_t i = 1; i < dims.size(); ++i) {
    if (dims[i].is_dynamic())
      return -1; // varies with the token count
    inner *= dims[i].extent();
  }
  return inner;
}

void Buffer::set_outer_stride(int64_t outer_stride) {
  const BufferNode &n = *node_;
  user_check(n.dims.size() >= 2) << "Param '" << n.name << "': outer_stride steps its first dim over the others, "
                                 << "so it needs two dims or more (it has " << n.dims.size() << ")";
  int64_t inner = 1;
  for (size_t i = 1; i < n.dims.size(); ++i) {
    user_check(!n.dims[i].is_dynamic()) << "Param '" << n.name << "': outer_stride needs static dims after the first ("
                                        << n.dims[i].name() << " is dynamic)";
    inner *= n.dims[i].extent();
  }
  user_check(outer_stride >= inner) << "Param '" << n.name << "': outer_stride " << outer_stride << " is less than the "
                                    << inner << " elements of one index of its first dim: its rows would overlap";
  user_check(outer_stride % 8 == 0) << "Param '" << n.name << "': outer_stride " << outer_stride
                                    << " must be a multiple of 8 elements (16 bytes of bf16), as the GPU's copies "
                                    << "need aligned rows";
  auto strided = std::make_shared<BufferNode>(n);
  strided->outer_stride = outer_stride == inner ? 0 : outer_stride; // a dense stride is the plain Param
  node_ = std::move(strided);
}

Param::Param(std::string name, std::vector<Dim> dims, DType t, int64_t outer_stride)
    : Buffer(BufferKind::param, std::move(name), std::move(dims), t) {
  set_outer_stride(outer_stride);
}

} // namespace moeforge
