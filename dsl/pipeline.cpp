#include "dsl/pipeline.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include "dsl/error.h"
#include "dsl/printer.h"
#include "dsl/visitor.h"

namespace moeforge {

namespace {

// What one definition reads directly.
struct Dependencies : IRVisitor {
  std::vector<FuncPtr> funcs;
  std::vector<BufferPtr> buffers;
  std::vector<RoutingPtr> routes;
  std::vector<Var> vars; // every index variable the expression names

  template <typename T> static void add(std::vector<T> &v, const T &x) {
    if (std::find(v.begin(), v.end(), x) == v.end())
      v.push_back(x);
  }
  void visit_node(const Access &a) override {
    if (a.func)
      add(funcs, a.func);
    else
      add(buffers, a.buffer);
    for (const Index &i : a.args) {
      add(vars, i.var);
      if (i.route)
        add(routes, i.route);
    }
  }
  void visit_node(const Sum &s) override {
    add(vars, s.var);
    IRVisitor::visit_node(s);
  }
  void visit_node(const Softmax &s) override {
    add(vars, s.var);
    IRVisitor::visit_node(s);
  }
  void visit_node(const RouteSum &s) override {
    add(routes, s.route);
    add(vars, s.target);
    IRVisitor::visit_node(s);
  }
  void visit_node(const IndexEq &q) override {
    for (const Index *i : {&q.a, &q.b}) {
      add(vars, i->var);
      if (i->route)
        add(routes, i->route);
    }
  }
};

} // namespace

Pipeline::Pipeline(std::vector<Func> outputs) : outputs_(std::move(outputs)) {
  user_check(!outputs_.empty()) << "a Pipeline needs at least one output Func";
  std::set<const void *> done, active;
  std::map<std::string, const void *> names; // every tensor name must be unique

  auto claim_name = [&](const std::string &name, const void *owner) {
    auto [it, fresh] = names.emplace(name, owner);
    user_check(fresh || it->second == owner)
        << "two different tensors are named '" << name << "' in this pipeline: give each Func, Input and Param "
        << "its own name";
  };
  auto add_dim = [&](const Dim &d) {
    if (std::any_of(dims_.begin(), dims_.end(), [&](const Dim &x) { return x.same_as(d); }))
      return;
    // The algebra's text, schedules and messages tell Dims apart by name.
    for (const Dim &x : dims_)
      user_check(x.name() != d.name() || x.extent() == d.extent())
          << "two different Dims are named '" << d.name() << "' in this pipeline, of extents "
          << (x.is_dynamic() ? std::string("dynamic") : std::to_string(x.extent())) << " and "
          << (d.is_dynamic() ? std::string("dynamic") : std::to_string(d.extent())) << ": give each Dim its own name";
    dims_.push_back(d);
  };

  // The algebra's text names index variables too: one name over two Dims
  // would print `sum(i, x(t, i) * w(i, i))` for a contraction over D into F.
  std::map<std::string, Dim> var_dims;
  auto check_var = [&](const Var &v, const std::string &func) {
    auto [it, fresh] = var_dims.emplace(v.name(), v.dim());
    user_check(fresh || it->second.same_as(v.dim()))
        << "two Vars named '" << v.name() << "' range over different Dims (" << it->second.name() << " and "
        << v.dim().name() << "), the second in '" << func << "': give each Var its own name";
  };

  // Post-order DFS: a step is emitted after everything it reads.
  std::function<void(const FuncPtr &)> visit_func;
  std::function<void(const RoutingPtr &)> visit_route = [&](const RoutingPtr &r) {
    if (done.count(r.get()))
      return;
    visit_func(r->probs);
    done.insert(r.get());
    routes_.push_back(r);
    add_dim(r->pairs);
    steps_.push_back(Step{nullptr, r});
  };
  visit_func = [&](const FuncPtr &f) {
    if (done.count(f.get()))
      return;
    user_check(f->defined()) << "'" << f->name << "' is part of the pipeline but never defined";
    internal_check(!active.count(f.get())) << "cycle through " << f->name;
    active.insert(f.get());
    claim_name(f->name, f.get());
    Dependencies deps;
    deps.visit(f->body);
    for (const Var &v : f->args)
      check_var(v, f->name);
    for (const Var &v : deps.vars)
      check_var(v, f->name);
    for (const FuncPtr &g : deps.funcs)
      visit_func(g);
    for (const RoutingPtr &r : deps.routes)
      visit_route(r);
    // Buffers are listed in the order the steps first read them.
    for (const BufferPtr &b : deps.buffers) {
      claim_name(b->name, b.get());
      if (std::find(buffers_.begin(), buffers_.end(), b) == buffers_.end()) {
        buffers_.push_back(b);
        for (const Dim &d : b->dims)
          add_dim(d);
      }
    }
    active.erase(f.get());
    done.insert(f.get());
    for (const Var &v : f->args)
      add_dim(v.dim());
    steps_.push_back(Step{f, nullptr});
  };
  for (const Func &f : outputs_) {
    user_check(f.node() != nullptr) << "a Pipeline output is an empty Func";
    visit_func(f.node());
  }
}

std::vector<Func> Pipeline::funcs() const {
  std::vector<Func> out;
  for (const Step &s : steps_)
    if (s.func)
      out.emplace_back(s.func);
  return out;
}

Func Pipeline::func(const std::string &name) const {
  std::string known;
  for (const Step &s : steps_) {
    if (!s.func)
      continue;
    if (s.func->name == name)
      return Func(s.func);
    known += (known.empty() ? "" : ", ") + s.func->name;
  }
  user_error << "no Func named '" << name << "' in this pipeline; its Funcs are: " << known;
}

BufferPtr Pipeline::buffer(const std::string &name) const {
  std::string known;
  for (const BufferPtr &b : buffers_) {
    if (b->name == name)
      return b;
    known += (known.empty() ? "" : ", ") + b->name;
  }
  user_error << "no Input or Param named '" << name << "' in this pipeline; it has: " << known;
}

void Pipeline::print(std::ostream &os) const {
  os << "dims:";
  for (const Dim &d : dims_)
    os << "  " << d << ";";
  os << "\n";
  for (const BufferPtr &b : buffers_)
    os << *b << "\n";
  for (const Step &s : steps_) {
    if (s.route)
      os << *s.route << "\n";
    else
      os << Func(s.func) << "  : " << dtype_name(s.func->dtype) << "\n";
  }
  os << "outputs:";
  for (const Func &f : outputs_)
    os << " " << f.name();
  os << "\n";
}

std::ostream &operator<<(std::ostream &os, const Pipeline &p) {
  p.print(os);
  return os;
}

} // namespace moeforge
