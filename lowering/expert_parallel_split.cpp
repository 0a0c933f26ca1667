#include "lowering/expert_parallel_split.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <set>

#include "dsl/error.h"
#include "dsl/ops.h"
#include "dsl/printer.h"
#include "dsl/visitor.h"

namespace moeforge {

namespace {

std::string lower_name(const std::string &s) {
  std::string out = s;
  for (char &c : out)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// A Func over the pairs whose values depend on the expert's weights: it
// reads a Param through expert(r), or such a Func.
std::set<const FuncNode *> expert_side_funcs(const Pipeline &p, const RoutingNode &route) {
  std::set<const FuncNode *> side;
  for (const Pipeline::Step &step : p.steps()) {
    if (!step.func || step.func->args.empty() || !step.func->args[0].same_as(route.pair))
      continue;
    struct Finder : IRVisitor {
      const std::set<const FuncNode *> *side;
      const RoutingNode *route;
      bool found = false;
      void visit_node(const Access &a) override {
        if (a.func && side->count(a.func.get()))
          found = true;
        if (a.buffer && a.buffer->kind == BufferKind::param)
          for (const Index &ix : a.args)
            found = found || (ix.route.get() == route && ix.field == RouteField::expert);
      }
    } finder;
    finder.side = &side;
    finder.route = &route;
    finder.visit(step.func->body);
    if (finder.found)
      side.insert(step.func.get());
  }
  return side;
}

// A Func like `f`: its name, declared type and schedule owner.
Func like(const FuncNode &f) {
  Func g = f.has_declared_type ? Func(f.name, f.dtype) : Func(f.name);
  g.node()->schedule_of = f.schedule_of;
  return g;
}

std::vector<Index> as_indices(const std::vector<Var> &vars) { return {vars.begin(), vars.end()}; }

class Splitter {
public:
  Splitter(const Pipeline &p, int ranks) : p_(p) {
    user_check(p.routes().size() == 1) << "expert_parallel: the layer has " << p.routes().size()
                                       << " routes; expert parallelism spreads the experts of exactly one top_k route";
    route_ = p.routes().front();
    user_check(!route_->expert_choice())
        << "expert_parallel: route '" << route_->name
        << "' is expert choice, whose pairs per token vary; spread a top_k route's experts";
    const int64_t experts = route_->expert_dim().extent();
    user_check(ranks >= 1 && experts % ranks == 0)
        << "expert_parallel(" << ranks << "): the " << experts << " experts of route '" << route_->name
        << "' do not split evenly over " << ranks << " ranks; choose a rank count that divides " << experts;
    out_.route = route_->name;
    out_.experts = experts;
    out_.ranks = ranks;
    out_.local_experts = experts / ranks;
    side_ = expert_side_funcs(p, *route_);
    user_check(!side_.empty()) << "expert_parallel: no Func of route '" << route_->name
                               << "' reads a weight through expert(r); there is nothing to spread";

    // The expert side's own route over the received rows.
    rows_ = Dim::dynamic("N");
    local_ = Dim(route_->expert_dim().name(), out_.local_experts);
    Var n("n", rows_), le(route_->expert_var.name(), local_);
    Input select("expert_select", {rows_, local_}, DType::f32);
    Func scores("expert_select_scores", DType::f32);
    scores(n, le) = select(n, le);
    TopKOptions one;
    one.name = route_->name;
    local_route_ = top_k(scores, le, 1, one).node();
    out_.selector = select.name();
  }

  ExpertParallelSplit run() {
    for (const Func &o : p_.outputs()) {
      user_check(!side_.count(o.node().get()))
          << "expert_parallel: output '" << o.name() << "' is computed per expert; only what the combine sums "
          << "returns to the tokens: make the layer's output a combine over route '" << route_->name << "'";
      out_.token_outputs.push_back(token_func(o));
    }
    for (const auto &[name, f] : dispatched_outputs_)
      out_.token_outputs.push_back(f);
    for (const auto &[name, f] : returned_outputs_)
      out_.expert_outputs.push_back(f);
    return std::move(out_);
  }

private:
  // ---- the expert side

  class ToExperts : public IRMutator {
  public:
    explicit ToExperts(Splitter &s, const FuncNode &f) : s_(s), f_(f) {}

  protected:
    Expr mutate_node(const Access &a, const Expr &) override { return s_.expert_access(a, f_); }
    Expr mutate_node(const RouteSum &n, const Expr &) override {
      user_error << "expert_parallel: '" << f_.name << "' is computed per expert and sums over route '" << n.route->name
                 << "' inside: a sum over pairs needs every rank's rows; move it to the token side";
      return {};
    }
    Expr mutate_node(const IndexEq &n, const Expr &self) override {
      user_check(n.a.is_plain() && n.b.is_plain())
          << "expert_parallel: '" << f_.name << "' compares route indices; it cannot run on the experts' ranks";
      return self;
    }

  private:
    Splitter &s_;
    const FuncNode &f_;
  };

  const Var &local_pair() const { return local_route_->pair; }

  Expr expert_access(const Access &a, const FuncNode &reader) {
    std::vector<Index> args;
    bool via_token = false, via_expert = false;
    for (const Index &ix : a.args) {
      if (!ix.is_plain()) {
        user_check(ix.route == route_) << "expert_parallel: '" << reader.name << "' reads through two routes";
        via_token = via_token || ix.field == RouteField::token;
        via_expert = via_expert || ix.field == RouteField::expert;
        args.emplace_back(local_route_, ix.field, local_pair());
      } else if (ix.var.same_as(route_->pair)) {
        args.emplace_back(local_pair());
      } else {
        args.push_back(ix);
      }
    }
    const std::string &target = a.target_name();
    const bool first_routed = !a.args.empty() && !a.args[0].is_plain();
    const bool rest_plain = std::all_of(a.args.begin() + (a.args.empty() ? 0 : 1), a.args.end(),
                                        [](const Index &ix) { return ix.is_plain(); });
    if (a.func && side_.count(a.func.get()))
      return Access::make(expert_func(*a.func).node(), args);
    if (via_token) {
      user_check(first_routed && rest_plain && !via_expert)
          << "expert_parallel: '" << reader.name << "' reads '" << target
          << "' through token(r) other than as its first index; read a token's row as " << target << "(token(r), ...)";
      return Access::make(dispatched_input(a).node(), args);
    }
    if (via_expert) {
      user_check(a.buffer && a.buffer->kind == BufferKind::param && first_routed && rest_plain &&
                 a.buffer->dims[0].same_as(route_->expert_dim()))
          << "expert_parallel: '" << reader.name << "' reads '" << target
          << "' through expert(r); only a Param whose first Dim is the experts can be split over ranks, read as "
          << target << "(expert(r), ...)";
      return Access::make(expert_param(*a.buffer).node(), args);
    }
    if (a.buffer)
      user_error << "expert_parallel: '" << reader.name << "' reads '" << target
                 << "', which every expert shares: its gradient would be split over the ranks; index it by "
                 << "expert(r) (one per expert) or apply it on the token side";
    else
      user_error << "expert_parallel: '" << reader.name << "' is computed per expert and reads '" << target
                 << "', computed where the tokens are, per pair; apply it in the combine instead";
    return {};
  }

  Func expert_func(const FuncNode &f) {
    auto it = expert_funcs_.find(&f);
    if (it != expert_funcs_.end())
      return it->second;
    Func g = like(f);
    std::vector<Var> args = f.args;
    args[0] = local_pair();
    g(as_indices(args)) = ToExperts(*this, f).mutate(f.body);
    return expert_funcs_[&f] = g;
  }

  // The received rows of a tensor the experts read through token(r).
  Input dispatched_input(const Access &a) {
    const std::string &name = a.target_name();
    auto it = dispatched_inputs_.find(name);
    if (it != dispatched_inputs_.end())
      return it->second;
    std::vector<Dim> dims{rows_};
    std::vector<Var> rest;
    int64_t width = 1;
    for (size_t k = 1; k < a.target_rank(); ++k) {
      Dim d = a.target_dim(k);
      user_check(!d.is_dynamic()) << "expert_parallel: '" << name << "' is read per token with a dynamic Dim "
                                  << d.name() << " beyond the first; its rows must have a fixed width";
      dims.push_back(d);
      width *= d.extent();
      rest.push_back(a.func ? a.func->args[k] : Var(lower_name(d.name()), d));
    }
    const DType dtype = a.func ? a.func->dtype : a.buffer->dtype;
    const std::string rows = name + "_rows";
    Input in(rows, dims, dtype);
    // The token side gathers the rows it sends, pair order.
    Func gathered(rows, dtype);
    std::vector<Index> read{Index(route_, RouteField::token, route_->pair)};
    for (const Var &v : rest)
      read.emplace_back(v);
    std::vector<Var> at{route_->pair};
    at.insert(at.end(), rest.begin(), rest.end());
    Expr value = a.func ? Access::make(a.func, read) : Access::make(a.buffer, read);
    if (a.func && depends_on_side(*a.func))
      user_error << "expert_parallel: the experts read '" << name << "' per token, which itself needs the experts";
    gathered(as_indices(at)) = value;
    dispatched_outputs_.emplace_back(name, gathered);
    out_.dispatched.push_back({rows, rows, width, dtype});
    return dispatched_inputs_.emplace(name, in).first->second;
  }

  Param expert_param(const BufferNode &b) {
    auto it = expert_params_.find(b.name);
    if (it != expert_params_.end())
      return it->second;
    std::vector<Dim> dims = b.dims;
    dims[0] = local_;
    out_.expert_params.push_back(b.name);
    return expert_params_.emplace(b.name, Param(b.name, dims, b.dtype)).first->second;
  }

  // ---- the token side

  class ToTokens : public IRMutator {
  public:
    explicit ToTokens(Splitter &s) : s_(s) {}

  protected:
    Expr mutate_node(const Access &a, const Expr &self) override {
      if (!a.func)
        return self;
      if (s_.side_.count(a.func.get()))
        return Access::make(s_.returned_input(a).node(), a.args);
      if (s_.depends_on_side(*a.func))
        return Access::make(s_.token_func(Func(a.func)).node(), a.args);
      return self;
    }

  private:
    Splitter &s_;
  };

  bool depends_on_side(const FuncNode &f) {
    if (side_.count(&f))
      return true;
    auto it = depends_.find(&f);
    if (it != depends_.end())
      return it->second;
    struct Finder : IRVisitor {
      Splitter *s;
      bool found = false;
      void visit_node(const Access &a) override { found = found || (a.func && s->depends_on_side(*a.func)); }
    } finder;
    finder.s = this;
    finder.visit(f.body);
    return depends_[&f] = finder.found;
  }

  Func token_func(const Func &f) {
    if (!depends_on_side(*f.node()))
      return f;
    auto it = token_funcs_.find(f.node().get());
    if (it != token_funcs_.end())
      return it->second;
    Func g = like(*f.node());
    g(as_indices(f.args())) = ToTokens(*this).mutate(f.body());
    return token_funcs_[f.node().get()] = g;
  }

  // The rows an expert-side Func sends back, read by the token side.
  Input returned_input(const Access &a) {
    const FuncNode &f = *a.func;
    user_check(!a.args.empty() && a.args[0].is_plain() && a.args[0].var.same_as(route_->pair) &&
               std::all_of(a.args.begin() + 1, a.args.end(), [](const Index &ix) { return ix.is_plain(); }))
        << "expert_parallel: '" << f.name << "' is computed per expert and read other than at its own pair ("
        << to_string(Access::make(a.func, a.args)) << "); read it as " << f.name << "(r, ...)";
    auto it = returned_inputs_.find(f.name);
    if (it != returned_inputs_.end())
      return it->second;
    std::vector<Dim> dims{route_->pairs};
    int64_t width = 1;
    for (size_t k = 1; k < f.args.size(); ++k) {
      dims.push_back(f.args[k].dim());
      width *= f.args[k].dim().extent();
    }
    // The experts send it back in received-row order: the combine of a
    // top-1 route puts each pair's row at its received row.
    Func back(f.name + "_rows", f.dtype);
    std::vector<Var> at{local_route_->token_var};
    std::vector<Index> read{Index(local_pair())};
    for (size_t k = 1; k < f.args.size(); ++k) {
      at.push_back(f.args[k]);
      read.emplace_back(f.args[k]);
    }
    back(as_indices(at)) = RouteSum::make(local_route_, RouteField::token, local_route_->token_var,
                                          Access::make(expert_func(f).node(), read));
    returned_outputs_.emplace_back(f.name, back);
    const std::string returned = f.name + "_returned";
    out_.returned.push_back({returned, back.name(), width, f.dtype});
    return returned_inputs_.emplace(f.name, Input(returned, dims, f.dtype)).first->second;
  }

  const Pipeline &p_;
  RoutingPtr route_, local_route_;
  Dim rows_, local_;
  std::set<const FuncNode *> side_;
  std::map<const FuncNode *, bool> depends_;
  std::map<const FuncNode *, Func> expert_funcs_, token_funcs_;
  std::map<std::string, Input> dispatched_inputs_, returned_inputs_;
  std::map<std::string, Param> expert_params_;
  std::vector<std::pair<std::string, Func>> dispatched_outputs_, returned_outputs_;
  ExpertParallelSplit out_;
};

} // namespace

ExpertParallelSplit split_expert_parallel(const Pipeline &p, int ranks) { return Splitter(p, ranks).run(); }

} // namespace moeforge
