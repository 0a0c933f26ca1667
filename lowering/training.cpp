#include "lowering/training.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

#include "dsl/error.h"
#include "dsl/visitor.h"
#include "lowering/dynamic_rows.h"
#include "lowering/fuse_attention.h"
#include "lowering/gate_gradient.h"
#include "lowering/gemm_plan.h"
#include "lowering/in_place.h"
#include "lowering/lower.h"
#include "lowering/merge_reductions.h"
#include "lowering/order_for_memory.h"
#include "lowering/pair_order.h"
#include "lowering/rename_indices.h"
#include "lowering/sorted_rows.h"
#include "lowering/split_for_memory.h"
#include "lowering/summed_gemms.h"

namespace moeforge {

namespace {

bool contains(const std::vector<std::string> &v, const std::string &s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

// Steps any of the outputs needs, found backwards from them; routing steps
// always are (the forward routes, the backward reuses its tables).
std::vector<bool> forward_steps(const KernelProgram &p, const std::vector<std::string> &outputs) {
  std::vector<bool> needed(p.steps.size(), false);
  std::set<std::string> wanted(outputs.begin(), outputs.end());
  for (size_t i = p.steps.size(); i-- > 0;) {
    const Step &s = p.steps[i];
    if (!std::holds_alternative<RoutingStep>(s) && !wanted.count(step_output(s)))
      continue;
    needed[i] = true;
    for (const std::string &r : step_reads(s))
      wanted.insert(r);
  }
  return needed;
}

// A read of tensor `name` at the indices of `a`.
Expr read_of(const std::string &name, const Access &a) { return tensor_read(name, a.dtype, a.args); }

// Renames reads of tensors in a step (the backward reading its own copies).
struct RenameReads : IRMutator {
  const std::map<std::string, std::string> *to;
  Expr mutate_node(const Access &a, const Expr &self) override {
    auto it = to->find(a.target_name());
    return it == to->end() ? self : read_of(it->second, a);
  }
};

void rename_reads(Step &s, const std::map<std::string, std::string> &to) {
  auto name = [&](std::string &n) {
    if (auto it = to.find(n); it != to.end())
      n = it->second;
  };
  RenameReads m;
  m.to = &to;
  std::visit(
      [&](auto &x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, GemmStep>) {
          name(x.a);
          for (std::string &b : x.b)
            name(b);
          x.epilogue = m.mutate(x.epilogue);
        } else if constexpr (std::is_same_v<T, PointwiseStep>) {
          x.body = m.mutate(x.body);
          for (ExtraOutput &e : x.extra)
            e.value = m.mutate(e.value);
        } else if constexpr (std::is_same_v<T, GatherStep> || std::is_same_v<T, TransposeStep>) {
          name(x.src);
        }
      },
      s);
}

void set_output(Step &s, const std::string &out) {
  std::visit(
      [&](auto &x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, GatherStep> || std::is_same_v<T, TransposeStep>) {
          x.dst = out;
          x.name += "_re";
        } else if constexpr (!std::is_same_v<T, RoutingStep>) {
          x.output = out;
          x.name += "_re";
        }
      },
      s);
}

// Replaces reads of one tensor, at plain indices, by its element-wise
// definition there; `failed` counts reads it could not replace.
struct InlineValue : IRMutator {
  const PointwiseStep *def;
  int failed = 0;
  Expr mutate_node(const Access &a, const Expr &self) override {
    if (a.target_name() != def->output)
      return self;
    RenameIndices at;
    for (size_t i = 0; i < a.args.size(); ++i) {
      if (!a.args[i].is_plain()) {
        ++failed;
        return self;
      }
      at.to[def->vars[i].get()] = a.args[i].var;
    }
    return at.mutate(def->body);
  }
};

// The forward's element-wise values that the backward reads only in its own
// element-wise steps (SwiGLU's h_lhs = silu(h_silu_in)) are made again where
// the backward reads them, from the tensors they are made of, instead of
// being kept: an exp and a division per element against writing and
// reading back a T * k x f tensor. Values that sum or combine, and those a
// backward GEMM reads, stay kept.
void inline_elementwise_values(const std::vector<Step> &f_steps, std::vector<Step> &b_steps,
                               const std::vector<std::string> &outputs) {
  for (const Step &s : f_steps) {
    auto *def = std::get_if<PointwiseStep>(&s);
    if (!def || contains(outputs, def->output) || contains_kind(def->body, ExprKind::Sum) ||
        contains_kind(def->body, ExprKind::RouteSum) || contains_kind(def->body, ExprKind::Softmax))
      continue;
    bool only_elementwise = true, read = false;
    for (const Step &b : b_steps)
      if (contains(step_reads(b), def->output)) {
        read = true;
        only_elementwise &= std::holds_alternative<PointwiseStep>(b);
      }
    if (!read || !only_elementwise)
      continue;
    std::vector<Step> inlined = b_steps;
    bool ok = true;
    for (Step &b : inlined)
      if (auto *pw = std::get_if<PointwiseStep>(&b)) {
        InlineValue v;
        v.def = def;
        pw->body = v.mutate(pw->body);
        ok &= v.failed == 0;
      }
    if (ok)
      b_steps = std::move(inlined);
  }
}

// Replaces reads of a GEMM's accumulators by reads of the tensors that store
// them as they are, at the same (row, col).
struct AccumulatorsFromTensors : IRMutator {
  std::map<const FuncNode *, std::string> stored; // accumulator -> tensor
  Expr mutate_node(const Access &a, const Expr &self) override {
    auto it = a.func ? stored.find(a.func.get()) : stored.end();
    return it == stored.end() ? self : read_of(it->second, a);
  }
};

// schedule.recompute_elementwise(): a forward GEMM's fused output whose value
// reads only accumulators that the GEMM also stores as they are (SwiGLU's h
// = silu(acc0) * acc1 beside h_silu_in = acc0 and h_rhs = acc1) is made
// again in the backward, from those tensors, by an element-wise step placed
// before its first backward reader (merge_sibling_pointwise then runs it in
// the kernel that reads the same tensors); the backward reads the copy, so
// the forward's is not kept.
void recompute_epilogue_values(KernelProgram &p, size_t forward_steps, const std::vector<std::string> &outputs) {
  std::vector<std::pair<size_t, Step>> inserts; // (position, step), made after the walk
  for (size_t i = 0; i < forward_steps; ++i) {
    auto *g = std::get_if<GemmStep>(&p.steps[i]);
    if (!g || !g->route || g->expert_k)
      continue;
    auto accumulator = [&](const Expr &e) -> const FuncNode * {
      auto *a = e.as<Access>();
      if (!a || a->args.size() != 2 || !a->args[0].is_plain() || !a->args[0].var.same_as(g->row_var) ||
          !a->args[1].is_plain() || !a->args[1].var.same_as(g->col_var))
        return nullptr;
      for (const FuncPtr &acc : g->accumulators)
        if (a->func == acc)
          return acc.get();
      return nullptr;
    };
    AccumulatorsFromTensors from;
    if (const FuncNode *f = accumulator(g->epilogue))
      from.stored[f] = g->output;
    for (const GemmStep::Extra &e : g->extra)
      if (const FuncNode *f = accumulator(e.value))
        from.stored[f] = e.output;
    if (from.stored.size() != g->accumulators.size())
      continue;
    for (const GemmStep::Extra &e : g->extra) {
      if (accumulator(e.value) || contains(outputs, e.output))
        continue;
      bool only_accumulators = true;
      struct Reads : IRVisitor {
        std::vector<const Access *> all;
        void visit_node(const Access &a) override { all.push_back(&a); }
      } reads;
      reads.visit(e.value);
      for (const Access *a : reads.all)
        only_accumulators &= a->func && from.stored.count(a->func.get()) > 0;
      size_t first = p.steps.size();
      for (size_t j = p.steps.size(); j-- > forward_steps;)
        if (contains(step_reads(p.steps[j]), e.output))
          first = j;
      if (!only_accumulators || first == p.steps.size())
        continue;
      TensorDecl copy = p.tensor(e.output);
      copy.name = e.output + "_re";
      p.tensors.push_back(copy);
      const std::map<std::string, std::string> to{{e.output, copy.name}};
      for (size_t j = forward_steps; j < p.steps.size(); ++j)
        rename_reads(p.steps[j], to);
      inserts.emplace_back(
          first,
          PointwiseStep{"pointwise_" + copy.name, copy.name, {g->row_var, g->col_var}, from.mutate(e.value), {}, {}});
    }
  }
  std::stable_sort(inserts.begin(), inserts.end(), [](const auto &a, const auto &b) { return a.first > b.first; });
  for (auto &[at, step] : inserts)
    p.steps.insert(p.steps.begin() + static_cast<long>(at), std::move(step));
}

std::string joined(const std::vector<std::string> &v) {
  std::string s;
  for (const std::string &x : v)
    s += (s.empty() ? "'" : ", '") + x + "'";
  return s;
}

// schedule.bf16_activations(): the routed f32 matrices that are neither the
// step's outputs nor its gradients, the routing's gate nor an input (the
// tensors autodiff and lowering introduced: pre-activations, the backward's
// per-pair gradients) become bf16. Per-pair vectors (gates and their
// gradients) stay f32: they are small, and a gate rounded to bf16 would
// scale every row of its pair by the rounding.
void store_in_bf16(KernelProgram &p, const TrainingProgram &t) {
  std::set<std::string> keep(t.outputs.begin(), t.outputs.end());
  keep.insert(t.gradients.begin(), t.gradients.end());
  keep.insert(t.seeds.begin(), t.seeds.end());
  for (const Step &s : p.steps)
    if (auto *r = std::get_if<RoutingStep>(&s); r && !r->gate_output.empty())
      keep.insert(r->gate_output);
  for (TensorDecl &d : p.tensors)
    if (d.dtype == DType::f32 && !d.is_input && !d.stride8 && d.route && d.dims.size() == 2 &&
        (d.layout == RowLayout::pair || d.layout == RowLayout::padded) && !keep.count(d.name))
      d.dtype = DType::bf16;
}

// schedule.bf16_boundary(), first part: the non-scalar seeds (dy) in bf16,
// before any pass reads their dtype (the dH GEMM's gathered rows need no
// bf16 copy of dy then). They are only ever read.
void seeds_in_bf16(KernelProgram &p, const TrainingProgram &t) {
  for (const std::string &seed : t.seeds)
    if (TensorDecl *d = p.find(seed); d && !d->dims.empty())
      d->dtype = DType::bf16;
}

// schedule.bf16_boundary(), second part, after the fusions: the
// non-scalar outputs (y) and the Inputs' gradients (dx) in bf16, except
// where a GEMM adds into one by atomic adds (atomic_combine: its f32 sum is
// the output, and bf16 atomics would round every pair's share).
void boundary_in_bf16(KernelProgram &p, const TrainingProgram &t, const Pipeline &forward) {
  std::set<std::string> names(t.outputs.begin(), t.outputs.end());
  for (size_t i = 0; i < t.of.size(); ++i)
    for (const BufferPtr &b : forward.buffers())
      if (b->name == t.of[i] && b->kind == BufferKind::input)
        names.insert(t.gradients[i]);
  store_in_bf16(p, names);
  // An Input gradient made in bf16 as the experts' sum over its token's
  // pairs plus a dense GEMM's share (the router's, d_logits wr^T): that
  // share lives beside the pairs' rows at the backward's fullest step (128
  // MiB of f32 at fine64), and the sum is rounded to bf16 anyway, so it is
  // stored in bf16 too: one rounding of a part, at the output's precision.
  for (const Step &s : p.steps) {
    const auto *pw = std::get_if<PointwiseStep>(&s);
    const TensorDecl *out = pw ? p.find(pw->output) : nullptr;
    const auto *add = pw ? pw->body.as<Binary>() : nullptr;
    if (!out || out->dtype != DType::bf16 || !names.count(pw->output) || !add || add->op != BinaryOp::add)
      continue;
    for (const auto &[sum, other] : {std::pair{add->a, add->b}, std::pair{add->b, add->a}}) {
      const auto *share = other.as<Access>();
      if (!sum.as<RouteSum>() || !share || reads_of(p, share->target_name()) != 1)
        continue;
      TensorDecl *d = p.find(share->target_name());
      const auto writer = std::find_if(p.steps.begin(), p.steps.end(), [&](const Step &w) {
        const auto *g = std::get_if<GemmStep>(&w);
        return g && g->output == share->target_name() && !g->route && !g->out_add && g->extra.empty();
      });
      if (d && writer != p.steps.end() && d->dtype == DType::f32 && d->dims == out->dims && !is_output(p, d->name))
        d->dtype = DType::bf16;
    }
  }
}

} // namespace

