#include "backends/reference/evaluate.h"

#include "dsl/top_k_select.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <sstream>
#include <type_traits>
#include <utility>

#include <Eigen/Dense>

#include "dsl/capacity.h"
#include "dsl/check.h"
#include "dsl/error.h"
#include "dsl/printer.h"
#include "dsl/visitor.h"
#include "runtime/host_memory.h"

namespace moeforge {

std::vector<int64_t> RoutingResult::expert_counts() const {
  std::vector<int64_t> c(static_cast<size_t>(experts), 0);
  for (size_t r = 0; r < expert.size(); ++r)
    c[static_cast<size_t>(expert[r])] += is_kept(r);
  return c;
}

int64_t RoutingResult::dropped() const {
  int64_t n = 0;
  for (uint8_t k : kept)
    n += !k;
  return n;
}

const HostTensor &EvalResult::operator[](const std::string &func) const {
  auto it = values.find(func);
  user_check(it != values.end()) << "no value named '" << func << "' was evaluated";
  return it->second;
}

namespace {

using VarKey = const VarNode *;

std::vector<int64_t> row_major_strides(const std::vector<int64_t> &shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i)
    s[i] = s[i + 1] * shape[i + 1];
  return s;
}

// A dense intermediate: one axis per free index variable, row-major.
template <typename S> struct Value {
  std::vector<VarKey> axes;
  std::vector<int64_t> shape;
  std::vector<S> data;

  int axis_of(VarKey v) const {
    for (size_t i = 0; i < axes.size(); ++i)
      if (axes[i] == v)
        return static_cast<int>(i);
    return -1;
  }
  std::vector<int64_t> strides() const { return row_major_strides(shape); }
};

int64_t product(const std::vector<int64_t> &shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

// Sizes v's data for its shape, once the host has room for it: a layer
// whose intermediates (T k x f, say) outgrow the machine is refused with the
// sizes, not ended by std::bad_alloc.
template <typename S> void allocate(Value<S> &v) {
  check_host_array(v.shape, sizeof(S), "the reference's intermediate");
  v.data.resize(static_cast<size_t>(product(v.shape)));
}

// Calls f(out_offset, in_offsets) for every element of `shape` in row-major
// order, where in_offsets[j] advances by strides[j][axis] along each axis.
template <size_t N, typename F>
void strided_loop(const std::vector<int64_t> &shape, const std::array<std::vector<int64_t>, N> &strides, F &&f) {
  const size_t rank = shape.size();
  std::array<int64_t, N> off{};
  if (product(shape) == 0)
    return;
  if (rank == 0) {
    f(int64_t{0}, off);
    return;
  }
  std::vector<int64_t> idx(rank, 0);
  const int64_t inner = shape[rank - 1];
  int64_t out = 0;
  while (true) {
    std::array<int64_t, N> o = off;
    for (int64_t i = 0; i < inner; ++i) {
      f(out++, o);
      for (size_t j = 0; j < N; ++j)
        o[j] += strides[j][rank - 1];
    }
    // Advance the outer odometer.
    int d = static_cast<int>(rank) - 2;
    for (; d >= 0; --d) {
      for (size_t j = 0; j < N; ++j)
        off[j] += strides[j][d];
      if (++idx[d] < shape[d])
        break;
      for (size_t j = 0; j < N; ++j)
        off[j] -= strides[j][d] * shape[d];
      idx[d] = 0;
    }
    if (d < 0)
      return;
  }
}

template <typename S> S apply_unary(UnaryOp op, S x) {
  switch (op) {
  case UnaryOp::neg:
    return -x;
  case UnaryOp::exp:
    return std::exp(x);
  case UnaryOp::log:
    return std::log(x);
  case UnaryOp::tanh:
    return std::tanh(x);
  case UnaryOp::sigmoid:
    return S(1) / (S(1) + std::exp(-x));
  case UnaryOp::relu:
    return x > S(0) ? x : S(0);
  case UnaryOp::gelu: {
    const S c = static_cast<S>(0.7978845608028654); // sqrt(2 / pi)
    return S(0.5) * x * (S(1) + std::tanh(c * (x + static_cast<S>(0.044715) * x * x * x)));
  }
  case UnaryOp::silu:
    return x / (S(1) + std::exp(-x));
  case UnaryOp::step:
    return x > S(0) ? S(1) : S(0);
  case UnaryOp::sqrt:
    return std::sqrt(x);
  case UnaryOp::rsqrt:
    return S(1) / std::sqrt(x);
  }
  return x;
}

template <typename S> S apply_binary(BinaryOp op, S a, S b) {
  switch (op) {
  case BinaryOp::add:
    return a + b;
  case BinaryOp::sub:
    return a - b;
  case BinaryOp::mul:
    return a * b;
  case BinaryOp::div:
    return a / b;
  case BinaryOp::max:
    return a > b ? a : b;
  }
  return a;
}

// Does e read expert(r) of `route` (outside a nested sum that rebinds r)?
bool reads_expert(const Expr &e, const RoutingNode *route) {
  struct Finder : IRVisitor {
    const RoutingNode *route;
    bool found = false;
    void visit_node(const Access &a) override {
      for (const Index &i : a.args)
        found |= i.field == RouteField::expert && i.route.get() == route;
    }
    void visit_node(const IndexEq &q) override {
      for (const Index *i : {&q.a, &q.b})
        found |= i->field == RouteField::expert && i->route.get() == route;
    }
    void visit_node(const RouteSum &s) override {
      if (s.route.get() != route)
        IRVisitor::visit_node(s);
    }
  } f;
  f.route = route;
  f.visit(e);
  return f.found;
}

template <typename S> class Evaluator {
public:
  Evaluator(const Pipeline &p, const TensorViews &inputs, const EvalOptions &options)
      : pipeline_(p), given_(options.given), capacity_factor_(options.capacity_factor), fp8_(options.fp8) {
    bind_inputs(inputs);
    for (const auto &[name, experts] : given_) {
      user_check(
          std::any_of(p.routes().begin(), p.routes().end(), [&](const RoutingPtr &r) { return r->name == name; }))
          << "experts given for '" << name << "', which is not a route of this pipeline";
    }
  }

  EvalResult run() {
    for (const Pipeline::Step &step : pipeline_.steps()) {
      if (step.route)
        eval_routing(*step.route);
      else
        eval_func(*step.func);
    }
    EvalResult result;
    for (const Pipeline::Step &step : pipeline_.steps()) {
      if (step.route) {
        result.routes[step.route->name] = routes_.at(step.route.get());
        continue;
      }
      const Value<S> &v = funcs_.at(step.func.get());
      HostTensor t(v.shape);
      std::copy(v.data.begin(), v.data.end(), t.data.begin());
      result.values[step.func->name] = std::move(t);
    }
    for (const Dim &d : pipeline_.dims())
      result.extents[d.name()] = extents_.at(d.get());
    return result;
  }

private:
  // ------------------------------------------------------------ inputs

  void bind_inputs(const TensorViews &inputs) {
    for (const auto &[name, t] : inputs) {
      bool known = std::any_of(pipeline_.buffers().begin(), pipeline_.buffers().end(),
                               [&](const BufferPtr &b) { return b->name == name; });
      user_check(known) << "'" << name << "' is not an Input or Param of this pipeline";
    }
    std::map<const DimNode *, std::string> bound_by; // the first tensor over each Dim
    for (const BufferPtr &b : pipeline_.buffers()) {
      auto it = inputs.find(b->name);
      user_check(it != inputs.end()) << "no tensor given for " << (b->kind == BufferKind::input ? "input" : "param")
                                     << " '" << b->name << "': pass one of shape " << describe_shape(*b);
      const HostTensor &t = *it->second;
      user_check(t.shape.size() == b->dims.size())
          << "'" << b->name << "' has " << t.shape.size() << " dimensions (shape " << shape_text(t.shape)
          << ") but is declared " << describe_shape(*b);
      user_check(static_cast<int64_t>(t.data.size()) == product(t.shape))
          << "'" << b->name << "' holds " << t.data.size() << " values but its shape needs " << product(t.shape);
      for (size_t i = 0; i < b->dims.size(); ++i) {
        const Dim &d = b->dims[i];
        int64_t want = d.is_dynamic() ? -1 : d.extent();
        auto bound = extents_.find(d.get());
        if (bound != extents_.end())
          want = bound->second;
        user_check(want < 0 || want == t.shape[i])
            << "dimension " << i << " of '" << b->name << "' is " << d.name() << " = " << want << ", but the tensor "
            << "given has extent " << t.shape[i] << ": every tensor over " << d.name() << " must agree";
        extents_[d.get()] = t.shape[i];
        bound_by.emplace(d.get(), b->name);
      }
      Source &src = buffers_[b.get()];
      src.shape = t.shape;
      if constexpr (std::is_same_v<S, double>) {
        src.values = t.data.data(); // read in place: the weights may be gigabytes
      } else {
        src.owned.assign(t.data.begin(), t.data.end());
        src.values = src.owned.data();
      }
    }
    for (const Dim &d : pipeline_.dims())
      extent(d.get());
    // A derived Dim (a route's pairs, T * k) that a tensor binds must agree
    // with its base, or routed reads would index past the routing.
    for (const auto &[d, name] : bound_by) {
      if (!d->base)
        continue;
      int64_t want = extent(d->base.get()) * d->factor;
      user_check(extents_.at(d) == want) << "'" << name << "' is indexed by " << d->name << " = " << d->base->name
                                         << " * " << d->factor << " = " << want << ", but the tensor given has extent "
                                         << extents_.at(d) << ": every tensor over " << d->name << " must have " << want
                                         << " rows";
    }
  }

  static std::string describe_shape(const BufferNode &b) {
    std::ostringstream s;
    s << b.name << "(";
    for (size_t i = 0; i < b.dims.size(); ++i)
      s << (i ? ", " : "") << b.dims[i].name();
    s << ")";
    return s.str();
  }

  int64_t extent(const DimNode *d) {
    auto it = extents_.find(d);
    if (it != extents_.end())
      return it->second;
    int64_t e;
    if (d->base)
      e = extent(d->base.get()) * d->factor;
    else {
      user_check(d->extent >= 0) << "the extent of the dynamic Dim '" << d->name
                                 << "' is unknown: no Input or Param of the pipeline is indexed by it";
      e = d->extent;
    }
    extents_[d] = e;
    return e;
  }

  // ------------------------------------------------------------ domains

  // The values a variable takes here: 0..extent-1, or a subset while a routed
  // sum or a segmented definition restricts a pair variable to one expert.
  int64_t domain_size(VarKey v) {
    auto it = restricted_.find(v);
    return it != restricted_.end() ? static_cast<int64_t>(it->second.size()) : extent(v->dim.get());
  }
  const std::vector<int64_t> *subset(VarKey v) {
    auto it = restricted_.find(v);
    return it != restricted_.end() ? &it->second : nullptr;
  }

  // ------------------------------------------------------------ steps

  void eval_func(const FuncNode &f) {
    restricted_.clear();
    fixed_expert_.clear();
    auto format = fp8_.find(f.name);
    fp8_now_ = format != fp8_.end() ? std::optional<Fp8Format>(format->second) : std::nullopt;
    std::vector<VarKey> out_axes;
    for (const Var &v : f.args)
      out_axes.push_back(v.get());
    // A definition over the pairs of a route that reads expert(r) runs one
    // expert segment at a time.
    const RoutingNode *segment_by = nullptr;
    for (const RoutingPtr &r : pipeline_.routes())
      if (std::find(out_axes.begin(), out_axes.end(), r->pair.get()) != out_axes.end() && reads_expert(f.body, r.get()))
        segment_by = r.get();
    Value<S> v;
    if (segment_by) {
      std::vector<VarKey> rows_first{segment_by->pair.get()};
      for (VarKey k : out_axes)
        if (k != segment_by->pair.get())
          rows_first.push_back(k);
      v = rearrange(eval_rows(f.body, rows_first, segment_by), out_axes);
    } else {
      v = rearrange(eval(f.body), out_axes);
    }
    funcs_[&f] = std::move(v);
  }

  void eval_routing(const RoutingNode &r) {
    const Value<S> &probs = funcs_.at(r.probs.get());
    Value<S> p = rearrange(probs, {r.token_var.get(), r.expert_var.get()});
    RoutingResult res;
    res.tokens = p.shape[0];
    res.experts = p.shape[1];
    res.k = r.k;
    if (auto g = given_.find(r.name); g != given_.end()) {
      take_given(res, r, g->second);
      drop_past_capacity(res, r, p);
      routes_[&r] = std::move(res);
      return;
    }
    std::vector<int32_t> order(static_cast<size_t>(res.experts));
    for (int64_t t = 0; t < res.tokens; ++t) {
      const S *row = &p.data[static_cast<size_t>(t * res.experts)];
      // Largest first; ties go to the lower expert index, so routing is a
      // deterministic function of the probabilities on every backend.
      select_top_k(row, static_cast<int>(res.experts), r.k, r.groups, r.top_groups, order.data(), t);
      for (int s = 0; s < r.k; ++s) {
        res.token.push_back(static_cast<int32_t>(t));
        res.expert.push_back(order[static_cast<size_t>(s)]);
      }
    }
    drop_past_capacity(res, r, p);
    routes_[&r] = std::move(res);
  }

  // The pairs an expert of fixed capacity keeps: expert choice's own rule,
  // or the schedule's capacity for a top_k route (dsl/capacity.h).
  void drop_past_capacity(RoutingResult &res, const RoutingNode &r, const Value<S> &p) const {
    const bool by_score = r.expert_choice();
    const double factor = by_score ? r.capacity_factor : capacity_factor_;
    if (factor <= 0)
      return;
    const KeepPriority priority = by_score ? KeepPriority::score : KeepPriority::token_order;
    std::vector<S> score(res.expert.size());
    for (size_t i = 0; i < score.size(); ++i)
      score[i] = p.data[static_cast<size_t>(res.token[i] * res.experts + res.expert[i])];
    const int64_t c = expert_capacity(factor, res.tokens, r.k, static_cast<int>(res.experts), priority);
    res.kept = keep_within_capacity(res.expert.data(), score.data(), res.tokens, r.k, static_cast<int>(res.experts), c,
                                    priority);
  }

  static void take_given(RoutingResult &res, const RoutingNode &r, const std::vector<int32_t> &experts) {
    user_check(static_cast<int64_t>(experts.size()) == res.tokens * r.k)
        << "route '" << r.name << "': " << experts.size() << " experts given, but " << res.tokens
        << " tokens x k = " << r.k << " needs " << res.tokens * r.k;
    for (int64_t t = 0; t < res.tokens; ++t)
      for (int s = 0; s < r.k; ++s) {
        const int32_t e = experts[static_cast<size_t>(t * r.k + s)];
        user_check(e >= 0 && e < res.experts) << "route '" << r.name << "': expert " << e << " given for token " << t
                                              << ", outside 0.." << res.experts - 1;
        for (int s2 = 0; s2 < s; ++s2)
          user_check(experts[static_cast<size_t>(t * r.k + s2)] != e)
              << "route '" << r.name << "': expert " << e << " given twice for token " << t;
        res.token.push_back(static_cast<int32_t>(t));
        res.expert.push_back(e);
      }
  }

  // ------------------------------------------------------------ expressions

  Value<S> eval(const Expr &e) {
    switch (e.kind()) {
    case ExprKind::Const: {
      Value<S> v;
      v.data = {static_cast<S>(e.as<Const>()->value)};
      return v;
    }
    case ExprKind::Access:
      return eval_access(*e.as<Access>());
    case ExprKind::Unary: {
      auto *u = e.as<Unary>();
      Value<S> v = eval(u->a);
      for (S &x : v.data)
        x = apply_unary(u->op, x);
      return v;
    }
    case ExprKind::Binary: {
      auto *b = e.as<Binary>();
      return elementwise(b->op, eval(b->a), eval(b->b));
    }
    case ExprKind::Sum: {
      auto *s = e.as<Sum>();
      return eval_sum(s->var.get(), s->body);
    }
    case ExprKind::Softmax: {
      auto *s = e.as<Softmax>();
      return softmax(eval(s->body), s->var.get());
    }
    case ExprKind::RouteSum:
      return eval_route_sum(*e.as<RouteSum>());
    case ExprKind::IndexEq:
      return eval_index_eq(*e.as<IndexEq>());
    case ExprKind::Extent: { // the whole extent, never a segment's subset
      Value<S> v;
      v.data = {static_cast<S>(extent(e.as<Extent>()->dim.get()))};
      return v;
    }
    }
    internal_check(false) << "unknown expression kind";
  }

  Value<S> eval_access(const Access &a) {
    const S *src;
    std::vector<int64_t> src_strides;
    if (a.func) {
      const Value<S> &f = funcs_.at(a.func.get());
      src = f.data.data();
      src_strides = f.strides();
    } else {
      const Source &b = buffers_.at(a.buffer.get());
      src = b.values;
      src_strides = b.strides();
    }
    Value<S> out;
    // Which output axis each argument reads (-1: a fixed expert).
    std::vector<int> arg_axis(a.args.size(), -1);
    std::vector<int64_t> fixed(a.args.size(), 0);
    for (size_t j = 0; j < a.args.size(); ++j) {
      const Index &ix = a.args[j];
      if (ix.field == RouteField::expert) {
        auto f = fixed_expert_.find(ix.route.get());
        if (f != fixed_expert_.end()) {
          fixed[j] = f->second;
          continue;
        }
      }
      int ax = out.axis_of(ix.var.get());
      if (ax < 0) {
        ax = static_cast<int>(out.axes.size());
        out.axes.push_back(ix.var.get());
        out.shape.push_back(domain_size(ix.var.get()));
      }
      arg_axis[j] = ax;
    }
    allocate(out);
    std::vector<const std::vector<int64_t> *> subsets;
    for (VarKey v : out.axes)
      subsets.push_back(subset(v));
    std::vector<const RoutingResult *> route_of(a.args.size(), nullptr);
    for (size_t j = 0; j < a.args.size(); ++j)
      if (a.args[j].route)
        route_of[j] = &routes_.at(a.args[j].route.get());

    // Where the last output axis is the source's last, unit-stride, plain
    // and unrestricted index, whole rows are copied at once: a weight read
    // inside an expert's segment is a large contiguous slice, and indexing it
    // element by element dominates the reference at real sizes.
    const int last = static_cast<int>(out.axes.size()) - 1;
    const bool row_copy = last >= 0 && arg_axis.back() == last && a.args.back().is_plain() && !subsets[last] &&
                          std::count(arg_axis.begin(), arg_axis.end(), last) == 1;
    const int64_t run = row_copy ? out.shape[last] : 1;
    std::vector<int64_t> idx(out.axes.size(), 0);
    for (size_t o = 0; o < out.data.size(); o += static_cast<size_t>(run)) {
      int64_t off = 0;
      for (size_t j = 0; j < a.args.size(); ++j) {
        int64_t value = fixed[j];
        if (arg_axis[j] >= 0) {
          int ax = arg_axis[j];
          value = subsets[ax] ? (*subsets[ax])[idx[ax]] : idx[ax];
          if (a.args[j].field == RouteField::token)
            value = route_of[j]->token[value];
          else if (a.args[j].field == RouteField::expert)
            value = route_of[j]->expert[value];
        }
        off += value * src_strides[j];
      }
      if (row_copy) {
        std::copy_n(src + off, run, out.data.begin() + static_cast<int64_t>(o));
        idx[last] = run - 1; // the row is done: carry into the axes before it
      } else {
        out.data[o] = src[off];
      }
      for (int d = last; d >= 0; --d) {
        if (++idx[d] < out.shape[d])
          break;
        idx[d] = 0;
      }
    }
    return out;
  }

  // [a == b] over the variables of both indices, with routed indices looked
  // up in their routing and a fixed expert (inside a segment) used as is.
  Value<S> eval_index_eq(const IndexEq &q) {
    Value<S> out;
    const Index *ix[2] = {&q.a, &q.b};
    int axis[2] = {-1, -1};
    int64_t fixed[2] = {0, 0};
    for (int j = 0; j < 2; ++j) {
      if (ix[j]->field == RouteField::expert) {
        auto f = fixed_expert_.find(ix[j]->route.get());
        if (f != fixed_expert_.end()) {
          fixed[j] = f->second;
          continue;
        }
      }
      int ax = out.axis_of(ix[j]->var.get());
      if (ax < 0) {
        ax = static_cast<int>(out.axes.size());
        out.axes.push_back(ix[j]->var.get());
        out.shape.push_back(domain_size(ix[j]->var.get()));
      }
      axis[j] = ax;
    }
    allocate(out);
    std::vector<int64_t> idx(out.axes.size(), 0);
    for (size_t o = 0; o < out.data.size(); ++o) {
      int64_t value[2];
      for (int j = 0; j < 2; ++j) {
        value[j] = fixed[j];
        if (axis[j] < 0)
          continue;
        const std::vector<int64_t> *sub = subset(out.axes[axis[j]]);
        value[j] = sub ? (*sub)[idx[axis[j]]] : idx[axis[j]];
        if (ix[j]->field == RouteField::token)
          value[j] = routes_.at(ix[j]->route.get()).token[value[j]];
        else if (ix[j]->field == RouteField::expert)
          value[j] = routes_.at(ix[j]->route.get()).expert[value[j]];
      }
      out.data[o] = value[0] == value[1] ? S(1) : S(0);
      for (int d = static_cast<int>(idx.size()) - 1; d >= 0; --d) {
        if (++idx[d] < out.shape[d])
          break;
        idx[d] = 0;
      }
    }
    return out;
  }

  // Permutes and broadcasts v to exactly `axes` (v's axes must be among them).
  Value<S> rearrange(const Value<S> &v, const std::vector<VarKey> &axes) {
    if (v.axes == axes)
      return v;
    Value<S> out;
    out.axes = axes;
    std::array<std::vector<int64_t>, 1> st{std::vector<int64_t>(axes.size(), 0)};
    std::vector<int64_t> vs = v.strides();
    for (size_t i = 0; i < axes.size(); ++i) {
      int ax = v.axis_of(axes[i]);
      out.shape.push_back(ax >= 0 ? v.shape[ax] : domain_size(axes[i]));
      if (ax >= 0)
        st[0][i] = vs[ax];
    }
    for (VarKey k : v.axes)
      internal_check(std::find(axes.begin(), axes.end(), k) != axes.end()) << "rearrange drops axis " << k->name;
    allocate(out);
    strided_loop<1>(out.shape, st, [&](int64_t o, const std::array<int64_t, 1> &in) { out.data[o] = v.data[in[0]]; });
    return out;
  }

  Value<S> elementwise(BinaryOp op, const Value<S> &a, const Value<S> &b) {
    std::vector<VarKey> axes = a.axes;
    for (VarKey k : b.axes)
      if (a.axis_of(k) < 0)
        axes.push_back(k);
    Value<S> out;
    out.axes = axes;
    std::array<std::vector<int64_t>, 2> st{std::vector<int64_t>(axes.size(), 0), std::vector<int64_t>(axes.size(), 0)};
    std::vector<int64_t> as = a.strides(), bs = b.strides();
    for (size_t i = 0; i < axes.size(); ++i) {
      int ia = a.axis_of(axes[i]), ib = b.axis_of(axes[i]);
      out.shape.push_back(ia >= 0 ? a.shape[ia] : b.shape[ib]);
      if (ia >= 0)
        st[0][i] = as[ia];
      if (ib >= 0)
        st[1][i] = bs[ib];
    }
    allocate(out);
    strided_loop<2>(out.shape, st, [&](int64_t o, const std::array<int64_t, 2> &in) {
      out.data[o] = apply_binary(op, a.data[in[0]], b.data[in[1]]);
    });
    return out;
  }

  // Sums v over axis k (absent: every term equal, so multiply by the count).
  Value<S> reduce(const Value<S> &v, VarKey k) {
    int ax = v.axis_of(k);
    if (ax < 0) {
      Value<S> out = v;
      S n = static_cast<S>(domain_size(k));
      for (S &x : out.data)
        x *= n;
      return out;
    }
    std::vector<VarKey> rest;
    for (VarKey a : v.axes)
      if (a != k)
        rest.push_back(a);
    std::vector<VarKey> last = rest;
    last.push_back(k);
    Value<S> p = rearrange(v, last);
    int64_t n = v.shape[ax];
    Value<S> out;
    out.axes = rest;
    out.shape = std::vector<int64_t>(p.shape.begin(), p.shape.end() - 1);
    allocate(out); // zeros
    for (size_t o = 0; o < out.data.size(); ++o) {
      S acc = 0;
      for (int64_t i = 0; i < n; ++i)
        acc += p.data[o * n + i];
      out.data[o] = acc;
    }
    return out;
  }

  // sum over k of a * b as batched GEMMs: [batch, M, k] x [batch, k, N].
  Value<S> contract(const Value<S> &a, const Value<S> &b, VarKey k) {
    std::vector<VarKey> batch, m, n;
    for (VarKey x : a.axes)
      if (x != k)
        (b.axis_of(x) >= 0 ? batch : m).push_back(x);
    for (VarKey x : b.axes)
      if (x != k && a.axis_of(x) < 0)
        n.push_back(x);
    auto join = [](std::vector<VarKey> x, const std::vector<VarKey> &y) {
      x.insert(x.end(), y.begin(), y.end());
      return x;
    };
    Value<S> pa = rearrange(a, join(join(batch, m), {k}));
    Value<S> pb = rearrange(b, join(join(batch, {k}), n));
    auto extent_of = [&](const Value<S> &v, const std::vector<VarKey> &axes) {
      int64_t e = 1;
      for (VarKey x : axes)
        e *= v.shape[v.axis_of(x)];
      return e;
    };
    int64_t nb = extent_of(pa, batch), mm = extent_of(pa, m), nn = extent_of(pb, n);
    int64_t kk = pa.shape[pa.axis_of(k)];
    if (fp8_now_) {
      // Blocks of fp8_block along k; across it, one row of an operand over
      // the tokens or pairs (a dynamic Dim), fp8_block of a weight.
      auto over_tokens = [](const Value<S> &v) {
        return std::any_of(v.axes.begin(), v.axes.end(), [](VarKey x) { return x->dim.is_dynamic(); });
      };
      const int64_t across_a = over_tokens(pa) ? 1 : fp8_block, across_b = over_tokens(pb) ? 1 : fp8_block;
      // From the operand's bf16 value, as the GEMMs read it (dsl/fp8.h).
      auto to_bf16 = [](std::vector<S> &v) {
        for (S &x : v)
          x = static_cast<S>(bf16_value(bf16_bits(static_cast<float>(x))));
      };
      to_bf16(pa.data);
      to_bf16(pb.data);
      for (int64_t bi = 0; bi < nb; ++bi) {
        fp8_round_blocks(pa.data.data() + bi * mm * kk, mm, kk, kk, across_a, fp8_block, *fp8_now_);
        fp8_round_blocks(pb.data.data() + bi * kk * nn, kk, nn, nn, fp8_block, across_b, *fp8_now_);
      }
    }
    Value<S> out;
    out.axes = join(join(batch, m), n);
    for (VarKey x : out.axes)
      out.shape.push_back(x == k ? 0 : (pa.axis_of(x) >= 0 ? pa.shape[pa.axis_of(x)] : pb.shape[pb.axis_of(x)]));
    check_host_array({nb * mm, nn}, sizeof(S), "the reference's product");
    out.data.assign(static_cast<size_t>(nb * mm * nn), S(0));
    using Mat = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    for (int64_t bi = 0; bi < nb && kk > 0; ++bi) {
      Eigen::Map<const Mat> A(pa.data.data() + bi * mm * kk, mm, kk);
      Eigen::Map<const Mat> B(pb.data.data() + bi * kk * nn, kk, nn);
      Eigen::Map<Mat> C(out.data.data() + bi * mm * nn, mm, nn);
      C.noalias() = A * B;
    }
    return out;
  }

  // Flattens a product a * b * c ... into its factors.
  static void factors_of(const Expr &e, std::vector<Expr> &out) {
    if (auto *mul = e.as<Binary>(); mul && mul->op == BinaryOp::mul) {
      factors_of(mul->a, out);
      factors_of(mul->b, out);
    } else {
      out.push_back(e);
    }
  }

  // Under FP8 the grouping of a product into the contraction's two operands
  // decides what is rounded, so it must be the compiled GEMM's: the factors
  // that share an index besides k (the rows' side, the columns' side) are
  // one operand each, whatever order the algebra wrote them in (autodiff
  // writes d_w1's as x * d_h * h_rhs * silu'(...), which the backend's GEMM
  // multiplies as x times the rest). Factors over k alone join the first
  // side. Nullopt where the factors do not form exactly two sides.
  std::optional<std::pair<Value<S>, Value<S>>> fp8_operands(const Expr &body, VarKey k) {
    std::vector<Expr> factors;
    factors_of(body, factors);
    std::vector<Value<S>> values;
    for (const Expr &f : factors)
      values.push_back(eval(f));
    // side[i]: the operand factor i belongs to (-1: none yet).
    std::vector<int> side(values.size(), -1);
    int sides = 0;
    for (size_t i = 0; i < values.size(); ++i) {
      auto shares = [&](size_t j) {
        for (VarKey x : values[i].axes)
          if (x != k && values[j].axis_of(x) >= 0)
            return true;
        return false;
      };
      for (size_t j = 0; j < i && side[i] < 0; ++j)
        if (shares(j))
          side[i] = side[j];
      bool own = std::any_of(values[i].axes.begin(), values[i].axes.end(), [&](VarKey x) { return x != k; });
      if (side[i] < 0 && own)
        side[i] = sides++;
    }
    if (sides != 2)
      return std::nullopt;
    std::optional<Value<S>> a, b;
    for (size_t i = 0; i < values.size(); ++i) {
      std::optional<Value<S>> &to = side[i] == 1 ? b : a;
      to = to ? elementwise(BinaryOp::mul, *to, values[i]) : values[i];
    }
    if (a->axis_of(k) < 0 || b->axis_of(k) < 0)
      return std::nullopt;
    return std::pair{std::move(*a), std::move(*b)};
  }

  Value<S> eval_sum(VarKey k, const Expr &body) {
    if (fp8_now_)
      if (auto ab = fp8_operands(body, k))
        return contract(ab->first, ab->second, k);
    if (auto *mul = body.as<Binary>(); mul && mul->op == BinaryOp::mul) {
      Value<S> a = eval(mul->a), b = eval(mul->b);
      bool in_a = a.axis_of(k) >= 0, in_b = b.axis_of(k) >= 0;
      if (in_a && in_b)
        return contract(a, b, k);
      if (in_a)
        return elementwise(BinaryOp::mul, reduce(a, k), b);
      return elementwise(BinaryOp::mul, a, reduce(b, k));
    }
    return reduce(eval(body), k);
  }

  Value<S> softmax(const Value<S> &v, VarKey k) {
    std::vector<VarKey> axes;
    for (VarKey a : v.axes)
      if (a != k)
        axes.push_back(a);
    axes.push_back(k);
    Value<S> p = rearrange(v, axes);
    int64_t n = p.shape.back();
    for (int64_t row = 0; row * n < static_cast<int64_t>(p.data.size()); ++row) {
      S *x = &p.data[static_cast<size_t>(row * n)];
      S mx = *std::max_element(x, x + n);
      S total = 0;
      for (int64_t i = 0; i < n; ++i)
        total += (x[i] = std::exp(x[i] - mx));
      for (int64_t i = 0; i < n; ++i)
        x[i] /= total;
    }
    return p;
  }

  // Evaluates body over all pairs r of `route` into axes `rows_first` (r
  // first), one expert at a time when segment_by is set.
  Value<S> eval_rows(const Expr &body, const std::vector<VarKey> &rows_first, const RoutingNode *segment_by) {
    if (!segment_by)
      return rearrange(eval(body), rows_first);
    VarKey r = segment_by->pair.get();
    internal_check(rows_first.front() == r && !subset(r)) << "segmenting a restricted pair variable";
    const RoutingResult &res = routes_.at(segment_by);
    std::vector<std::vector<int64_t>> rows(static_cast<size_t>(res.experts));
    for (size_t p = 0; p < res.expert.size(); ++p)
      rows[res.expert[p]].push_back(static_cast<int64_t>(p));
    Value<S> out;
    out.axes = rows_first;
    for (VarKey k : rows_first)
      out.shape.push_back(domain_size(k));
    allocate(out); // zeros
    int64_t row_size = out.shape[0] ? product(out.shape) / out.shape[0] : 0;
    for (int64_t e = 0; e < res.experts; ++e) {
      if (rows[e].empty())
        continue;
      restricted_[r] = rows[e];
      fixed_expert_[segment_by] = e;
      Value<S> seg = rearrange(eval(body), rows_first);
      for (size_t i = 0; i < rows[e].size(); ++i)
        std::copy_n(seg.data.begin() + static_cast<int64_t>(i) * row_size, row_size,
                    out.data.begin() + rows[e][i] * row_size);
    }
    restricted_.erase(r);
    fixed_expert_.erase(segment_by);
    return out;
  }

  Value<S> eval_route_sum(const RouteSum &s) {
    const RoutingNode *route = s.route.get();
    const RoutingResult &res = routes_.at(route);
    VarKey r = route->pair.get(), t = s.target.get();
    internal_check(!subset(r) && !fixed_expert_.count(route)) << "nested sums over one route";
    std::vector<VarKey> others;
    for (const Var &v : free_vars(s.body))
      if (v.get() != r)
        others.push_back(v.get());
    Value<S> out;
    out.axes = {t};
    out.axes.insert(out.axes.end(), others.begin(), others.end());
    for (VarKey k : out.axes)
      out.shape.push_back(domain_size(k));
    allocate(out); // zeros
    int64_t row_size = out.shape[0] ? product(out.shape) / out.shape[0] : product(out.shape);
    // Where each value of the target lands along the output's first axis.
    std::vector<int64_t> position(static_cast<size_t>(extent(t->dim.get())), -1);
    if (const auto *sub = subset(t))
      for (size_t i = 0; i < sub->size(); ++i)
        position[(*sub)[i]] = static_cast<int64_t>(i);
    else
      std::iota(position.begin(), position.end(), 0);

    if (s.field == RouteField::token) {
      std::vector<VarKey> rows_first{r};
      rows_first.insert(rows_first.end(), others.begin(), others.end());
      Value<S> rows = eval_rows(s.body, rows_first, reads_expert(s.body, route) ? route : nullptr);
      for (size_t p = 0; p < res.token.size(); ++p) {
        int64_t at = position[res.token[p]];
        if (at < 0 || !res.is_kept(p))
          continue;
        for (int64_t i = 0; i < row_size; ++i)
          out.data[at * row_size + i] += rows.data[p * row_size + i];
      }
      return out;
    }
    // Per-expert: a contraction over the rows routed to (and kept by) each
    // expert.
    std::vector<std::vector<int64_t>> rows(static_cast<size_t>(res.experts));
    for (size_t p = 0; p < res.expert.size(); ++p)
      if (res.is_kept(p))
        rows[res.expert[p]].push_back(static_cast<int64_t>(p));
    for (int64_t e = 0; e < res.experts; ++e) {
      int64_t at = position[e];
      if (at < 0)
        continue;
      restricted_[r] = rows[e];
      fixed_expert_[route] = e;
      Value<S> seg = rearrange(eval_sum(r, s.body), others);
      std::copy(seg.data.begin(), seg.data.end(), out.data.begin() + at * row_size);
    }
    restricted_.erase(r);
    fixed_expert_.erase(route);
    return out;
  }

  const Pipeline &pipeline_;
  std::map<const DimNode *, int64_t> extents_;
  // An Input's or Param's values: the caller's doubles read in place, or a
  // float copy (Precision::f32). The caller's TensorMap outlives the run.
  struct Source {
    std::vector<int64_t> shape;
    std::vector<S> owned;
    const S *values = nullptr;
    std::vector<int64_t> strides() const { return row_major_strides(shape); }
  };
  std::map<const BufferNode *, Source> buffers_;
  const std::map<std::string, std::vector<int32_t>> &given_;
  double capacity_factor_;
  std::map<std::string, Fp8Format> fp8_;
  std::optional<Fp8Format> fp8_now_; // the Func being evaluated takes FP8 operands
  std::map<const FuncNode *, Value<S>> funcs_;
  std::map<const RoutingNode *, RoutingResult> routes_;
  std::map<VarKey, std::vector<int64_t>> restricted_;
  std::map<const RoutingNode *, int64_t> fixed_expert_;
};

} // namespace

EvalResult evaluate(const Pipeline &p, const TensorMap &inputs, Precision precision) {
  return evaluate(p, inputs, precision, {});
}

EvalResult evaluate(const Pipeline &p, const TensorMap &inputs, Precision precision, const EvalOptions &options) {
  TensorViews views;
  for (const auto &[name, t] : inputs)
    views[name] = &t;
  return evaluate(p, views, precision, options);
}

EvalResult evaluate(const Pipeline &p, const TensorViews &inputs, Precision precision, const EvalOptions &options) {
  for (const auto &[name, t] : inputs)
    internal_check(t) << "no tensor behind input '" << name << "'";
  if (precision == Precision::f32)
    return Evaluator<float>(p, inputs, options).run();
  return Evaluator<double>(p, inputs, options).run();
}

} // namespace moeforge
