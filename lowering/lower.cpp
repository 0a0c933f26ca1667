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
#include "lowering/rename_indices.h"

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

// Renames plain index variables (a route's pair variable is never renamed:
// the consumer and the GEMM share it).
struct RenameVars : RenameIndices {
  RenameVars() { plain_only = true; }
};

// Replaces reads of each named tensor at exactly (row, col) by its value;
// counts others.
struct Substitute : IRMutator {
  std::map<std::string, Expr> values;
  Var row, col;
  int other_reads = 0;
  Expr mutate_node(const Access &a, const Expr &self) override {
    auto it = values.find(a.target_name());
    if (it == values.end())
      return self;
    if (a.args.size() == 2 && a.args[0].is_plain() && a.args[0].var.same_as(row) && a.args[1].is_plain() &&
        a.args[1].var.same_as(col))
      return it->second;
    ++other_reads;
    return self;
  }
};

// Replaces reads of one accumulator placeholder by another's.
struct RenameAccumulator : IRMutator {
  FuncPtr from, to;
  Expr mutate_node(const Access &a, const Expr &self) override {
    return a.func == from ? Access::make(to, a.args) : self;
  }
};

// combine(route, t, body) over a route with k = 1 sums the one pair r = t of
// each token: it is `body` itself, written at row r. Inlines every such
// combine of `g`'s route into its body and renames t to r, so the result
// reads like an element-wise step over (r, col). For k > 1 a token's k pairs
// sit in different GEMM tiles, so no epilogue sees the whole sum (it would
// need atomics, and lose determinism): those combines are left alone.
struct InlineSinglePairCombine : IRMutator {
  const RoutingNode *route = nullptr;
  Var token;
  bool ok = true; // false: a sum over pairs that is not such a combine
  Expr mutate_node(const RouteSum &n, const Expr &self) override {
    if (n.route.get() != route || route->k != 1 || n.field != RouteField::token || !n.target.same_as(token)) {
      ok = false;
      return self;
    }
    return mutate(n.body);
  }
};

// The body of an element-wise step (t, col) made of k = 1 combines over the
// routed GEMM g's pairs, as an expression over g's (pair, col); nullopt when
// it is not one.
std::optional<Expr> single_pair_combine(const PointwiseStep &pw, const GemmStep &g) {
  const RoutingNode *r = g.route;
  if (!r || g.expert_k || r->k != 1 || !g.row_var.same_as(r->pair) || !pw.vars[0].dim().same_as(r->token_dim()))
    return std::nullopt;
  InlineSinglePairCombine inline_combines;
  inline_combines.route = r;
  inline_combines.token = pw.vars[0];
  Expr body = inline_combines.mutate(pw.body);
  if (!inline_combines.ok || contains_kind(body, ExprKind::RouteSum))
    return std::nullopt;
  RenameVars to_pair; // other reads at token t read at r: the same row when k = 1
  to_pair.to[pw.vars[0].get()] = r->pair;
  return to_pair.mutate(body);
}

// The row map of a GEMM's primary output: tile order for dense GEMMs and
// padded tensors, pair r otherwise (pair order, or a token's row when k = 1).
RowMap output_rows(const GemmStep &g, const TensorDecl &t) {
  return g.route && t.layout != RowLayout::padded ? RowMap::gather_pair : RowMap::direct;
}

} // namespace

