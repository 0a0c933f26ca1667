#include "lowering/kernel_program.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "dsl/error.h"
#include "dsl/printer.h"
#include "dsl/visitor.h"
#include "lowering/gemm_plan.h"

namespace moeforge {

const char *row_layout_name(RowLayout l) {
  switch (l) {
  case RowLayout::dense:
    return "dense";
  case RowLayout::pair:
    return "pair";
  case RowLayout::padded:
    return "padded";
  case RowLayout::padded_t:
    return "padded_t";
  case RowLayout::sorted:
    return "sorted";
  }
  return "?";
}

const char *row_map_name(RowMap m) {
  switch (m) {
  case RowMap::direct:
    return "direct";
  case RowMap::gather_pair:
    return "gather_pair";
  case RowMap::gather_token:
    return "gather_token";
  }
  return "?";
}

const TensorDecl &KernelProgram::tensor(const std::string &name) const {
  for (const TensorDecl &t : tensors)
    if (t.name == name)
      return t;
  internal_check(false) << "no tensor '" << name << "' in the kernel program";
}

const RoutingStep &KernelProgram::routing(const RoutingNode *r) const {
  for (const Step &s : steps)
    if (auto *rs = std::get_if<RoutingStep>(&s); rs && rs->route == r)
      return *rs;
  internal_check(false) << "no routing step for route '" << r->name << "' in the kernel program";
}

TensorDecl *KernelProgram::find(const std::string &name) {
  for (TensorDecl &t : tensors)
    if (t.name == name)
      return &t;
  return nullptr;
}

const TensorDecl *KernelProgram::find(const std::string &name) const {
  return const_cast<KernelProgram *>(this)->find(name);
}

FuncPtr placeholder(const std::string &name, std::vector<Var> args, DType t) {
  auto f = std::make_shared<FuncNode>();
  f->name = name;
  f->args = std::move(args);
  f->dtype = t;
  return f;
}

Expr tensor_read(const std::string &name, DType dtype, std::vector<Index> args) {
  std::vector<Var> vars;
  for (const Index &i : args)
    vars.push_back(i.var);
  return Access::make(placeholder(name, std::move(vars), dtype), std::move(args));
}

std::string step_name(const Step &s) {
  return std::visit(
      [](const auto &x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, RoutingStep>)
          return "route_" + x.route->name;
        else
          return x.name;
      },
      s);
}

std::string pointwise_name(const PointwiseStep &s) {
  std::string name = "pointwise_" + s.output;
  for (const ExtraOutput &e : s.extra)
    name += "_" + e.output;
  return name;
}

std::vector<std::string> step_reads(const Step &s) {
  struct Reads : IRVisitor {
    std::vector<std::string> names;
    void visit_node(const Access &a) override { names.push_back(a.target_name()); }
  } r;
  std::visit(
      [&](const auto &x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, GemmStep>) {
          r.names.push_back(x.a);
          r.names.insert(r.names.end(), x.b.begin(), x.b.end());
          if (x.chained) {
            r.names.push_back(x.chained->a);
            r.names.push_back(x.chained->b);
          }
          r.visit(x.epilogue);
          for (const GemmStep::Extra &e : x.extra)
            r.visit(e.value);
        } else if constexpr (std::is_same_v<T, PointwiseStep>) {
          r.visit(x.body);
          for (const ExtraOutput &e : x.extra)
            r.visit(e.value);
        } else if constexpr (std::is_same_v<T, GatherStep> || std::is_same_v<T, TransposeStep>) {
          r.names.push_back(x.src);
        } else if constexpr (std::is_same_v<T, AttentionStep>) {
          r.names.insert(r.names.end(), {x.q, x.key, x.value});
          if (x.part == AttentionStep::Part::query_gradient)
            r.names.insert(r.names.end(), {x.z, x.d_z, x.lse});
          else if (x.part == AttentionStep::Part::key_gradient)
            r.names.insert(r.names.end(), {x.d_z, x.lse, x.delta});
        } else {
          r.names.push_back(x.probs);
        }
      },
      s);
  return r.names;
}