size_t TrainingProgram::output_index(const std::string &name, const std::string &what) const {
  auto it = std::find(outputs.begin(), outputs.end(), name);
  user_check(it != outputs.end()) << what << ": no output '" << name << "': the training step's outputs are "
                                  << joined(outputs);
  return static_cast<size_t>(it - outputs.begin());
}

std::string TrainingProgram::one_backward_reason() const {
  if (written_over_saved.empty())
    return "";
  std::string over;
  for (const auto &[out, in] : written_over_saved)
    over += (over.empty() ? "" : ", ") + out + " over " + in;
  return "backward: the forward that wrote this saved memory has had its backward already, and that backward "
         "wrote gradients over the activations it read (" +
         over +
         ": the schedule's gradients_over_saved(true)); run the forward again before another backward, or lower "
         "with gradients_over_saved(false) to keep them";
}

bool TrainingProgram::is_seed(const std::string &name) const { return contains(seeds, name); }

void TrainingProgram::check_ready_for_backward(bool forward_ran, const std::vector<bool> &uploaded) const {
  user_check(forward_ran) << "backward() before forward(): the backward reads the activations the forward keeps "
                          << "for it; run forward() first (again after upload() of new inputs or poison())";
  check_seeds_uploaded(uploaded);
}

const std::string &TrainingProgram::gradient_of(const std::string &name) const {
  for (size_t i = 0; i < of.size(); ++i)
    if (of[i] == name)
      return gradients[i];
  std::string known;
  for (const std::string &o : of)
    known += (known.empty() ? "" : ", ") + o;
  user_error << "no gradient for '" << name << "': the layer's output depends on " << known;
}