size_t merge_sibling_gemms(KernelProgram &p, size_t begin, size_t end) {
  auto producer = [&](const std::string &name) { return step_writing(p, name); };
  auto siblings = [](const GemmStep &x, const GemmStep &y) {
    return x.route == y.route && x.m.same_as(y.m) && x.n.same_as(y.n) && x.k.same_as(y.k) && x.a == y.a &&
           x.a_rows == y.a_rows && x.a_trans == y.a_trans && x.b_per_expert == y.b_per_expert &&
           x.b_trans == y.b_trans && !x.expert_k && !y.expert_k && !x.operands_in_place && !y.operands_in_place &&
           x.out_rows == y.out_rows && x.block == y.block && x.tiling == y.tiling && y.b.size() == 1 &&
           y.accumulators.size() == 1 && !x.unfused && !y.unfused;
  };
  for (size_t i = begin; i < end; ++i) {
    auto *g = std::get_if<GemmStep>(&p.steps[i]);
    if (!g)
      continue;
    for (size_t j = i + 1; j < end; ++j) {
      auto *h = std::get_if<GemmStep>(&p.steps[j]);
      // The merged GEMM holds one accumulator per B: wgmma's registers allow
      // tile_n / 2 of them per thread and B (at most 128).
      const int nb = static_cast<int>(g->b.size()) + 1;
      const bool fits = g->tiling.mma == MmaKind::mma_sync || nb * g->tiling.tile_n / 2 <= 128;
      if (!h || !siblings(*g, *h) || !fits || producer(h->b[0]) >= static_cast<long>(i))
        continue;
      RenameVars vars;
      vars.to[h->col_var.get()] = g->col_var;
      if (!g->route)
        vars.to[h->row_var.get()] = g->row_var;
      RenameAccumulator acc;
      acc.from = h->accumulators[0];
      acc.to = placeholder("acc" + std::to_string(g->accumulators.size()), {g->row_var, g->col_var}, DType::f32);
      auto moved = [&](const Expr &e) { return acc.mutate(vars.mutate(e)); };
      g->b.push_back(h->b[0]);
      g->accumulators.push_back(acc.to);
      g->extra.push_back({h->output, moved(h->epilogue)});
      for (const GemmStep::Extra &e : h->extra)
        g->extra.push_back({e.output, moved(e.value)});
      g->name += "_" + h->output;
      p.steps.erase(p.steps.begin() + static_cast<long>(j));
      --j;
      --end;
    }
  }
  return end;
}

namespace {

// Whether no step reads tensor `name` and the caller does not ask for it.
bool unwanted(const KernelProgram &p, const std::string &name) {
  if (is_output(p, name))
    return false;
  for (const Step &s : p.steps)
    for (const std::string &r : step_reads(s))
      if (r == name)
        return false;
  return true;
}

void erase_tensor(KernelProgram &p, const std::string &name) {
  p.tensors.erase(
      std::find_if(p.tensors.begin(), p.tensors.end(), [&](const TensorDecl &t) { return t.name == name; }));
}

} // namespace