bool is_output(const KernelProgram &p, const std::string &name) {
  return std::find(p.outputs.begin(), p.outputs.end(), name) != p.outputs.end();
}

int reads_of(const KernelProgram &p, const std::string &name) {
  int n = 0;
  for (const Step &s : p.steps)
    for (const std::string &r : step_reads(s))
      n += r == name;
  return n;
}

bool unwanted(const KernelProgram &p, const std::string &name) { return !is_output(p, name) && reads_of(p, name) == 0; }

void erase_tensor(KernelProgram &p, const std::string &name) {
  p.tensors.erase(
      std::remove_if(p.tensors.begin(), p.tensors.end(), [&](const TensorDecl &t) { return t.name == name; }),
      p.tensors.end());
}

std::string step_output(const Step &s) {
  return std::visit(
      [](const auto &x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, RoutingStep>)
          return "";
        else if constexpr (std::is_same_v<T, GatherStep> || std::is_same_v<T, TransposeStep>)
          return x.dst;
        else
          return x.output;
      },
      s);
}

std::vector<std::string> step_outputs(const Step &s) {
  std::vector<std::string> out;
  if (std::string o = step_output(s); !o.empty())
    out.push_back(o);
  if (auto *g = std::get_if<GemmStep>(&s))
    for (const GemmStep::Extra &e : g->extra)
      out.push_back(e.output);
  if (auto *pw = std::get_if<PointwiseStep>(&s))
    for (const ExtraOutput &e : pw->extra)
      out.push_back(e.output);
  if (auto *r = std::get_if<RoutingStep>(&s); r && !r->gate_output.empty())
    out.push_back(r->gate_output);
  if (auto *a = std::get_if<AttentionStep>(&s)) {
    using Part = AttentionStep::Part;
    const std::string &second = a->part == Part::forward          ? a->lse
                                : a->part == Part::query_gradient ? a->delta
                                                                  : a->d_value;
    if (!second.empty())
      out.push_back(second);
  }
  return out;
}

std::vector<std::string> attention_row_tensors(const AttentionStep &a) {
  switch (a.part) {
  case AttentionStep::Part::forward:
    return a.lse.empty() ? std::vector<std::string>{a.q, a.output} : std::vector<std::string>{a.q, a.output, a.lse};
  case AttentionStep::Part::query_gradient:
    return {a.q, a.output, a.z, a.d_z, a.lse, a.delta};
  case AttentionStep::Part::key_gradient:
    return {a.q, a.d_z, a.lse, a.delta};
  }
  return {};
}

long step_writing(const KernelProgram &p, const std::string &name) {
  for (size_t k = 0; k < p.steps.size(); ++k)
    for (const std::string &o : step_outputs(p.steps[k]))
      if (o == name)
        return static_cast<long>(k);
  return -1;
}

void store_in_bf16(KernelProgram &p, std::set<std::string> names) {
  for (const Step &s : p.steps)
    if (const auto *g = std::get_if<GemmStep>(&s); g && g->out_add)
      names.erase(g->output);
  for (const std::string &n : names)
    if (TensorDecl *d = p.find(n); d && !d->dims.empty() && d->dtype == DType::f32)
      d->dtype = DType::bf16;
}

namespace {
// Moves the steps of [begin, end) with first[i - begin] ahead of the others,
// each group in its own order; returns where the others start.
size_t partition_steps(KernelProgram &p, size_t begin, size_t end, const std::vector<bool> &first) {
  std::vector<Step> ahead, behind;
  for (size_t i = begin; i < end; ++i)
    (first[i - begin] ? ahead : behind).push_back(std::move(p.steps[i]));
  const size_t split = begin + ahead.size();
  size_t at = begin;
  for (Step &s : ahead)
    p.steps[at++] = std::move(s);
  for (Step &s : behind)
    p.steps[at++] = std::move(s);
  return split;
}
} // namespace

