// The moeforge algebra: immutable, shared IR nodes for MoE layers.
//
// An MoE layer is algebra over index spaces. A `Dim` is a named extent (the
// token extent is dynamic: bound when the layer runs). A `Var` is an index
// variable ranging over a Dim. Tensors are `Input`s (activations) and `Param`s
// (weights), both `Buffer`s, and `Func`s, which are defined once by an
// expression over their index variables:
//
//     h(r, j) = gelu(sum(i, x(route.token(r), i) * w1(route.expert(r), i, j)));
//
// Routing ties tokens to experts: `top_k` over router probabilities yields a
// `Route`, whose pair variable r ranges over the routed (token, expert) pairs,
// with index functions token(r) and expert(r) and a gate weight. `combine`
// sums an expression over the pairs of each token (the gated combine), and
// `expert_sum` over the pairs of each expert (the weight-gradient shape).
//
// Nodes are immutable once built and shared through handles; a Func's node is
// the one exception: it is created empty and defined exactly once. Every node
// prints as readable math (printer.h). Scheduling never touches these nodes: a
// schedule refers to Funcs by name and only records choices.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dsl/dtype.h"

namespace moeforge {

// ---------------------------------------------------------------- Dim, Var

struct DimNode {
  std::string name;
  int64_t extent = -1; // -1: dynamic, bound at run time
  // A derived Dim has extent = base extent * factor (the routed pairs: T * k).
  std::shared_ptr<const DimNode> base;
  int64_t factor = 1;
};

class Dim {
public:
  Dim() = default;
  // A static extent; it must be positive.
  Dim(std::string name, int64_t extent);
  // An extent bound when the layer runs (the token count).
  static Dim dynamic(std::string name);
  // extent = base.extent * factor, dynamic when base is.
  static Dim scaled(std::string name, const Dim &base, int64_t factor);

  const std::string &name() const;
  bool is_dynamic() const;
  int64_t extent() const; // -1 when dynamic
  const DimNode *get() const { return node_.get(); }
  bool defined() const { return node_ != nullptr; }
  bool same_as(const Dim &o) const { return node_ == o.node_; }
  bool operator==(const Dim &o) const { return same_as(o); }
  const std::shared_ptr<const DimNode> &node() const { return node_; }

private:
  explicit Dim(std::shared_ptr<const DimNode> n) : node_(std::move(n)) {}
  std::shared_ptr<const DimNode> node_;
};

struct VarNode {
  std::string name;
  Dim dim;
};

class Var {
public:
  Var() = default;
  Var(std::string name, Dim dim);
  const std::string &name() const { return node_->name; }
  const Dim &dim() const { return node_->dim; }
  bool defined() const { return node_ != nullptr; }
  bool same_as(const Var &o) const { return node_ == o.node_; }
  bool operator==(const Var &o) const { return same_as(o); }
  const VarNode *get() const { return node_.get(); }

private:
  std::shared_ptr<const VarNode> node_;
};

// ---------------------------------------------------------------- Index

struct RoutingNode;
using RoutingPtr = std::shared_ptr<const RoutingNode>;

// Which index function of a route an Index applies to the pair variable.
enum class RouteField { none, token, expert };
const char *route_field_name(RouteField f);

// An index argument of a tensor access: a plain Var, or token(r) / expert(r)
// of a route's pair variable r (a gather through the routing).
struct Index {
  Var var;
  RouteField field = RouteField::none;
  RoutingPtr route; // set iff field != none