size_t merge_sibling_pointwise(KernelProgram &p, size_t begin, size_t end, const Schedule &schedule) {
  auto producer = [&](const std::string &name) { return step_writing(p, name); };
  auto plain = [&](const Expr &e) {
    return !contains_kind(e, ExprKind::Sum) && !contains_kind(e, ExprKind::Softmax) &&
           !contains_kind(e, ExprKind::RouteSum);
  };
  auto elementwise = [&](const PointwiseStep &s) {
    return plain(s.body) && s.extra.empty() && schedule.for_func(s.output).fuse_epilogue;
  };
  // Same index Dims, and outputs stored alike (one grid walks both).
  auto siblings = [&](const PointwiseStep &x, const PointwiseStep &y) {
    if (x.vars.size() != y.vars.size())
      return false;
    for (size_t i = 0; i < x.vars.size(); ++i)
      if (!x.vars[i].dim().same_as(y.vars[i].dim()))
        return false;
    const TensorDecl &a = p.tensor(x.output), &b = p.tensor(y.output);
    return a.layout == b.layout && a.route == b.route && a.stride8 == b.stride8 && a.zero_padding == b.zero_padding &&
           a.outer_stride == b.outer_stride;
  };
  // y(i...) = sum(j, e(i..., j)) over x's index Dims, j over x's last: y
  // rides along x as a row sum (e element-wise).
  auto row_sum_of = [&](const PointwiseStep &x, const PointwiseStep &y) -> const Sum * {
    const Sum *sum = y.body.as<Sum>();
    if (!sum || !y.extra.empty() || y.vars.size() + 1 != x.vars.size() || !plain(sum->body) ||
        !sum->var.dim().same_as(x.vars.back().dim()) || !schedule.for_func(y.output).fuse_epilogue)
      return nullptr;
    for (size_t i = 0; i < y.vars.size(); ++i)
      if (!y.vars[i].dim().same_as(x.vars[i].dim()))
        return nullptr;
    return sum;
  };
  // y's summand over x's indices: the row sum's value.
  auto summand = [&](const PointwiseStep &x, const PointwiseStep &y, const Sum &sum) {
    RenameIndices vars;
    for (size_t v = 0; v < y.vars.size(); ++v)
      vars.to[y.vars[v].get()] = x.vars[v];
    vars.to[sum.var.get()] = x.vars.back();
    return vars.mutate(sum.body);
  };
  // Everything step j reads is ready at step i: made before it, or (`inline`
  // set) one of step i's own element-wise outputs, read at its indices,
  // whose value then replaces the read.
  auto ready_at = [&](size_t i, size_t j, std::map<std::string, Expr> *inline_values) {
    std::vector<std::string> written = step_outputs(p.steps[i]);
    for (const std::string &r : step_reads(p.steps[j]))
      if (std::find(written.begin(), written.end(), r) != written.end() ? !inline_values || !inline_values->count(r)
                                                                        : producer(r) >= static_cast<long>(i))
        return false;
    return true;
  };
  for (size_t i = begin; i < end; ++i) {
    auto *g = std::get_if<PointwiseStep>(&p.steps[i]);
    if (!g)
      continue;
    // A row sum before its element-wise sibling (the gate gradient before
    // the activation's backward): the sibling moves up to it and takes the
    // sum along.
    if (!elementwise(*g)) {
      bool moved = false;
      for (size_t j = i + 1; j < end && !moved; ++j) {
        auto *h = std::get_if<PointwiseStep>(&p.steps[j]);
        const Sum *sum = h && elementwise(*h) ? row_sum_of(*h, *g) : nullptr;
        if (!sum || !ready_at(i, j, nullptr))
          continue;
        PointwiseStep merged = *h;
        merged.extra.push_back({g->output, summand(*h, *g, *sum), /*row_sum=*/true});
        merged.name += "_" + g->output;
        p.steps[i] = std::move(merged);
        p.steps.erase(p.steps.begin() + static_cast<long>(j));
        --end;
        moved = true;
      }
      if (!moved)
        continue;
      g = &std::get<PointwiseStep>(p.steps[i]);
    }
    for (size_t j = i + 1; j < end; ++j) {
      auto *h = std::get_if<PointwiseStep>(&p.steps[j]);
      if (!h)
        continue;
      // h moves up to step i: everything it reads must be ready there. What
      // it reads of g's own element-wise outputs (at their indices) it reads
      // as g computes them: the values replace the reads (the gate
      // gradient's row sum over the h that recompute_elementwise makes
      // again; s(r) * that h for dW2).
      const Sum *sum = nullptr;
      Expr value;
      if (elementwise(*h) && siblings(*g, *h)) {
        RenameIndices vars;
        for (size_t v = 0; v < g->vars.size(); ++v)
          vars.to[h->vars[v].get()] = g->vars[v];
        value = vars.mutate(h->body);
      } else if ((sum = row_sum_of(*g, *h))) {
        value = summand(*g, *h, *sum);
      } else {
        continue;
      }
      std::map<std::string, Expr> values{{g->output, g->body}};
      for (const ExtraOutput &e : g->extra)
        if (!e.row_sum)
          values[e.output] = e.value;
      if (!ready_at(i, j, &values))
        continue;
      struct Inline : IRMutator {
        const std::map<std::string, Expr> *values;
        const std::vector<Var> *at;
        int failed = 0;
        Expr mutate_node(const Access &a, const Expr &self) override {
          auto it = values->find(a.target_name());
          if (it == values->end())
            return self;
          bool same = a.args.size() == at->size();
          for (size_t v = 0; same && v < a.args.size(); ++v)
            same = a.args[v].is_plain() && a.args[v].var.same_as((*at)[v]);
          failed += same ? 0 : 1;
          return same ? it->second : self;
        }
      } in;
      in.values = &values;
      in.at = &g->vars;
      value = in.mutate(value);
      if (in.failed)
        continue;
      g->extra.push_back({h->output, value, /*row_sum=*/sum != nullptr});
      g->name += "_" + h->output;
      p.steps.erase(p.steps.begin() + static_cast<long>(j));
      --j;
      --end;
    }
  }
  // A merged step's element-wise output that nothing reads any more (the h
  // recompute_elementwise makes, once every value made from it is computed
  // in place) is not stored; a primary output so dropped gives its place to
  // the step's next element-wise value.
  for (size_t k = begin; k < end; ++k) {
    auto *g = std::get_if<PointwiseStep>(&p.steps[k]);
    if (!g || g->extra.empty())
      continue;
    for (size_t e = 0; e < g->extra.size();) {
      if (g->extra[e].row_sum || !unwanted(p, g->extra[e].output)) {
        ++e;
        continue;
      }
      erase_tensor(p, g->extra[e].output);
      g->extra.erase(g->extra.begin() + static_cast<long>(e));
    }
    auto next = std::find_if(g->extra.begin(), g->extra.end(), [](const ExtraOutput &e) { return !e.row_sum; });
    if (next != g->extra.end() && unwanted(p, g->output)) {
      erase_tensor(p, g->output);
      g->output = next->output;
      g->body = next->value;
      g->extra.erase(next);
    }
    g->name = pointwise_name(*g); // named after what it writes
  }
  return end;
}