void TrainingProgram::check_seeds_uploaded(const std::vector<bool> &uploaded) const {
  internal_check(uploaded.size() == seeds.size()) << "one flag per seed";
  for (size_t k = 0; k < seeds.size(); ++k)
    user_check(uploaded[k]) << "backward() without the upstream gradient of output '" << outputs[k] << "' (input '"
                            << seeds[k] << "'): call upload_upstream_gradient(\"" << outputs[k]
                            << "\", ...) first (again after poison()); every output needs one, a 0-D loss's is "
                            << "usually a 0-D tensor holding 1.0";
}

TrainingProgram lower_training(const Pipeline &forward, const Func &output, const Schedule &schedule) {
  return lower_training(forward, std::vector<Func>{output}, schedule);
}

TrainingProgram lower_training(const Pipeline &forward, const std::vector<Func> &outputs, const Schedule &schedule) {
  TrainingAlgebra algebra = training_algebra(forward, outputs);
  KernelProgram p = lower_before_fusion(algebra.pipeline, schedule); // fused per part below
  std::vector<bool> fwd = forward_steps(p, algebra.outputs);

  std::vector<Step> f_steps, b_steps;
  std::map<std::string, size_t> producer; // forward tensor -> index in f_steps
  for (size_t i = 0; i < p.steps.size(); ++i) {
    if (fwd[i]) {
      if (std::string o = step_output(p.steps[i]); !o.empty())
        producer[o] = f_steps.size();
      f_steps.push_back(p.steps[i]);
    } else {
      b_steps.push_back(p.steps[i]);
    }
  }

  TrainingProgram t;
  t.outputs = algebra.outputs;
  t.seeds = algebra.seeds;
  t.output = algebra.output;
  t.seed = algebra.seed;
  t.gradients = algebra.gradients;
  t.of = algebra.of;
  // A Param stored inside a larger tensor has its gradient in the same
  // place of that tensor's gradient (transformers' gate_up_proj: one
  // gradient tensor holds both halves').
  for (size_t i = 0; i < t.of.size(); ++i)
    if (const TensorDecl *w = p.find(t.of[i]); w && w->outer_stride > 0)
      if (TensorDecl *g = p.find(t.gradients[i]))
        g->outer_stride = w->outer_stride;

  if (schedule.bf16_boundary())
    seeds_in_bf16(p, t);
  std::map<std::string, std::string> copies; // forward tensor -> the backward's copy (recompute)
  if (schedule.recompute()) {
    // Which forward tensors are cheap to make again: routed matrices from
    // element-wise steps, gathers, or GEMMs whose A is an input (or its gather).
    auto is_input = [&](const std::string &n) { return p.find(n) && p.find(n)->is_input; };
    std::function<bool(const std::string &)> cheap = [&](const std::string &n) -> bool {
      auto it = producer.find(n);
      const TensorDecl *d = p.find(n);
      if (it == producer.end() || !d || !d->route || d->dims.size() != 2)
        return false;
      const Step &s = f_steps[it->second];
      if (std::holds_alternative<GatherStep>(s) || std::holds_alternative<PointwiseStep>(s))
        return true;
      if (auto *g = std::get_if<GemmStep>(&s)) {
        if (is_input(g->a))
          return true;
        auto a = producer.find(g->a);
        return a != producer.end() && std::holds_alternative<GatherStep>(f_steps[a->second]) &&
               is_input(std::get<GatherStep>(f_steps[a->second]).src);
      }
      return false;
    };
    // Clone, dependencies first, every cheap forward tensor the backward
    // reads and the cheap forward tensors those clones read in turn.
    std::vector<Step> clones;
    std::function<void(const std::string &)> clone = [&](const std::string &n) {
      if (copies.count(n) || !cheap(n))
        return;
      Step s = f_steps[producer.at(n)];
      for (const std::string &r : step_reads(s))
        clone(r);
      rename_reads(s, copies);
      std::string copy = n + "_re";
      TensorDecl d = p.tensor(n);
      d.name = copy;
      p.tensors.push_back(d);
      set_output(s, copy);
      clones.push_back(std::move(s));
      copies[n] = copy;
      t.recomputed.push_back(n);
    };
    for (const Step &s : b_steps)
      for (const std::string &r : step_reads(s))
        if (producer.count(r))
          clone(r);
    for (Step &s : b_steps)
      rename_reads(s, copies);
    b_steps.insert(b_steps.begin(), clones.begin(), clones.end());
  }

  inline_elementwise_values(f_steps, b_steps, t.outputs);
  const size_t forward_count = f_steps.size();
  p.steps = std::move(f_steps);
  p.steps.insert(p.steps.end(), b_steps.begin(), b_steps.end());
  // The forward's element-wise steps move into its GEMMs' epilogues (the
  // SwiGLU product and activation beside the stored pre-activations). The
  // backward's stay separate kernels: they read several saved activations per
  // element, which in an epilogue are uncoalesced and not overlapped with the
  // main loop (H200: mixtral's d_h GEMM went from 3.3 to 7.2 ms fused, more
  // than the two kernels it replaced).
  // Sibling GEMMs first (SwiGLU's two projections, which autodiff made two
  // Funcs), so that their element-wise consumers see one epilogue.
  const size_t merged = merge_sibling_gemms(p, 0, forward_count);
  t.forward_steps = fuse_elementwise_consumers(p, 0, merged, schedule);
  if (schedule.gate_gradient_from_dh() && !gate_gradient_from_dh(p, t.forward_steps, schedule, copies))
    p.not_applied.push_back(
        "gate_gradient_from_dh(true) is not applied: the backward has no gate gradient <dy, o> of an expert "
        "contraction whose dH GEMM reads the weights transposed in place, as the wgmma loops do (mma(\"*\", "
        "wgmma_ws) or wgmma; mma_sync reads a transposed copy)");
  if (schedule.recompute_elementwise() && !schedule.recompute())
    recompute_epilogue_values(p, t.forward_steps, t.outputs);
  // After gate_gradient_from_dh, which may leave the combine the expert
  // outputs' only reader.
  bool combined_atomically = false; // in the forward or the backward
  if (schedule.atomic_combine()) {
    const size_t before = t.forward_steps;
    t.forward_steps = fuse_atomic_combines(p, 0, t.forward_steps);
    combined_atomically = t.forward_steps != before;
  }
  merge_sibling_pointwise(p, t.forward_steps, p.steps.size(), schedule);
  if (schedule.bf16_activations())
    store_in_bf16(p, t);
  if (schedule.bf16_weight_gradients())
    for (const Step &s : p.steps)
      if (auto *g = std::get_if<GemmStep>(&s); g && g->expert_k && contains(t.gradients, g->output))
        p.find(g->output)->dtype = DType::bf16;
  if (schedule.chain_summed_gemms())
    chain_summed_gemms(p, t.forward_steps);
  // The backward's combine too, once chain_summed_gemms has made its input
  // gradient's expert products one GEMM: the sum over each token's pairs
  // (T k x d, the largest tensor of its workspace) and the router's share.
  if (schedule.atomic_combine() || schedule.atomic_input_gradient()) {
    const size_t before = p.steps.size();
    combined_atomically |= fuse_atomic_combines(p, t.forward_steps, p.steps.size()) != before;
    if (schedule.atomic_combine() && !combined_atomically)
      p.not_applied.push_back(kAtomicCombineNotApplied);
  }
  if (schedule.bf16_boundary())
    boundary_in_bf16(p, t, forward);
  // After the fusions: which GEMM writes a saved tensor, and whether one
  // reads it, is then final.
  // Under gradients_over_saved a saved tensor keeps the padded order until
  // the in-place marks show whether a gradient (padded) takes its bytes.
  p.gradients_over_saved = schedule.gradients_over_saved();
  const std::vector<std::string> pair_order =
      save_in_pair_order(p, t.forward_steps, [&](const std::string &) { return !p.gradients_over_saved; });
  backward_rows_in_pair_order(p, t.forward_steps);
  // An attention's forward and backward steps, once the row layouts they
  // read are final.
  t.forward_steps = fuse_attention_training(
      p, t.forward_steps, schedule,
      [&](const std::string &name) -> std::string {
        for (size_t k = 0; k < t.outputs.size(); ++k)
          if (t.outputs[k] == name) // another output reading it would make its gradient "<seed>_total"
            return p.find(t.seeds[k] + "_total") ? "" : t.seeds[k];
        for (size_t i = 0; i < t.of.size(); ++i)
          if (t.of[i] == name)
            return t.gradients[i];
        return p.find(name) && !p.tensor(name).is_input ? "d_" + name : "";
      },
      copies);
  // Last: every fusion above has decided which steps exist. What the caller
  // holds (outputs, gradients) and what the forward wrote (kept for the
  // backward anyway) live through the whole backward whatever its order.
  std::vector<std::string> held = p.outputs;
  held.insert(held.end(), t.gradients.begin(), t.gradients.end());
  for (size_t i = 0; i < t.forward_steps; ++i)
    for (const std::string &o : step_outputs(p.steps[i]))
      held.push_back(o);
  pad_dynamic_rows(p); // the tensors the passes above added, before memory is planned
  order_steps_for_memory(p, t.forward_steps, p.steps.size(), held);
  if (schedule.split_pointwise_for_memory())
    split_pointwise_for_memory(p, t.forward_steps, held);
  mark_in_place_outputs(p, t.forward_steps);
  t.written_over_saved = written_over_saved(p, t.forward_steps);
  if (p.gradients_over_saved && !pair_order.empty()) {
    std::set<std::string> taken;
    for (const auto &[out, in] : t.written_over_saved)
      taken.insert(in);
    save_in_pair_order(p, t.forward_steps, [&](const std::string &name) { return !taken.count(name); });
    if (schedule.sorted_saved()) {
      store_saved_sorted(p, t.forward_steps, t.written_over_saved);
      if (schedule.sorted_gathers())
        store_gathers_sorted(p);
    }
  }
  // After the row layouts: the merged reductions' B operands must be
  // stored alike, and store_gathers_sorted reads single-B reductions.
  if (schedule.merge_weight_gradients())
    merge_weight_gradients(p, t.forward_steps, p.steps.size());
  std::set<std::string> forward_written; // the forward's passes may have added tensors (an attention's lse)
  for (size_t i = 0; i < t.forward_steps; ++i)
    for (const std::string &o : step_outputs(p.steps[i]))
      forward_written.insert(o);
  for (size_t i = t.forward_steps; i < p.steps.size(); ++i)
    for (const std::string &r : step_reads(p.steps[i]))
      if (forward_written.count(r) && !contains(t.saved, r))
        t.saved.push_back(r);
  plan_gemms(p); // last: of the steps as they are
  t.program = std::move(p);
  return t;
}

} // namespace moeforge