  Index(const Var &v) : var(v) {} // NOLINT: a Var is an Index
  Index(RoutingPtr r, RouteField f, const Var &pair);
  // The Dim this index ranges over: the var's, or the route's token/expert Dim.
  const Dim &dim() const;
  bool is_plain() const { return field == RouteField::none; }
};

// ---------------------------------------------------------------- Buffers

enum class BufferKind { input, param };

struct BufferNode {
  std::string name;
  BufferKind kind;
  std::vector<Dim> dims;
  DType dtype;
  // Elements between consecutive indices of the first dim; 0: dense (the
  // product of the other extents). A Param stored inside a larger tensor
  // has a wider one: transformers' gate_up_proj [E, 2F, d] holds w1 and w3
  // [E, F, d] as its two halves, each a Param whose experts lie 2F d apart.
  int64_t outer_stride = 0;
  // The stride of the first dim as stored: outer_stride, or dense (-1 when
  // a later dim is dynamic).
  int64_t first_dim_stride() const;
};
using BufferPtr = std::shared_ptr<const BufferNode>;

// ---------------------------------------------------------------- Expr

// The list of expression node kinds; generates the enum and visitor methods.
#define MOEFORGE_EXPR_NODES(X)                                                                                         \
  X(Const)                                                                                                             \
  X(Access)                                                                                                            \
  X(Unary)                                                                                                             \
  X(Binary)                                                                                                            \
  X(Sum)                                                                                                               \
  X(Softmax)                                                                                                           \
  X(RouteSum)                                                                                                          \
  X(IndexEq)                                                                                                           \
  X(Extent)

enum class ExprKind {
#define MOEFORGE_ENUM(n) n,
  MOEFORGE_EXPR_NODES(MOEFORGE_ENUM)
#undef MOEFORGE_ENUM
};

struct ExprNode {
  ExprKind kind;
  DType dtype;
  bool weak_type = false; // constants adopt the type of what they meet
  ExprNode(ExprKind k, DType t) : kind(k), dtype(t) {}
  virtual ~ExprNode() = default;
};

class Expr {
public:
  Expr() = default;
  Expr(double value); // NOLINT: a number is a (weakly typed) constant
  explicit Expr(std::shared_ptr<const ExprNode> n) : node_(std::move(n)) {}
  bool defined() const { return node_ != nullptr; }
  ExprKind kind() const { return node_->kind; }
  DType dtype() const { return node_->dtype; }
  const ExprNode *get() const { return node_.get(); }
  bool same_as(const Expr &o) const { return node_ == o.node_; }
  template <typename T> const T *as() const {
    return node_ && node_->kind == T::static_kind ? static_cast<const T *>(node_.get()) : nullptr;
  }

private:
  std::shared_ptr<const ExprNode> node_;
};

struct FuncNode;
using FuncPtr = std::shared_ptr<FuncNode>;

struct Const : ExprNode {
  static constexpr ExprKind static_kind = ExprKind::Const;
  double value;
  Const(double v, DType t) : ExprNode(static_kind, t), value(v) {}
  static Expr make(double v);
  static Expr make(double v, DType t);
};

// A read of a Buffer or a Func at the given indices.
struct Access : ExprNode {
  static constexpr ExprKind static_kind = ExprKind::Access;
  BufferPtr buffer; // exactly one of buffer / func is set
  FuncPtr func;
  std::vector<Index> args;
  Access(DType t) : ExprNode(static_kind, t) {}
  static Expr make(BufferPtr b, std::vector<Index> args);
  static Expr make(FuncPtr f, std::vector<Index> args);
  const std::string &target_name() const;
  size_t target_rank() const;
  Dim target_dim(size_t i) const;
};

// step(x) = x > 0 ? 1 : 0: the derivative of relu and the router of max's
// gradient (autodiff.h); it has no useful derivative of its own.
enum class UnaryOp { neg, exp, log, tanh, sigmoid, relu, gelu, silu, step, sqrt, rsqrt };
const char *unary_op_name(UnaryOp op);

struct Unary : ExprNode {
  static constexpr ExprKind static_kind = ExprKind::Unary;
  UnaryOp op;
  Expr a;
  Unary(UnaryOp o, Expr x) : ExprNode(static_kind, x.dtype()), op(o), a(std::move(x)) {}
  static Expr make(UnaryOp op, Expr a);
};

enum class BinaryOp { add, sub, mul, div, max };
const char *binary_op_name(BinaryOp op);

struct Binary : ExprNode {
  static constexpr ExprKind static_kind = ExprKind::Binary;
  BinaryOp op;
  Expr a, b;
  Binary(BinaryOp o, Expr x, Expr y, DType t) : ExprNode(static_kind, t), op(o), a(std::move(x)), b(std::move(y)) {}
  static Expr make(BinaryOp op, Expr a, Expr b);
};

// sum over one index variable: the contraction `sum(i, a(t, i) * b(i, j))`.
struct Sum : ExprNode {
  static constexpr ExprKind static_kind = ExprKind::Sum;
  Var var;
  Expr body;
  Sum(Var v, Expr b) : ExprNode(static_kind, b.dtype()), var(std::move(v)), body(std::move(b)) {}
  static Expr make(Var v, Expr body);
};

// softmax of body along var: exp(body) / sum over var of exp(body). var stays
// free in the result.
struct Softmax : ExprNode {
  static constexpr ExprKind static_kind = ExprKind::Softmax;
  Var var;
  Expr body;
  Softmax(Var v, Expr b) : ExprNode(static_kind, b.dtype()), var(std::move(v)), body(std::move(b)) {}
  static Expr make(Var v, Expr body);
};

// Sum of body over a route's pairs r grouped by field(r): with field = token
// and target t this is the combine y(t) = sum over r with token(r) = t; with
// field = expert and target e, the per-expert reduction over routed rows.
// Binds the route's pair variable; target becomes free.
struct RouteSum : ExprNode {
  static constexpr ExprKind static_kind = ExprKind::RouteSum;
  RoutingPtr route;
  RouteField field;
  Var target;
  Expr body;
  RouteSum(RoutingPtr r, RouteField f, Var t, Expr b)
      : ExprNode(static_kind, b.dtype()), route(std::move(r)), field(f), target(std::move(t)), body(std::move(b)) {}
  static Expr make(RoutingPtr route, RouteField field, Var target, Expr body);
};

// [a == b]: 1 where two indices over the same Dim agree, else 0. The gradient
// of a gate read probs(token(r), expert(r)) scatters into d_probs(t, e) with
// combine(route, t, g(r) * [expert(r) == e]) (autodiff.h); no comparison of
// values is expressible with it, only of indices.
struct IndexEq : ExprNode {
  static constexpr ExprKind static_kind = ExprKind::IndexEq;
  Index a, b;
  IndexEq(Index x, Index y, DType t) : ExprNode(static_kind, t), a(std::move(x)), b(std::move(y)) {}
  static Expr make(const Index &a, const Index &b);
};

// The extent of a Dim as a value: the token count of a mean over tokens,
// sum(t, ...) / extent(T), which for a dynamic Dim is known only when the
// layer runs (a route's pairs Dim gives T * k). Weakly typed like a constant;
// it reads no tensor and has no free index, so its derivative is 0.
struct Extent : ExprNode {
  static constexpr ExprKind static_kind = ExprKind::Extent;
  Dim dim;
  Extent(Dim d, DType t) : ExprNode(static_kind, t), dim(std::move(d)) {}
  static Expr make(const Dim &d);
};

// ---------------------------------------------------------------- Func

struct FuncNode {
  std::string name;
  std::vector<Var> args;
  Expr body;
  bool has_declared_type = false;
  DType dtype = DType::f32; // declared, else inferred from the body
  // The Func whose schedule this one follows when a schedule does not name
  // it: autodiff's stored values of a Func's subexpressions (h_silu_in, the
  // input of h's silu) follow h. Empty: its own.
  std::string schedule_of;
  bool defined() const { return body.defined(); }
};

class Func;

// f(i, j) on either side of an assignment.
class FuncRef {
public:
  // A user error for a default-constructed Func (no node): it has no name.
  FuncRef(FuncPtr f, std::vector<Index> args);
  // Defines the Func; checks the definition (check.h) and throws UserError.
  void operator=(const Expr &body);
  void operator=(const FuncRef &other) { *this = Expr(other); }
  operator Expr() const; // NOLINT: reading f(i, j)

private:
  FuncPtr func_;
  std::vector<Index> args_;
};

class Func {
public:
  Func() = default;
  explicit Func(std::string name);
  Func(std::string name, DType storage_type);
  template <typename... Args> FuncRef operator()(const Args &...args) const {
    return FuncRef(node_, std::vector<Index>{Index(args)...});
  }
  FuncRef operator()(std::vector<Index> args) const { return FuncRef(node_, std::move(args)); }
  const std::string &name() const { return checked().name; }
  const std::vector<Var> &args() const { return checked().args; }
  const Expr &body() const { return checked().body; }
  DType dtype() const { return checked().dtype; }
  bool is_defined() const { return node_ && node_->defined(); }
  const FuncPtr &node() const { return node_; }
  explicit Func(FuncPtr n) : node_(std::move(n)) {}

private:
  // The node, or a user error for a default-constructed Func.
  const FuncNode &checked() const;
  FuncPtr node_;
};

// ---------------------------------------------------------------- Buffers (user side)

class Buffer {
public:
  Buffer() = default;
  Buffer(BufferKind kind, std::string name, std::vector<Dim> dims, DType t);
  template <typename... Args> Expr operator()(const Args &...args) const {
    return Access::make(checked_node(), std::vector<Index>{Index(args)...});
  }
  Expr operator()(std::vector<Index> args) const { return Access::make(checked_node(), std::move(args)); }
  const std::string &name() const { return checked_node()->name; }
  const std::vector<Dim> &dims() const { return checked_node()->dims; }
  DType dtype() const { return checked_node()->dtype; }
  BufferKind kind() const { return checked_node()->kind; }
  int64_t outer_stride() const { return checked_node()->outer_stride; }
  const BufferPtr &node() const { return node_; }

protected:
  // The strided form's node (Param's constructor).
  void set_outer_stride(int64_t outer_stride);

private:
  // The node, or a user error for a default-constructed Input or Param.
  const BufferPtr &checked_node() const;
  BufferPtr node_;
};

// Activations: gradients flow to them but they are not trained.
class Input : public Buffer {
public:
  Input(std::string name, std::vector<Dim> dims, DType t = DType::bf16)
      : Buffer(BufferKind::input, std::move(name), std::move(dims), t) {}
};

// Trainable weights.
class Param : public Buffer {
public:
  Param(std::string name, std::vector<Dim> dims, DType t = DType::bf16)
      : Buffer(BufferKind::param, std::move(name), std::move(dims), t) {}
  // A weight stored inside a larger tensor: its first index steps
  // `outer_stride` elements (at least the product of the other extents, a
  // multiple of 8 so that rows stay 16-byte aligned for the GPU's copies).
  Param(std::string name, std::vector<Dim> dims, DType t, int64_t outer_stride);
};

// ---------------------------------------------------------------- Routing

// top_k selection over router probabilities probs(t, e) along e. The chosen
// (token, expert) pairs are numbered r = t * k + slot, slot 0 the largest
// probability (ties go to the lower expert index). The selection itself is a
// constant for differentiation; gates are algebra over probs (see Route).
struct RoutingNode {
  std::string name;
  FuncPtr probs;
  Var token_var;  // probs' token argument
  Var expert_var; // probs' expert argument, the one selected along
  int k;
  int groups = 1, top_groups = 1; // group-limited selection (TopKOptions)
  // Expert choice (expert_choice()): k = E, every token offers every expert,
  // and each expert keeps its capacity's worth of pairs of largest score
  // (dsl/capacity.h); capacity_factor is then the mean experts per token.
  // 0 for top_k, whose capacity, if any, is a schedule choice.
  double capacity_factor = 0;
  bool expert_choice() const { return capacity_factor > 0; }
  Dim pairs; // extent tokens * k
  Var pair;  // ranges over pairs
  const Dim &token_dim() const { return token_var.dim(); }
  const Dim &expert_dim() const { return expert_var.dim(); }
};

// The user's handle on a routing: the pair variable, its index functions and
// the gate weights (a Func over the pairs).
class Route {
public:
  Route(RoutingPtr node, Func gate) : node_(std::move(node)), gate_(std::move(gate)) {}
  const Var &pair() const { return node_->pair; }
  Index token(const Var &r) const;
  Index expert(const Var &r) const;
  // gate(r): the router probability of pair r, renormalised over the token's
  // k choices when top_k was asked to.
  Expr gate(const Var &r) const { return gate_(r); }
  const Func &gate_func() const { return gate_; }
  int k() const { return node_->k; }
  const std::string &name() const { return node_->name; }
  const RoutingPtr &node() const { return node_; }

private:
  RoutingPtr node_;
  Func gate_;
};

} // namespace moeforge