namespace {

// The latest GEMM of steps [begin, i) whose output step i reads (`reads`,
// step_reads of step i); -1 for none.
long latest_gemm_read_by(const KernelProgram &p, size_t begin, size_t i, const std::vector<std::string> &reads) {
  long j = -1;
  for (const std::string &r : reads) {
    long k = step_writing(p, r);
    if (k >= static_cast<long>(begin) && k < static_cast<long>(i) && std::holds_alternative<GemmStep>(p.steps[k]))
      j = std::max(j, k);
  }
  return j;
}

// `body` as g's epilogue computes it: its index variables renamed by
// `rename` to g's (row, col), and its reads of g's outputs (the primary and
// the fused ones) there replaced by their values; nullopt where it reads
// them anywhere else.
std::optional<Expr> in_epilogue(const GemmStep &g, const Expr &body, const RenameVars &rename) {
  Substitute sub;
  sub.values[g.output] = g.epilogue;
  for (const GemmStep::Extra &e : g.extra)
    sub.values[e.output] = e.value;
  sub.row = g.row_var;
  sub.col = g.col_var;
  RenameVars r = rename;
  Expr value = sub.mutate(r.mutate(body));
  if (sub.other_reads)
    return std::nullopt;
  return value;
}

} // namespace

size_t fuse_elementwise_consumers(KernelProgram &p, size_t begin, size_t end, const Schedule &schedule) {
  auto producer = [&](const std::string &name) { return step_writing(p, name); };
  for (size_t i = begin; i < end; ++i) {
    auto *pw = std::get_if<PointwiseStep>(&p.steps[i]);
    if (!pw || pw->vars.size() != 2 || contains_kind(pw->body, ExprKind::Sum) ||
        contains_kind(pw->body, ExprKind::Softmax) || !schedule.for_func(pw->output).fuse_epilogue)
      continue; // fuse_epilogue(f, false) keeps f's own step too (split_unfused_epilogues made it)
    // The latest GEMM of this part whose output the step reads.
    const std::vector<std::string> reads = step_reads(p.steps[i]);
    const long j = latest_gemm_read_by(p, begin, i, reads);
    if (j < 0)
      continue;
    GemmStep &g = std::get<GemmStep>(p.steps[j]);
    const Var &v0 = pw->vars[0], &v1 = pw->vars[1];
    Expr body = pw->body;
    bool rows_match = false;
    if (contains_kind(body, ExprKind::RouteSum)) {
      std::optional<Expr> combine = single_pair_combine(*pw, g);
      rows_match = combine.has_value();
      body = combine.value_or(body);
    } else {
      bool v0_routed =
          std::any_of(p.routes.begin(), p.routes.end(), [&](const RoutingNode *r) { return r->pair.same_as(v0); });
      rows_match = g.route ? v0.same_as(g.row_var) : (!v0_routed && v0.dim().same_as(g.m));
    }
    if (g.expert_k || !rows_match || !v1.dim().same_as(g.n) || !schedule.for_func(g.output).fuse_epilogue)
      continue;
    // Every other read must be ready when the GEMM runs; reads of the
    // GEMM's own outputs (its output and the fused ones) become their values.
    bool ready = true;
    for (const std::string &r : reads)
      ready &= producer(r) <= j;
    if (!ready)
      continue;
    RenameVars rename;
    rename.to[v1.get()] = g.col_var;
    if (!g.route)
      rename.to[v0.get()] = g.row_var;
    std::optional<Expr> value = in_epilogue(g, body, rename);
    if (!value)
      continue; // reads the GEMM's output elsewhere than its own element
    g.extra.push_back({pw->output, *value});
    // A padded output keeps its zero padding when the epilogue writes whole
    // routing blocks, a tile each (its rows past the block's pairs as zeros);
    // tiles that split a block, or clusters (whose idle partner would zero
    // the other block's rows), leave padding rows unwritten.
    TensorDecl &fused = *p.find(pw->output);
    fused.zero_padding &= g.route && g.block == g.tiling.tile_m && g.tiling.cluster_m == 1;
    p.steps.erase(p.steps.begin() + static_cast<long>(i));
    --i;
    --end;
  }
  // A fused output no step reads and the caller does not want is not stored
  // (its value lives on in the outputs it was substituted into).
  for (size_t k = begin; k < end; ++k) {
    auto *g = std::get_if<GemmStep>(&p.steps[k]);
    if (!g)
      continue;
    for (size_t e = 0; e < g->extra.size();) {
      if (!unwanted(p, g->extra[e].output)) {
        ++e;
        continue;
      }
      erase_tensor(p, g->extra[e].output);
      g->extra.erase(g->extra.begin() + static_cast<long>(e));
    }
  }
  // A GEMM output no step reads and the caller does not want is not stored:
  // its first extra output becomes the primary one.
  for (size_t k = begin; k < end; ++k) {
    auto *g = std::get_if<GemmStep>(&p.steps[k]);
    if (!g || g->extra.empty() || !unwanted(p, g->output))
      continue;
    erase_tensor(p, g->output);
    g->output = g->extra.front().output;
    g->epilogue = g->extra.front().value;
    g->extra.erase(g->extra.begin());
    g->out_rows = output_rows(*g, p.tensor(g->output));
  }
  return end;
}