size_t defer_steps_reading(KernelProgram &p, size_t begin, size_t end, const std::vector<std::string> &late) {
  internal_check(begin <= end && end <= p.steps.size()) << "step range out of bounds";
  std::set<std::string> tainted(late.begin(), late.end());
  std::vector<bool> early(end - begin, true);
  for (size_t i = begin; i < end; ++i) {
    const std::vector<std::string> reads = step_reads(p.steps[i]);
    if (std::none_of(reads.begin(), reads.end(), [&](const std::string &n) { return tainted.count(n); }))
      continue;
    early[i - begin] = false;
    for (const std::string &o : step_outputs(p.steps[i]))
      tainted.insert(o);
  }
  return partition_steps(p, begin, end, early);
}

size_t defer_steps_not_needed_for(KernelProgram &p, size_t begin, size_t end, const std::vector<std::string> &targets) {
  internal_check(begin <= end && end <= p.steps.size()) << "step range out of bounds";
  std::set<std::string> wanted(targets.begin(), targets.end());
  std::vector<bool> needed(end - begin, false);
  for (size_t i = end; i-- > begin;) {
    const std::vector<std::string> out = step_outputs(p.steps[i]);
    if (std::none_of(out.begin(), out.end(), [&](const std::string &n) { return wanted.count(n); }))
      continue;
    needed[i - begin] = true;
    for (const std::string &r : step_reads(p.steps[i]))
      wanted.insert(r);
  }
  return partition_steps(p, begin, end, needed);
}

