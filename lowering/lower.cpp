#include "lowering/lower.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <set>

#include "dsl/check.h"
#include "dsl/error.h"
#include "dsl/ops.h"
#include "dsl/printer.h"
#include "dsl/visitor.h"
#include "lowering/decompose.h"
#include "lowering/dynamic_rows.h"
#include "lowering/fuse_attention.h"
#include "lowering/gemm_plan.h"
#include "lowering/pointwise_plan.h"

namespace moeforge {

namespace {

// The route whose pair variable is `v`, if any.
const RoutingNode *route_of_pair(const Pipeline &p, const Var &v) {
  for (const RoutingPtr &r : p.routes())
    if (r->pair.same_as(v))
      return r.get();
  return nullptr;
}

// f's tiling: its own where the schedule names it, else that of the Func
// it follows (FuncNode::schedule_of), else the default.
// The Func whose settings a GEMM of f takes: f's own, or for a part split
// from a Func (d_x_s of d_x) that Func's, unless the schedule names the part.
std::string scheduled_as(const FuncNode &f, const Schedule &schedule) {
  const auto &named = schedule.funcs();
  if (f.schedule_of.empty() || std::find(named.begin(), named.end(), f.name) != named.end())
    return f.name;
  return f.schedule_of;
}

GemmTiling tiling_of(const FuncNode &f, const Schedule &schedule) {
  return schedule.for_func(scheduled_as(f, schedule)).tiling;
}

// One contraction sum(k, A(row, k) * B([expert(r),] k, col)) of a GEMM.
struct Contraction {
  const Access *a = nullptr, *b = nullptr;
  Var k;
  bool a_trans = false, b_trans = false; // read as A(k, row) / B([e,] col, k)
};

[[noreturn]] void not_a_gemm(const FuncNode &f, const Expr &sum, const std::string &why) {
  user_error << "definition '" << f.name
             << "': the compiled backends (CPU and CUDA) run a contraction as sum(k, A(rows, k) * "
             << "B(k, cols)) or B(expert(r), k, cols) with A and B bf16 tensors, but " << to_string(sum) << " " << why;
}

// Whether a read is stored in bf16: declared so, or an intermediate that
// decomposition stores in bf16 because a GEMM reads it.
bool stored_bf16(const Access *a, const std::vector<std::string> &bf16_operands) {
  return a->dtype == DType::bf16 ||
         (a->func && std::find(bf16_operands.begin(), bf16_operands.end(), a->func->name) != bf16_operands.end());
}

Contraction match_contraction(const FuncNode &f, const Sum &s, const Expr &sum_expr, const Var &row, const Var &col,
                              const RoutingNode *route, const std::vector<std::string> &bf16) {
  auto *mul = s.body.as<Binary>();
  if (!mul || mul->op != BinaryOp::mul || !mul->a.as<Access>() || !mul->b.as<Access>())
    not_a_gemm(f, sum_expr, "is not a product of two tensor reads");
  const Access *x = mul->a.as<Access>(), *w = mul->b.as<Access>();
  auto is = [](const Index &i, const Var &v) { return i.is_plain() && i.var.same_as(v); };
  // A(row, k), A(token(r), k), or a dense A(k, row) (transposed).
  auto a_form = [&](const Access *a) -> int {
    if (a->args.size() != 2)
      return 0;
    const Index &ri = a->args[0];
    if (is(a->args[1], s.var) &&
        (is(ri, row) || (route && ri.field == RouteField::token && ri.route.get() == route && ri.var.same_as(row))))
      return 1;
    return !route && is(a->args[0], s.var) && is(a->args[1], row) ? 2 : 0;
  };
  // B(k, col) or B(col, k) (transposed), optionally after expert(r).
  auto b_form = [&](const Access *b) -> int {
    size_t n = b->args.size();
    if (n != 2 && n != 3)
      return 0;
    if (n == 3 && !(route && b->args[0].field == RouteField::expert && b->args[0].route.get() == route))
      return 0;
    if (is(b->args[n - 2], s.var) && is(b->args[n - 1], col))
      return 1;
    return is(b->args[n - 2], col) && is(b->args[n - 1], s.var) ? 2 : 0;
  };
  if (!(a_form(x) && b_form(w)))
    std::swap(x, w);
  if (!(a_form(x) && b_form(w)))
    not_a_gemm(f, sum_expr,
               "does not read A by (" + row.name() + ", " + s.var.name() + ") and B by (" + s.var.name() + ", " +
                   col.name() + ")");
  if (!stored_bf16(x, bf16) || !stored_bf16(w, bf16))
    not_a_gemm(f, sum_expr,
               "reads '" + x->target_name() + "' as " + dtype_name(x->dtype) + " and '" + w->target_name() + "' as " +
                   dtype_name(w->dtype) + "; declare both bf16 (e.g. Func(\"name\", DType::bf16))");
  return Contraction{x, w, s.var, a_form(x) == 2, b_form(w) == 2};
}

// Replaces each Sum by a read of its accumulator.
struct ReplaceSums : IRMutator {
  std::vector<const Sum *> sums;
  std::vector<FuncPtr> accs;
  Var row, col;
  Expr mutate_node(const Sum &n, const Expr &) override {
    for (size_t i = 0; i < sums.size(); ++i)
      if (sums[i] == &n)
        return Access::make(accs[i], {row, col});
    internal_check(false) << "unmatched sum";
  }
};

std::optional<GemmStep> match_gemm(const Pipeline &p, const FuncNode &f, const Schedule &schedule,
                                   const std::vector<std::string> &bf16) {
  std::vector<const Sum *> sums;
  std::vector<Expr> sum_exprs;
  // Collect the outermost sums (nested ones are rejected by the matcher).
  struct Outer : IRMutator {
    std::vector<const Sum *> *sums;
    std::vector<Expr> *exprs;
    Expr mutate_node(const Sum &n, const Expr &self) override {
      sums->push_back(&n);
      exprs->push_back(self);
      return self;
    }
  } outer;
  outer.sums = &sums;
  outer.exprs = &sum_exprs;
  outer.mutate(f.body);
  if (sums.empty())
    return std::nullopt;
  // Sums with at most one free index are reductions (a dot product per row,
  // softmax's normaliser): loops of an element-wise kernel, not GEMMs.
  if (std::all_of(sum_exprs.begin(), sum_exprs.end(), [](const Expr &e) { return free_vars(e).size() <= 1; }))
    return std::nullopt;
  user_check(f.args.size() == 2) << "definition '" << f.name << "' has " << f.args.size()
                                 << " indices: the compiled backends (CPU and CUDA) run a contraction as a 2-D GEMM "
                                 << "f(rows, cols); reshape it into (rows, cols)";
  user_check(!contains_kind(f.body, ExprKind::Softmax) && !contains_kind(f.body, ExprKind::RouteSum))
      << "definition '" << f.name << "' mixes a contraction with softmax or combine; split it into two Funcs";
  const Var &row = f.args[0], &col = f.args[1];
  const RoutingNode *route = route_of_pair(p, row);

  GemmStep g;
  g.name = "gemm_" + f.name;
  g.output = f.name;
  g.route = route;
  g.m = row.dim();
  g.n = col.dim();
  g.row_var = row;
  g.col_var = col;
  g.tiling = tiling_of(f, schedule);
  g.func = scheduled_as(f, schedule);
  g.fp8 = schedule.for_func(g.func).fp8;
  g.block = schedule.block();
  ReplaceSums rs;
  rs.row = row;
  rs.col = col;
  for (size_t i = 0; i < sums.size(); ++i) {
    Contraction c = match_contraction(f, *sums[i], sum_exprs[i], row, col, route, bf16);
    if (i == 0) {
      g.a = c.a->target_name();
      g.k = c.k.dim();
      g.a_rows = route ? (c.a->args[0].is_plain() ? RowMap::gather_pair : RowMap::gather_token) : RowMap::direct;
      g.b_per_expert = c.b->args.size() == 3;
      g.a_trans = c.a_trans;
      g.b_trans = c.b_trans;
    } else {
      user_check(c.a->target_name() == g.a && c.k.dim().same_as(g.k) && (c.b->args.size() == 3) == g.b_per_expert &&
                 c.a_trans == g.a_trans && c.b_trans == g.b_trans)
          << "definition '" << f.name << "': its sums must share the A operand '" << g.a << "' and the reduced "
          << "Dim " << g.k.name() << " to run as one GEMM (as SwiGLU's gate and up projections do); "
          << to_string(sum_exprs[i]) << " differs: split it into its own Func";
    }
    g.b.push_back(c.b->target_name());
    rs.sums.push_back(sums[i]);
    rs.accs.push_back(placeholder("acc" + std::to_string(i), {row, col}, DType::f32));
  }
  g.epilogue = rs.mutate(f.body);
  g.accumulators = rs.accs;
  user_check(!contains_kind(g.epilogue, ExprKind::Sum))
      << "definition '" << f.name << "': a sum inside a sum's operands is not a GEMM; define the inner sum as its "
      << "own Func";
  return g;
}

// f(e, i, j) = expert_sum(route, e, A(r, i) * B(r, j)) with plain reads
// (decompose made them so): an expert reduction GEMM.
std::optional<GemmStep> match_expert_gemm(const FuncNode &f, const Schedule &schedule,
                                          const std::vector<std::string> &bf16) {
  auto *rs = f.body.as<RouteSum>();
  if (!rs || rs->field != RouteField::expert || f.args.size() == 2)
    return std::nullopt; // over (expert, j): an element-wise loop over each expert's rows (decompose.h)
  auto *mul = rs->body.as<Binary>();
  const Access *a = mul && mul->op == BinaryOp::mul ? mul->a.as<Access>() : nullptr;
  const Access *b = mul && mul->op == BinaryOp::mul ? mul->b.as<Access>() : nullptr;
  const Var &r = rs->route->pair;
  auto rows = [&](const Access *x) {
    return x->args[0].field == RouteField::token ? RowMap::gather_token : RowMap::gather_pair;
  };
  auto ok = [&](const Access *x, const Var &col) {
    return x && x->args.size() == 2 && x->args[0].var.same_as(r) && x->args[0].field != RouteField::expert &&
           x->args[1].is_plain() && x->args[1].var.same_as(col) && stored_bf16(x, bf16);
  };
  user_check(f.args.size() == 3 && ok(a, f.args[1]) && ok(b, f.args[2]))
      << "definition '" << f.name << "': an expert_sum compiles as a per-expert GEMM " << f.name
      << "(e, i, j) = expert_sum(route, e, A(r, i) * B(r, j)) with A and B bf16 reads by the pair r or token(r); "
      << to_string(f.body) << " is not of that form";
  GemmStep g;
  g.name = "gemm_" + f.name;
  g.output = f.name;
  g.route = rs->route.get();
  g.expert_k = true;
  g.m = f.args[1].dim();
  g.n = f.args[2].dim();
  g.k = rs->route->pairs;
  g.a = a->target_name();
  g.a_rows = rows(a);
  g.b = {b->target_name()};
  g.b_rows = rows(b);
  g.row_var = f.args[1];
  g.col_var = f.args[2];
  g.accumulators = {placeholder("acc0", {g.row_var, g.col_var}, DType::f32)};
  g.epilogue = Access::make(g.accumulators[0], {g.row_var, g.col_var});
  g.tiling = tiling_of(f, schedule);
  g.func = scheduled_as(f, schedule);
  g.fp8 = schedule.for_func(g.func).fp8;
  g.block = schedule.block();
  return g;
}

PointwiseStep make_pointwise(const FuncNode &f) {
  if (auto *s = f.body.as<Softmax>())
    user_check(!contains_kind(s->body, ExprKind::Softmax))
        << "definition '" << f.name << "': nested softmax is not supported; split it into two Funcs";
  else
    user_check(!contains_kind(f.body, ExprKind::Softmax))
        << "definition '" << f.name
        << "': the compiled backends (CPU and CUDA) take softmax only as a whole definition, " << f.name
        << "(...) = softmax(v, ...); move it into its own Func";
  return PointwiseStep{"pointwise_" + f.name, f.name, f.args, f.body, {}, {}};
}

bool debug_lowering() {
  const char *d = std::getenv("MOEFORGE_DEBUG");
  return d && (std::string(d).find("lower") != std::string::npos || std::string(d) == "all");
}

} // namespace

KernelProgram build_steps(const Pipeline &p, const Schedule &schedule) {
  schedule.validate(p);
  KernelProgram prog;
  prog.schedule_name = schedule.name();
  prog.reuse_memory = schedule.reuse_memory();
  Decomposer decomposer(p, /*share_forward_sums=*/true);
  for (const BufferPtr &b : p.buffers()) {
    prog.tensors.push_back(TensorDecl{b->name, b->dtype, b->dims, RowLayout::dense, nullptr, true});
    prog.tensors.back().outer_stride = b->outer_stride;
  }
  for (const Pipeline::Step &step : p.steps()) {
    if (step.route) {
      const RoutingNode &r = *step.route;
      user_check(r.probs->dtype == DType::f32)
          << "route '" << r.name << "': top_k reads '" << r.probs->name << "' as " << dtype_name(r.probs->dtype)
          << "; the device routing needs f32 probabilities: declare Func(\"" << r.probs->name << "\", DType::f32)";
      user_check(r.token_var.same_as(r.probs->args[0]))
          << "route '" << r.name << "': the device routing reads '" << r.probs->name << "' as (token, expert); "
          << "define it with the token index first";
      RoutingStep rs{&r, r.probs->name, schedule.block(), /*softmax=*/false, /*gate_output=*/""};
      if (r.expert_choice()) {
        rs.capacity_factor = r.capacity_factor;
        rs.priority = KeepPriority::score;
      } else {
        rs.capacity_factor = schedule.capacity();
      }
      prog.steps.push_back(rs);
      prog.routes.push_back(&r);
      continue;
    }
    for (const FuncPtr &part : decomposer.decompose(step.func)) {
      const FuncNode &f = *part;
      TensorDecl t{f.name, f.dtype, {}, RowLayout::dense, nullptr, false};
      for (const Var &v : f.args)
        t.dims.push_back(v.dim());
      if (!f.args.empty())
        if (const RoutingNode *r = route_of_pair(p, f.args[0])) {
          t.route = r;
          t.layout = RowLayout::pair;
        }
      prog.tensors.push_back(std::move(t));
      if (auto g = match_expert_gemm(f, schedule, decomposer.bf16_operands()))
        prog.steps.push_back(std::move(*g));
      else if (auto g = match_gemm(p, f, schedule, decomposer.bf16_operands()))
        prog.steps.push_back(std::move(*g));
      else
        prog.steps.push_back(make_pointwise(f));
    }
  }
  // Intermediates a GEMM reads as an operand are stored in bf16.
  for (const std::string &name : decomposer.bf16_operands())
    prog.find(name)->dtype = DType::bf16;
  for (const Func &f : p.outputs())
    prog.outputs.push_back(f.name());
  return prog;
}

KernelProgram fuse_gate_into_epilogue(KernelProgram p, const Schedule &schedule) {
  if (schedule.gate() != GateFusion::epilogue)
    return p;
  for (Step &s : p.steps) {
    auto *pw = std::get_if<PointwiseStep>(&s);
    const RouteSum *rs = pw ? pw->body.as<RouteSum>() : nullptr;
    if (!rs || rs->field != RouteField::token)
      continue;
    auto *mul = rs->body.as<Binary>();
    if (!mul || mul->op != BinaryOp::mul)
      continue;
    const Var &r = rs->route->pair;
    for (int side = 0; side < 2; ++side) {
      const Expr &gate = side ? mul->b : mul->a, &val = side ? mul->a : mul->b;
      auto *acc = val.as<Access>();
      if (!acc || !acc->func || acc->args.size() != 2 || !acc->args[0].is_plain() || !acc->args[0].var.same_as(r))
        continue;
      auto fv = free_vars(gate);
      if (fv.size() != 1 || !fv[0].same_as(r))
        continue;
      // The producer must be a GEMM over the same route with no other reader.
      GemmStep *producer = nullptr;
      int readers = 0;
      for (Step &t : p.steps) {
        if (auto *g = std::get_if<GemmStep>(&t); g && g->output == acc->func->name && g->route == rs->route.get())
          producer = g;
        for (const std::string &n : step_reads(t))
          readers += n == acc->func->name;
      }
      if (!producer || readers != 1 || !producer->row_var.same_as(r))
        continue;
      // The GEMM now stores gate(r) * o(r, i): a different tensor, so it gets
      // its own name and o itself is no longer materialised.
      std::string gated = acc->func->name + "_gated";
      TensorDecl t = p.tensor(acc->func->name);
      p.tensors.erase(std::find_if(p.tensors.begin(), p.tensors.end(),
                                   [&](const TensorDecl &x) { return x.name == acc->func->name; }));
      t.name = gated;
      p.tensors.push_back(t);
      producer->output = gated;
      producer->epilogue = gate * producer->epilogue;
      Expr read = Access::make(placeholder(gated, acc->func->args, acc->func->dtype), acc->args);
      pw->body = RouteSum::make(rs->route, rs->field, rs->target, read);
      break;
    }
  }
  return p;
}

KernelProgram split_unfused_epilogues(KernelProgram p, const Schedule &schedule) {
  std::vector<Step> out;
  for (Step &s : p.steps) {
    auto *g = std::get_if<GemmStep>(&s);
    bool trivial = g && g->accumulators.size() == 1 && g->epilogue.as<Access>() &&
                   g->epilogue.as<Access>()->func == g->accumulators[0];
    if (!g || trivial || schedule.for_func(g->output).fuse_epilogue) {
      out.push_back(std::move(s));
      continue;
    }
    // One GEMM per accumulator into an f32 tensor, then the epilogue as its
    // own element-wise kernel.
    const TensorDecl &dst = p.tensor(g->output);
    struct Rename : IRMutator {
      std::vector<FuncPtr> from, to;
      Expr mutate_node(const Access &a, const Expr &self) override {
        for (size_t i = 0; i < from.size(); ++i)
          if (a.func == from[i])
            return Access::make(to[i], a.args);
        return self;
      }
    } rename;
    for (size_t i = 0; i < g->accumulators.size(); ++i) {
      std::string name = g->output + "_acc" + std::to_string(i);
      TensorDecl t = dst;
      t.name = name;
      t.dtype = DType::f32;
      t.outer_stride = 0; // a tensor of its own, dense
      p.tensors.push_back(t);
      GemmStep part = *g;
      part.name = "gemm_" + name;
      part.output = name;
      part.b = {g->b[i]};
      part.accumulators = {g->accumulators[i]};
      part.epilogue = Access::make(g->accumulators[i], {g->row_var, g->col_var});
      part.unfused = true;
      out.push_back(part);
      rename.from.push_back(g->accumulators[i]);
      rename.to.push_back(placeholder(name, {g->row_var, g->col_var}, DType::f32));
    }
    out.push_back(PointwiseStep{
        "epilogue_" + g->output, g->output, {g->row_var, g->col_var}, rename.mutate(g->epilogue), {}, {}});
  }
  p.steps = std::move(out);
  return p;
}

KernelProgram insert_permutation(KernelProgram p, const Schedule &schedule) {
  if (schedule.permutation() != Permutation::blocked)
    return p;
  std::vector<Step> out;
  for (Step &s : p.steps) {
    auto *g = std::get_if<GemmStep>(&s);
    if (g && g->route && !g->expert_k && g->a_rows == RowMap::gather_token) {
      // MegaBlocks: copy the routed rows into the padded, expert-sorted order once.
      std::string padded = g->a + "_padded_" + g->route->name;
      if (!p.find(padded)) {
        const TensorDecl &src = p.tensor(g->a);
        TensorDecl t{padded, src.dtype, {g->route->pairs, src.dims[1]}, RowLayout::padded, g->route, false};
        p.tensors.push_back(t);
        out.push_back(GatherStep{"gather_" + padded, g->route, g->a, padded});
      }
      g->a = padded;
      g->a_rows = RowMap::direct;
    }
    out.push_back(std::move(s));
  }
  p.steps = std::move(out);
  return p;
}

namespace {
// Whether a GEMM (an expert reduction included) reads `name` as an operand.
bool read_by_gemm(const KernelProgram &p, const std::string &name) {
  for (const Step &s : p.steps)
    if (auto *g = std::get_if<GemmStep>(&s);
        g && (g->a == name || std::find(g->b.begin(), g->b.end(), name) != g->b.end()))
      return true;
  return false;
}

// Whether a dense GEMM reduces over the route's pairs reading `name` (the
// attention of Mixture-of-Attention's backward: dK = dS^T Q sums over every
// pair's query): its K walks the pairs in pair order, so the operand must be
// stored that way.
bool reduced_over_pairs(const KernelProgram &p, const TensorDecl &t) {
  for (const Step &s : p.steps)
    if (auto *g = std::get_if<GemmStep>(&s);
        g && !g->route && g->k.same_as(t.route->pairs) &&
        (g->a == t.name || std::find(g->b.begin(), g->b.end(), t.name) != g->b.end()))
      return true;
  return false;
}
} // namespace

KernelProgram assign_row_layouts(KernelProgram p, const Schedule &schedule) {
  for (TensorDecl &t : p.tensors) {
    if (!t.route || t.layout == RowLayout::padded || reduced_over_pairs(p, t))
      continue;
    const GemmStep *producer = nullptr;
    bool only_gemm_a = true;
    for (const Step &s : p.steps) {
      if (auto *g = std::get_if<GemmStep>(&s); g && g->output == t.name)
        producer = g;
      auto names = step_reads(s);
      int n = static_cast<int>(std::count(names.begin(), names.end(), t.name));
      auto *g = std::get_if<GemmStep>(&s);
      if (n > (g && g->a == t.name ? 1 : 0))
        only_gemm_a = false;
    }
    // GEMM outputs stay in the padded tile order (no scatter) when blocked, or
    // when only other GEMMs read them; results for element-wise readers
    // (combine) are scattered back to pair order by the scattered schedule,
    // unless padded_elementwise keeps every per-pair tensor in the padded
    // order: the element-wise kernels then find a pair's row through
    // pair_pos, and the GEMM stores whole tiles (by TMA, with tma_store).
    // A route that drops pairs at capacity keeps its routed tensors in the
    // padded order too, whose rows are bounded by the pairs it can keep
    // (expert choice offers T x E pairs and keeps cf x T of them).
    const bool padded_pairs = schedule.padded_elementwise() || p.routing(t.route).drops();
    if (producer && producer->route && (schedule.permutation() == Permutation::blocked || only_gemm_a || padded_pairs))
      t.layout = RowLayout::padded;
    // padded_elementwise: an element-wise [pairs, n] result that a GEMM
    // reads, in the padded order too, its padding zeroed by its kernel,
    // where a kernel can make it so (padded_order_serves: not a reduction
    // over the tokens, such as Mixture-of-Attention's query gradient; that
    // stays in pair order, and the GEMM reading it gathers its rows, so
    // padded_elementwise, the default's, does not make a training program
    // the CUDA target refuses).
    if (padded_pairs && !producer && t.dims.size() == 2 && read_by_gemm(p, t.name))
      for (const Step &s : p.steps)
        if (auto *pw = std::get_if<PointwiseStep>(&s); pw && pw->output == t.name && pw->vars.size() == 2 &&
                                                       pw->vars[0].same_as(t.route->pair) && padded_order_serves(*pw)) {
          t.layout = RowLayout::padded;
          t.zero_padding = true;
        }
  }
  return p;
}

KernelProgram resolve_row_maps(KernelProgram p, const Schedule &) {
  for (Step &s : p.steps) {
    auto *g = std::get_if<GemmStep>(&s);
    if (!g || !g->route || g->expert_k)
      continue; // expert reductions: materialize_transposes places their operands
    const TensorDecl &a = p.tensor(g->a);
    if (g->a_rows != RowMap::gather_token)
      g->a_rows = a.layout == RowLayout::padded ? RowMap::direct : RowMap::gather_pair;
    g->out_rows = p.tensor(g->output).layout == RowLayout::padded ? RowMap::direct : RowMap::gather_pair;
  }
  return p;
}

KernelProgram materialize_transposes(KernelProgram p, const Schedule &schedule) {
  std::vector<Step> out;
  std::set<std::string> made;
  auto add = [&](TensorDecl t, Step step) {
    if (!made.insert(t.name).second)
      return;
    p.tensors.push_back(std::move(t));
    out.push_back(std::move(step));
  };
  // The layout a routed operand's row map starts from.
  auto rows_of = [&](const std::string &name, RowMap asked) {
    const TensorDecl &t = p.tensor(name);
    if (asked == RowMap::gather_token)
      return RowMap::gather_token;
    return t.layout == RowLayout::padded ? RowMap::direct : RowMap::gather_pair;
  };
  for (Step &s : p.steps) {
    auto *g = std::get_if<GemmStep>(&s);
    if (!g) {
      out.push_back(std::move(s));
      continue;
    }
    if (g->expert_k && g->tiling.mma != MmaKind::mma_sync) {
      // wgmma reads A M-major (trans-a) and B by rows from where they are.
      g->a_rows = rows_of(g->a, g->a_rows);
      g->b_rows = rows_of(g->b[0], g->b_rows);
      g->operands_in_place = true;
      // padded_elementwise: the token rows an expert reduction gathers (x
      // for dW1 = x^T dH1) are gathered once into the padded order (zero
      // padding), which the reductions then read by TMA like their other
      // operand; SwiGLU's dW1 and dW3 share the copy. Not under
      // gather_in_gemms: the reductions then gather them in place.
      if (schedule.padded_elementwise() && !schedule.gather_in_gemms() && g->a_rows == RowMap::gather_token) {
        const RoutingNode *r = g->route;
        const TensorDecl a = p.tensor(g->a);
        TensorDecl ap{g->a + "_rows_" + r->name, DType::bf16, {r->pairs, a.dims[1]}, RowLayout::padded, r, false};
        ap.zero_padding = true;
        add(ap, GatherStep{"gather_" + ap.name, r, g->a, ap.name, RowMap::gather_token});
        g->a = ap.name;
        g->a_rows = RowMap::direct;
      }
    } else if (g->expert_k) {
      // mma.sync: A^T with the padded rows last (zero on padding), B in padded order
      // (zero on padding: a padded GEMM output's padding rows are never written).
      const RoutingNode *r = g->route;
      const TensorDecl a = p.tensor(g->a), b = p.tensor(g->b[0]); // copies: add() grows p.tensors
      TensorDecl at{g->a + "_T_" + r->name, DType::bf16, {a.dims[1], r->pairs}, RowLayout::padded_t, r, false};
      add(at, TransposeStep{"transpose_" + at.name, g->a, at.name, r, rows_of(g->a, g->a_rows)});
      TensorDecl bp{g->b[0] + "_rows_" + r->name, DType::bf16, {r->pairs, b.dims[1]}, RowLayout::padded, r, false};
      add(bp, GatherStep{"gather_" + bp.name, r, g->b[0], bp.name, rows_of(g->b[0], g->b_rows)});
      g->a = at.name;
      g->b = {bp.name};
      g->a_rows = g->b_rows = RowMap::direct;
    }
    if (g->a_trans) {
      const TensorDecl &a = p.tensor(g->a);
      TensorDecl at{g->a + "_T", a.dtype, {a.dims[1], a.dims[0]}, RowLayout::dense, nullptr, false};
      add(at, TransposeStep{"transpose_" + at.name, g->a, at.name});
      g->a = at.name;
      g->a_trans = false;
    }
    // The Hopper main loops read a transposed B in place (K-major tiles);
    // mma.sync's loop reads [K, N] only, so B^T is written first for it.
    if (g->b_trans && g->tiling.mma == MmaKind::mma_sync) {
      for (std::string &name : g->b) {
        const TensorDecl &b = p.tensor(name);
        TensorDecl bt = b;
        bt.name = name + "_T";
        bt.is_input = false;
        bt.outer_stride = 0; // a copy of its own, dense
        std::swap(bt.dims[bt.dims.size() - 1], bt.dims[bt.dims.size() - 2]);
        add(bt, TransposeStep{"transpose_" + bt.name, name, bt.name});
        name = bt.name;
      }
      g->b_trans = false;
    }
    out.push_back(std::move(s));
  }
  p.steps = std::move(out);
  return p;
}

namespace {

void dump(const char *pass, const KernelProgram &p, const PassObserver &observe) {
  if (observe)
    observe(pass, p);
  if (debug_lowering())
    std::cerr << "=== after " << pass << " ===\n" << p;
}

} // namespace

namespace {

// A route that drops pairs at capacity excludes them from its sums over a
// token's or an expert's pairs, and its padded tensors hold nothing for a
// dropped pair (its row is the drop row). A dense GEMM over every pair
// (MoA's dK = dS^T Q), or a plain sum over the pairs that reads such a
// tensor, would read those rows: refuse it rather than sum garbage. (A
// plain sum of index functions or pair-order values, the load-balancing
// loss's fraction of pairs an expert was chosen for, counts every pair as
// the reference does.)
void check_dropping(const KernelProgram &p) {
  auto fix = [&](const RoutingNode *r) {
    return r->expert_choice() ? std::string("expert-choice routing does not run this layer on the compiled backends")
                              : std::string("drop capacity() from the schedule for this layer");
  };
  // Reads of r's padded tensors inside a sum over r's pairs.
  struct PaddedInPairSum : IRVisitor {
    const KernelProgram &p;
    const RoutingNode *r;
    int depth = 0;
    std::string found;
    PaddedInPairSum(const KernelProgram &prog, const RoutingNode *route) : p(prog), r(route) {}
    void visit_node(const Sum &n) override {
      const bool over_pairs = n.var.dim().same_as(r->pairs);
      depth += over_pairs;
      IRVisitor::visit_node(n);
      depth -= over_pairs;
    }
    void visit_node(const Access &n) override {
      const TensorDecl *t = p.find(n.target_name());
      if (depth > 0 && t && t->layout == RowLayout::padded && t->route == r && found.empty())
        found = n.target_name();
      IRVisitor::visit_node(n);
    }
  };
  for (const RoutingNode *r : p.routes) {
    if (!p.routing(r).drops())
      continue;
    for (const Step &step : p.steps) {
      if (const auto *g = std::get_if<GemmStep>(&step); g && !g->route) {
        user_check(!g->k.same_as(r->pairs))
            << "'" << g->func << "' sums over every pair of route '" << r->name
            << "', which drops pairs at its expert capacity: the compiled backends sum over a dropping route's "
            << "pairs only in combine() and expert_sum(); " << fix(r);
      }
      if (const auto *pw = std::get_if<PointwiseStep>(&step)) {
        PaddedInPairSum v(p, r);
        v.visit(pw->body);
        for (const ExtraOutput &e : pw->extra)
          v.visit(e.value);
        user_check(v.found.empty()) << "'" << pw->output << "' sums '" << v.found << "' over every pair of route '"
                                    << r->name << "', which drops pairs at its expert capacity and holds no row of '"
                                    << v.found << "' for a dropped pair: sum over the pairs with combine() or "
                                    << "expert_sum(), or " << fix(r);
      }
    }
  }
}

} // namespace

KernelProgram lower_before_fusion(const Pipeline &pipeline, const Schedule &schedule, const PassObserver &observe) {
  user_check(schedule.expert_parallel_ranks() == 1)
      << "schedule '" << schedule.name() << "': expert_parallel(" << schedule.expert_parallel_ranks()
      << ") spreads the experts over GPUs, which one layer cannot do: compile it with "
      << "cuda::compile_expert_parallel in C++ (the CLI: moeforge train --ranks " << schedule.expert_parallel_ranks()
      << "; Python has no expert-parallel layer yet), or drop expert_parallel to run on one GPU";
  user_check(schedule.exchange_chunks() == 1)
      << "schedule '" << schedule.name() << "': exchange_chunks(" << schedule.exchange_chunks()
      << ") divides an expert-parallel layer's row exchange, and one layer has none: add expert_parallel(ranks) "
      << "and compile it with cuda::compile_expert_parallel in C++ (Python has no expert-parallel layer yet), or drop "
         "exchange_chunks";
  KernelProgram p = build_steps(pipeline, schedule);
  dump("build_steps", p, observe);
  p = fuse_gate_into_epilogue(std::move(p), schedule);
  dump("fuse_gate_into_epilogue", p, observe);
  p = split_unfused_epilogues(std::move(p), schedule);
  dump("split_unfused_epilogues", p, observe);
  p = insert_permutation(std::move(p), schedule);
  dump("insert_permutation", p, observe);
  p = assign_row_layouts(std::move(p), schedule);
  dump("assign_row_layouts", p, observe);
  p = resolve_row_maps(std::move(p), schedule);
  dump("resolve_row_maps", p, observe);
  p = materialize_transposes(std::move(p), schedule);
  dump("materialize_transposes", p, observe);
  pad_dynamic_rows(p);
  check_dropping(p);
  return p;
}

KernelProgram lower(const Pipeline &pipeline, const Schedule &schedule, const PassObserver &observe) {
  KernelProgram p = lower_before_fusion(pipeline, schedule, observe);
  // Last, so that the row layouts and row maps they read are final.
  const size_t end = merge_sibling_gemms(p, 0, p.steps.size());
  dump("merge_sibling_gemms", p, observe);
  const size_t fused = fuse_elementwise_consumers(p, 0, end, schedule);
  dump("fuse_elementwise_consumers", p, observe);
  if (schedule.atomic_combine() && fuse_atomic_combines(p, 0, fused) == fused)
    p.not_applied.push_back(kAtomicCombineNotApplied);
  dump("fuse_atomic_combines", p, observe);
  // Forward only: training's backward reads the probabilities (lower_training
  // runs lower_before_fusion, not these).
  p = gate_from_routing(std::move(p), schedule);
  dump("gate_from_routing", p, observe);
  p = softmax_into_routing(std::move(p), schedule);
  dump("softmax_into_routing", p, observe);
  p = fuse_attention(std::move(p), schedule);
  dump("fuse_attention", p, observe);
  // The outputs in bf16 as the training step's forward stores them: a bf16
  // model converted the f32 y with a kernel of its own after every forward
  // (at decoding sizes a launch is a tenth of the layer's time).
  if (schedule.bf16_boundary())
    store_in_bf16(p, {p.outputs.begin(), p.outputs.end()});
  pad_dynamic_rows(p); // the tensors the passes above added
  plan_gemms(p);       // last: of the steps as they are
  dump("plan_gemms", p, observe);
  return p;
}

} // namespace moeforge
