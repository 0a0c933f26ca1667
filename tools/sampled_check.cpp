#include "tools/sampled_check.h"

#include <algorithm>
#include <random>
#include <set>
#include <thread>

#include "dsl/error.h"
#include "dsl/visitor.h"

namespace moeforge {

namespace {

// How many token rows one index of `d` spans: 1 for the token Dim, k for a
// route's pairs (T * k); 0 for a Dim that does not grow with the tokens.
int64_t token_factor(const Dim &d) {
  int64_t factor = 1;
  const DimNode *n = d.get();
  for (; n->base; n = n->base.get())
    factor *= n->factor;
  return n->extent < 0 ? factor : 0;
}

struct Blocker : IRVisitor {
  std::string func, why;
  void visit_node(const Sum &s) override {
    if (token_factor(s.var.dim()) && why.empty())
      why = "'" + func + "' sums over the tokens";
    IRVisitor::visit_node(s);
  }
  void visit_node(const Softmax &s) override {
    if (token_factor(s.var.dim()) && why.empty())
      why = "'" + func + "' takes a softmax over the tokens";
    IRVisitor::visit_node(s);
  }
  void visit_node(const RouteSum &s) override {
    if (s.field == RouteField::expert && why.empty())
      why = "'" + func + "' sums each expert's rows";
    IRVisitor::visit_node(s);
  }
  void visit_node(const Extent &e) override {
    if (token_factor(e.dim) && why.empty())
      why = "'" + func + "' reads the token count";
    IRVisitor::visit_node(e);
  }
};

// The first index's token factor, or a blocker when a later index has one.
int64_t first_factor(const std::vector<Dim> &dims, const std::string &name, std::string *why) {
  for (size_t i = 1; i < dims.size(); ++i)
    if (token_factor(dims[i]) && why && why->empty())
      *why = "'" + name + "' has its token index in position " + std::to_string(i + 1);
  return dims.empty() ? 0 : token_factor(dims[0]);
}

std::vector<Dim> func_dims(const Func &f) {
  std::vector<Dim> dims;
  for (const Var &v : f.args())
    dims.push_back(v.dim());
  return dims;
}

// Rows (of `row` elements each) `factor * t + j`, j < factor, for the sampled t.
HostTensor take_rows(const HostTensor &full, int64_t factor, const std::vector<int64_t> &tokens) {
  HostTensor out;
  out.shape = full.shape;
  int64_t row = 1;
  for (size_t i = 1; i < full.shape.size(); ++i)
    row *= full.shape[i];
  out.shape[0] = static_cast<int64_t>(tokens.size()) * factor;
  for (int64_t t : tokens)
    out.data.insert(out.data.end(), full.data.begin() + t * factor * row, full.data.begin() + (t + 1) * factor * row);
  return out;
}

} // namespace

std::string token_sampling_blocker(const Pipeline &p) {
  for (const RoutingPtr &r : p.routes())
    if (r->expert_choice())
      return "route '" + r->name + "' lets each expert choose among every token";
  Blocker b;
  for (const Func &f : p.funcs()) {
    b.func = f.name();
    b.visit(f.body());
    first_factor(func_dims(f), f.name(), &b.why);
    if (!b.why.empty())
      return b.why;
  }
  for (const BufferPtr &buf : p.buffers()) {
    first_factor(buf->dims, buf->name, &b.why);
    if (!b.why.empty())
      return b.why;
  }
  return "";
}

TokenSample sample_tokens(const Pipeline &p, TensorMap inputs, int64_t tokens, int64_t count, uint64_t seed) {
  internal_check(count >= 1 && count <= tokens) << "sample_tokens: " << count << " of " << tokens;
  std::mt19937_64 rng(seed);
  std::set<int64_t> chosen;
  std::uniform_int_distribution<int64_t> pick(0, tokens - 1);
  while (static_cast<int64_t>(chosen.size()) < count)
    chosen.insert(pick(rng));
  TokenSample s;
  s.tokens.assign(chosen.begin(), chosen.end());
  for (const BufferPtr &b : p.buffers()) {
    HostTensor &t = inputs.at(b->name);
    const int64_t factor = first_factor(b->dims, b->name, nullptr);
    s.inputs[b->name] = factor ? take_rows(t, factor, s.tokens) : std::move(t);
  }
  return s;
}

EvalResult evaluate_sample(const Pipeline &p, const TokenSample &s, int groups) {
  const int64_t n = static_cast<int64_t>(s.tokens.size());
  groups = static_cast<int>(std::clamp<int64_t>(groups, 1, n));
  if (groups == 1)
    return evaluate(p, s.inputs);
  // Group g: the sample's tokens [first[g], first[g + 1]), as positions in
  // the sample (whose token-indexed inputs hold only the sampled rows).
  std::vector<int64_t> first(static_cast<size_t>(groups) + 1);
  for (int g = 0; g <= groups; ++g)
    first[static_cast<size_t>(g)] = n * g / groups;
  std::vector<TensorMap> rows(static_cast<size_t>(groups)); // each group's token-indexed inputs
  std::vector<TensorViews> views(static_cast<size_t>(groups));
  for (int g = 0; g < groups; ++g) {
    std::vector<int64_t> positions;
    for (int64_t i = first[static_cast<size_t>(g)]; i < first[static_cast<size_t>(g) + 1]; ++i)
      positions.push_back(i);
    for (const BufferPtr &b : p.buffers()) {
      const HostTensor &t = s.inputs.at(b->name);
      if (const int64_t factor = first_factor(b->dims, b->name, nullptr)) {
        rows[static_cast<size_t>(g)][b->name] = take_rows(t, factor, positions);
        views[static_cast<size_t>(g)][b->name] = &rows[static_cast<size_t>(g)].at(b->name);
      } else {
        views[static_cast<size_t>(g)][b->name] = &t; // the weights: one copy for every group
      }
    }
  }
  std::vector<EvalResult> parts(static_cast<size_t>(groups));
  std::vector<std::exception_ptr> failed(static_cast<size_t>(groups));
  std::vector<std::thread> pool;
  for (int g = 0; g < groups; ++g)
    pool.emplace_back([&, g] {
      try {
        parts[static_cast<size_t>(g)] = evaluate(p, views[static_cast<size_t>(g)]);
      } catch (...) {
        failed[static_cast<size_t>(g)] = std::current_exception();
      }
    });
  for (std::thread &t : pool)
    t.join();
  for (const std::exception_ptr &e : failed)
    if (e)
      std::rethrow_exception(e);

  // Token-indexed Funcs: the groups' rows one after another; the others
  // (over the weights alone) are the same in every group.
  EvalResult out = std::move(parts[0]);
  for (const Func &f : p.funcs()) {
    const int64_t factor = first_factor(func_dims(f), f.name(), nullptr);
    if (!factor)
      continue;
    HostTensor &v = out.values.at(f.name());
    for (int g = 1; g < groups; ++g) {
      const HostTensor &more = parts[static_cast<size_t>(g)].values.at(f.name());
      v.data.insert(v.data.end(), more.data.begin(), more.data.end());
      v.shape[0] += more.shape[0];
    }
  }
  for (auto &[name, route] : out.routes)
    for (int g = 1; g < groups; ++g) {
      const RoutingResult &more = parts[static_cast<size_t>(g)].routes.at(name);
      for (int32_t t : more.token)
        route.token.push_back(static_cast<int32_t>(t + route.tokens));
      route.expert.insert(route.expert.end(), more.expert.begin(), more.expert.end());
      route.tokens += more.tokens;
    }
  for (const Dim &d : p.dims())
    if (const int64_t factor = token_factor(d))
      out.extents[d.name()] = n * factor;
  return out;
}

HostTensor sample_rows(const Pipeline &p, const std::string &func, const HostTensor &full, const TokenSample &s) {
  const int64_t factor = first_factor(func_dims(p.func(func)), func, nullptr);
  return factor ? take_rows(full, factor, s.tokens) : full;
}

} // namespace moeforge