std::ostream &operator<<(std::ostream &os, const KernelProgram &p) {
  os << "kernel program (schedule " << p.schedule_name << ")\n";
  for (const TensorDecl &t : p.tensors) {
    os << "  tensor " << t.name << "[";
    for (size_t i = 0; i < t.dims.size(); ++i)
      os << (i ? ", " : "") << t.dims[i].name();
    os << "] " << dtype_name(t.dtype);
    if (t.layout != RowLayout::dense)
      os << " rows=" << row_layout_name(t.layout) << "(" << t.route->name << ")";
    if (t.is_input)
      os << " input";
    if (t.outer_stride > 0)
      os << " " << t.dims[0].name() << "-stride " << t.outer_stride;
    os << "\n";
  }
  for (const Step &s : p.steps) {
    std::visit(
        [&](const auto &x) {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<T, RoutingStep>) {
            os << "  route " << x.route->name << ": top_k(" << (x.softmax ? "softmax(" + x.probs + ")" : x.probs)
               << ", k = " << x.route->k << ") -> counts, padded offsets (block " << x.block
               << "), sorted_pair, pair_pos, tiles";
            if (!x.gate_output.empty())
              os << "; gate -> " << x.gate_output << (x.renormalize ? " (renormalised)" : "");
            if (x.drops())
              os << "; capacity " << x.capacity_factor
                 << (x.priority == KeepPriority::score ? " (expert choice: best scores)" : " (drops past it)");
            os << "\n";
          } else if constexpr (std::is_same_v<T, GatherStep>) {
            os << "  gather " << x.name << ": " << x.dst << "[p, :] = " << x.src
               << (x.rows == RowMap::gather_token ? "[token(sorted_pair[p]), :]\n" : "[sorted_pair[p], :]\n");
          } else if constexpr (std::is_same_v<T, AttentionStep>) {
            const std::string over = x.route ? " over the padded rows of " + x.route->name : "";
            std::ostringstream scale;
            scale << x.scale;
            const std::string s = scale.str() + " * sum(j, " + x.q + "[r, j] * " + x.key + "[u, j])";
            if (x.part == AttentionStep::Part::forward)
              os << "  attention " << x.name << ": " << x.output << "[r, c] = sum(u, softmax(u, " << s << ") * "
                 << x.value << "[u, c])" << over << ", scores never stored"
                 << (x.lse.empty() ? "" : "; " + x.lse + "[r] = logsumexp(u, " + s + ")") << "\n";
            else if (x.part == AttentionStep::Part::query_gradient)
              os << "  attention " << x.name << ": " << x.delta << "[r] = sum(c, " << x.d_z << "[r, c] * " << x.z
                 << "[r, c]); " << x.output << "[r, j] = sum(u, ds(r, u) * " << x.key << "[u, j])" << over
                 << ", p = exp(" << s << " - " << x.lse << "[r]) and ds = p * (sum(c, " << x.d_z << "[r, c] * "
                 << x.value << "[u, c]) - " << x.delta << "[r]) * " << x.scale << " made again\n";
            else
              os << "  attention " << x.name << ": " << x.output << "[u, j] = sum(r, ds(r, u) * " << x.q << "[r, j]); "
                 << x.d_value << "[u, c] = sum(r, p(r, u) * " << x.d_z << "[r, c])" << over
                 << ", p and ds made again from " << x.lse << " and " << x.delta << "\n";
          } else if constexpr (std::is_same_v<T, TransposeStep>) {
            os << "  transpose " << x.name << ": " << x.dst << " = " << x.src << "^T";
            if (x.route)
              os << " over the padded rows of " << x.route->name << " (rows " << row_map_name(x.rows) << ")";
            os << "\n";
          } else if constexpr (std::is_same_v<T, GemmStep>) {
            const GemmTiling &g = x.tiling;
            os << "  gemm " << x.name << ": grid " << (x.route ? "tiles(" + x.route->name + ")" : "rows")
               << " x cols; tile " << g.tile_m << "x" << g.tile_n << "x" << g.tile_k << ", " << g.stages
               << " stages, warps " << g.warps_m << "x" << g.warps_n << "\n";
            if (x.expert_k)
              os << "    expert reduction over the routed rows of " << x.route->name
                 << (x.operands_in_place ? ", operands read in place" : "") << "\n";
            os << "    A = " << x.a << (x.a_trans ? "^T" : "") << " rows " << row_map_name(x.a_rows) << "; B =";
            for (const std::string &b : x.b)
              os << " " << b << (x.b_trans ? "^T" : "") << (x.b_per_expert ? "[expert]" : "");
            if (x.expert_k)
              os << " rows " << row_map_name(x.b_rows);
            os << "; K = " << x.k.name() << ", N = " << x.n.name() << "\n";
            if (x.chained)
              os << "    + A2 = " << x.chained->a << " rows " << row_map_name(x.a_rows) << "; B2 = " << x.chained->b
                 << (x.b_trans ? "^T" : "") << (x.b_per_expert ? "[expert]" : "") << "; K2 = " << x.chained->k.name()
                 << "  (one accumulator)\n";
            os << "    " << x.output << "(" << x.row_var.name() << ", " << x.col_var.name() << ") = " << x.epilogue
               << "  -> rows " << row_map_name(x.out_rows)
               << (x.out_add ? x.out_add_onto_written ? ", added atomically onto the output's values"
                                                      : ", added atomically into the zeroed output"
                             : "")
               << "\n";
            for (const GemmStep::Extra &e : x.extra)
              os << "    and " << e.output << "(" << x.row_var.name() << ", " << x.col_var.name() << ") = " << e.value
                 << "\n";
            // The CUDA target's plan (plan_gemms), its lines after the
            // header, or why that target cannot run the step.
            if (x.plan) {
              const std::string d = describe(*x.plan, x, /*notes=*/false);
              std::istringstream lines(d.substr(d.find('\n') + 1));
              for (std::string line; std::getline(lines, line);)
                os << "    cuda plan:" << line.substr(1) << "\n";
            } else if (!x.plan_refusal.empty()) {
              os << "    cuda plan: refused: " << x.plan_refusal << "\n";
            }
          } else {
            auto defines = [&](const std::string &out, const Expr &value, bool row_sum) {
              const size_t n = x.vars.size() - (row_sum ? 1 : 0);
              os << out << "(";
              for (size_t i = 0; i < n; ++i)
                os << (i ? ", " : "") << x.vars[i].name();
              os << ") = ";
              if (row_sum)
                os << "sum(" << x.vars.back().name() << ", " << value << ")\n";
              else
                os << value << "\n";
            };
            os << "  pointwise " << x.name << ": ";
            defines(x.output, x.body, false);
            for (const ExtraOutput &e : x.extra) {
              os << "    and ";
              defines(e.output, e.value, e.row_sum);
            }
            for (const auto &[out, in] : x.in_place)
              if (is_output(p, out)) // the caller's tensor: the input lives in its memory
                os << "    (" << in << " in " << out << "'s memory)\n";
              else
                os << "    (" << out << " in place of " << in << ")\n";
          }
        },
        s);
  }
  return os;
}