const char *const kAtomicCombineNotApplied =
    "atomic_combine(true) is not applied: no combine over k > 1 pairs is the only reader of a routed GEMM's "
    "output (a k = 1 combine is a store in the epilogue already; a training backward that reads the expert "
    "outputs keeps them: gate_gradient_from_dh(true) on the wgmma loops takes the gate's gradient from h "
    "instead)";

namespace {

// The step of the dense GEMM whose output `e` reads as it is, w(t, col) at
// the combine step's own indices, when that GEMM stores its accumulator
// plainly in y's dtype and shape and step i is w's only reader; else -1.
// That GEMM can then write y itself, and the combine's adds land on it.
long dense_gemm_onto(const KernelProgram &p, size_t i, const Expr &e, const PointwiseStep &pw) {
  const auto *a = e.as<Access>();
  if (!a || a->args.size() != 2 || !a->args[0].is_plain() || !a->args[1].is_plain() ||
      !a->args[0].var.same_as(pw.vars[0]) || !a->args[1].var.same_as(pw.vars[1]))
    return -1;
  const std::string w = a->target_name();
  const long k = step_writing(p, w);
  const auto *g = k >= 0 ? std::get_if<GemmStep>(&p.steps[k]) : nullptr;
  if (!g || g->route || g->out_add || !g->extra.empty() || g->output != w || is_output(p, w) ||
      !stores_plain_accumulator(*g) || reads_of(p, w) != 1)
    return -1;
  const TensorDecl &wt = p.tensor(w), &yt = p.tensor(pw.output);
  if (wt.dtype != yt.dtype || wt.dims != yt.dims || wt.layout != RowLayout::dense || wt.stride8 != yt.stride8 ||
      wt.outer_stride != yt.outer_stride)
    return -1;
  for (size_t s = 0; s < p.steps.size(); ++s)
    if (s != i && s != static_cast<size_t>(k))
      for (const std::string &o : step_outputs(p.steps[s]))
        if (o == pw.output)
          return -1;
  return k;
}

} // namespace

size_t fuse_atomic_combines(KernelProgram &p, size_t begin, size_t end) {
  auto producer = [&](const std::string &name) { return step_writing(p, name); };
  for (size_t i = begin; i < end; ++i) {
    auto *pw = std::get_if<PointwiseStep>(&p.steps[i]);
    // y(t, col) = combine(route, t, v(r, col)), the whole body, or plus a
    // dense GEMM's output w(t, col) (a training backward's input gradient:
    // the experts' share and the router's): v must not read at t itself
    // (only at the pair), since the epilogue has r alone.
    long onto = -1; // the dense GEMM w's, which then writes y for the adds to land on
    Expr combine = pw ? pw->body : Expr();
    if (pw && !combine.as<RouteSum>())
      if (const auto *add = pw->body.as<Binary>(); add && add->op == BinaryOp::add)
        for (const auto &[sum, other] : {std::pair{add->a, add->b}, std::pair{add->b, add->a}})
          if (sum.as<RouteSum>() && (onto = dense_gemm_onto(p, i, other, *pw)) >= 0) {
            combine = sum;
            break;
          }
    const RouteSum *rs = pw ? combine.as<RouteSum>() : nullptr;
    if (!rs || pw->vars.size() != 2 || !pw->extra.empty() || rs->field != RouteField::token ||
        !rs->target.same_as(pw->vars[0]) || rs->route->k == 1 || uses_var(rs->body, pw->vars[0]))
      continue;
    const RoutingNode *r = rs->route.get();
    // The routed GEMM whose output the combine sums: the latest the sum reads.
    const std::vector<std::string> reads = step_reads(PointwiseStep{"", pw->output, pw->vars, combine, {}, {}});
    long j = latest_gemm_read_by(p, begin, i, reads);
    if (j < 0)
      continue;
    {
      const GemmStep &g = std::get<GemmStep>(p.steps[j]);
      if (g.route != r || g.expert_k || g.windowed || !g.row_var.same_as(r->pair) || !pw->vars[1].dim().same_as(g.n) ||
          is_output(p, g.output))
        continue;
    }
    // The combine must be the GEMM output's only reader (it is not stored
    // any more), and everything else it reads ready when the GEMM runs.
    bool ok = true;
    for (size_t k = 0; k < p.steps.size(); ++k)
      for (const std::string &name : step_reads(p.steps[k]))
        ok &= k == i || name != std::get<GemmStep>(p.steps[j]).output;
    for (const std::string &name : reads)
      ok &= producer(name) <= j;
    // w is written before the adds: its GEMM moves ahead of the routed one
    // when what it reads is ready by then (nothing between reads w).
    if (onto > j)
      for (const std::string &name : step_reads(p.steps[onto]))
        ok &= producer(name) < j;
    if (!ok)
      continue;
    if (onto > j) {
      Step moved = std::move(p.steps[onto]);
      p.steps.erase(p.steps.begin() + onto);
      p.steps.insert(p.steps.begin() + j, std::move(moved));
      onto = j++;
    }
    GemmStep &g = std::get<GemmStep>(p.steps[j]);
    RenameVars rename;
    rename.to[pw->vars[1].get()] = g.col_var;
    std::optional<Expr> value = in_epilogue(g, rs->body, rename);
    if (!value)
      continue;
    erase_tensor(p, g.output);
    g.output = pw->output;
    g.epilogue = *value;
    g.out_rows = RowMap::gather_token;
    g.out_add = true;
    if (onto >= 0) {
      auto &w = std::get<GemmStep>(p.steps[onto]);
      erase_tensor(p, w.output);
      w.output = pw->output;
      g.out_add_onto_written = true;
    }
    p.steps.erase(p.steps.begin() + static_cast<long>(i));
    --i;
    --end;
  }
  return end;
}