bool uses_var(const Expr &e, const Var &v, const std::vector<FuncPtr> &registers) {
  struct Finder : IRVisitor {
    const VarNode *v = nullptr;
    const std::vector<FuncPtr> *registers = nullptr;
    bool found = false;
    void visit_node(const Access &a) override {
      for (const FuncPtr &r : *registers)
        if (a.func == r)
          return;
      for (const Index &i : a.args)
        found |= i.var.get() == v;
    }
    void visit_node(const IndexEq &n) override { found |= n.a.var.get() == v || n.b.var.get() == v; }
    void visit_node(const RouteSum &n) override {
      found |= n.target.get() == v;
      IRVisitor::visit_node(n);
    }
  } f;
  f.v = v.get();
  f.registers = &registers;
  f.visit(e);
  return f.found;
}

bool stores_plain_accumulator(const GemmStep &g) {
  auto plain = [](const Index &i, const Var &v) { return i.is_plain() && i.var.same_as(v); };
  const Access *a = g.epilogue.as<Access>();
  return g.accumulators.size() == 1 && a && a->func == g.accumulators[0] && a->args.size() == 2 &&
         plain(a->args[0], g.row_var) && plain(a->args[1], g.col_var);
}

bool dropped_rows_unread(const KernelProgram &p, const std::string &tensor, const RoutingNode *r) {
  const TensorDecl &t = p.tensor(tensor);
  if (t.layout == RowLayout::padded && t.route == r)
    return true;
  if (std::find(p.outputs.begin(), p.outputs.end(), tensor) != p.outputs.end())
    return false;
  // A read of `tensor` outside every sum over r's pairs.
  struct Outside : IRVisitor {
    const std::string &name;
    const RoutingNode *r;
    int depth = 0;
    bool found = false;
    Outside(const std::string &n, const RoutingNode *route) : name(n), r(route) {}
    void visit_node(const RouteSum &s) override {
      depth += s.route.get() == r;
      IRVisitor::visit_node(s);
      depth -= s.route.get() == r;
    }
    void visit_node(const Access &a) override {
      found = found || (depth == 0 && a.target_name() == name);
      IRVisitor::visit_node(a);
    }
  };
  for (const Step &s : p.steps) {
    const std::vector<std::string> reads = step_reads(s);
    if (std::find(reads.begin(), reads.end(), tensor) == reads.end())
      continue;
    if (const auto *g = std::get_if<GemmStep>(&s)) {
      if (g->route != r)
        return false;
    } else if (const auto *pw = std::get_if<PointwiseStep>(&s)) {
      Outside v(tensor, r);
      v.visit(pw->body);
      for (const ExtraOutput &e : pw->extra)
        v.visit(e.value);
      if (v.found)
        return false;
    } else if (const auto *ga = std::get_if<GatherStep>(&s)) {
      if (ga->route != r)
        return false;
    } else if (const auto *tr = std::get_if<TransposeStep>(&s)) {
      if (tr->route != r)
        return false;
    } else if (const auto *at = std::get_if<AttentionStep>(&s)) {
      if (at->route != r)
        return false;
    } else {
      return false;
    }
  }
  return true;
}

} // namespace moeforge