namespace {

// A read of the route's scores at its pairs' choices, S(token(r), expert(r)):
// the value top-k selected for pair r.
bool reads_chosen_score(const Expr &e, const RoutingStep &rs) {
  const RoutingNode *r = rs.route;
  auto at = [&](const Index &i, RouteField f) { return i.field == f && i.route.get() == r && i.var.same_as(r->pair); };
  auto *a = e.as<Access>();
  return a && a->target_name() == rs.probs && a->args.size() == 2 && at(a->args[0], RouteField::token) &&
         at(a->args[1], RouteField::expert);
}

// The tensor a renormalised gate divides by: `total` in
// g(r) = S(token(r), expert(r)) / total(token(r)), or "" when body is not that.
std::string renormalising_total(const Expr &body, const RoutingStep &rs) {
  auto *div = body.as<Binary>();
  if (!div || div->op != BinaryOp::div || !reads_chosen_score(div->a, rs))
    return "";
  auto *a = div->b.as<Access>();
  const RoutingNode *r = rs.route;
  if (!a || a->args.size() != 1 || a->args[0].field != RouteField::token || a->args[0].route.get() != r ||
      !a->args[0].var.same_as(r->pair))
    return "";
  return a->target_name();
}

// Whether step `s` is total(t) = route_sum over t's pairs of S(token(r),
// expert(r)): the sum top_k(..., renormalize) divides by.
bool sums_chosen_scores(const Step &s, const std::string &total, const RoutingStep &rs) {
  auto *pw = std::get_if<PointwiseStep>(&s);
  if (!pw || pw->output != total || !pw->extra.empty() || pw->vars.size() != 1)
    return false;
  auto *sum = pw->body.as<RouteSum>();
  return sum && sum->route.get() == rs.route && sum->field == RouteField::token && sum->target.same_as(pw->vars[0]) &&
         reads_chosen_score(sum->body, rs);
}

} // namespace

KernelProgram gate_from_routing(KernelProgram p, const Schedule &) {
  for (size_t i = 0; i < p.steps.size(); ++i) {
    auto *rs = std::get_if<RoutingStep>(&p.steps[i]);
    if (!rs || !rs->gate_output.empty())
      continue;
    // The routing writes gates in pair order (r = t * k + slot) as f32, so the
    // tensor must be stored that way.
    for (size_t j = i + 1; j < p.steps.size(); ++j) {
      auto *pw = std::get_if<PointwiseStep>(&p.steps[j]);
      if (!pw || pw->vars.size() != 1 || !pw->vars[0].same_as(rs->route->pair) || !pw->extra.empty())
        continue;
      const TensorDecl &t = p.tensor(pw->output);
      if (t.dtype != DType::f32 || t.layout != RowLayout::pair || t.route != rs->route || t.stride8)
        continue;
      if (reads_chosen_score(pw->body, *rs)) {
        rs->gate_output = pw->output;
        p.steps.erase(p.steps.begin() + static_cast<long>(j)); // after i: rs stays valid
        break;
      }
      // A renormalised gate: the routing holds a token's k chosen scores
      // together, so it divides by their sum itself, and the sum's step goes
      // too when nothing else reads it. With a capacity the sum skips the
      // pairs dropped after the selection, which the top-k cannot know; the
      // group-limited top-k is another kernel, which does not divide.
      const std::string total = renormalising_total(pw->body, *rs);
      if (total.empty() || rs->drops() || rs->route->groups > 1 || is_output(p, total) || reads_of(p, total) != 1)
        continue;
      auto sum_step = std::find_if(p.steps.begin() + static_cast<long>(i) + 1, p.steps.begin() + static_cast<long>(j),
                                   [&](const Step &s) { return sums_chosen_scores(s, total, *rs); });
      if (sum_step == p.steps.begin() + static_cast<long>(j))
        continue;
      const TensorDecl &sum_tensor = p.tensor(total);
      if (sum_tensor.dtype != DType::f32)
        continue;
      rs->gate_output = pw->output;
      rs->renormalize = true;
      p.steps.erase(p.steps.begin() + static_cast<long>(j)); // after i: rs stays valid
      p.steps.erase(sum_step);                               // between i and j
      erase_tensor(p, total);
      break;
    }
  }
  return p;
}

KernelProgram softmax_into_routing(KernelProgram p, const Schedule &) {
  for (size_t i = 0; i < p.steps.size(); ++i) {
    auto *rs = std::get_if<RoutingStep>(&p.steps[i]);
    // Group-limited routing selects in its own kernel, which takes scores
    // (routing_kernels.cuh, moe_topk_grouped): the softmax stays a step.
    if (!rs || rs->softmax || is_output(p, rs->probs) || rs->route->groups > 1)
      continue;
    const RoutingNode *r = rs->route;
    // The scores' one producer and their readers: the routing must be the
    // only one, or the probabilities have to be stored anyway.
    long producer = -1;
    int producers = 0, readers = 0;
    for (size_t k = 0; k < p.steps.size(); ++k) {
      for (const std::string &o : step_outputs(p.steps[k]))
        if (o == rs->probs) {
          producer = static_cast<long>(k);
          ++producers;
        }
      for (const std::string &n : step_reads(p.steps[k]))
        readers += n == rs->probs;
    }
    if (producers != 1 || readers != 1 || producer > static_cast<long>(i))
      continue;
    // Exactly S(t, e) = softmax(e, L(t, e)) over the route's (token, expert).
    auto *pw = std::get_if<PointwiseStep>(&p.steps[producer]);
    const Softmax *sm = pw ? pw->body.as<Softmax>() : nullptr;
    const Access *l = sm ? sm->body.as<Access>() : nullptr;
    auto plain = [](const Index &x, const Var &v) { return x.is_plain() && x.var.same_as(v); };
    if (!l || pw->vars.size() != 2 || !pw->vars[0].same_as(r->token_var) || !pw->vars[1].same_as(r->expert_var) ||
        !sm->var.same_as(r->expert_var) || l->args.size() != 2 || !plain(l->args[0], r->token_var) ||
        !plain(l->args[1], r->expert_var))
      continue;
    // The routing reads L as it read S: f32 rows of E, densely stored.
    const TensorDecl *logits = p.find(l->target_name());
    if (!logits || logits->dtype != DType::f32 || logits->layout != RowLayout::dense || logits->stride8 ||
        logits->dims.size() != 2 || !logits->dims[0].same_as(r->token_dim()) ||
        !logits->dims[1].same_as(r->expert_dim()))
      continue;
    std::string scores = rs->probs;
    rs->probs = logits->name;
    rs->softmax = true;
    p.steps.erase(p.steps.begin() + producer); // before i: rs is invalid from here
    erase_tensor(p, scores);
    --i;
  }
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
