#include "lowering/default_schedule.h"

#include <algorithm>
#include <set>

#include "lowering/choices_without_effect.h"
#include "lowering/lower.h"
#include "lowering/training.h"

namespace moeforge {

namespace {

// The layer-wide part, and the tiles every contraction starts from.
Schedule layer_wide() {
  Schedule s("default");
  s.permutation(Permutation::scattered)
      .block(128)
      .gate(GateFusion::epilogue)
      .tile(Schedule::all_funcs, 128, 256, 64)
      .stages(Schedule::all_funcs, 4)
      .warps(Schedule::all_funcs, 8, 1)
      .mma(Schedule::all_funcs, MmaKind::wgmma_ws)
      .tma(Schedule::all_funcs, true)
      .fuse_epilogue(Schedule::all_funcs, true)
      .bf16_activations(true)
      .reuse_memory(true)
      .bf16_weight_gradients(true)
      .padded_elementwise(true)
      .recompute_elementwise(true)
      .gate_gradient_from_dh(true)
      .chain_summed_gemms(true)
      .split_pointwise_for_memory(true)
      .gradients_over_saved(true)
      .sorted_saved(true)
      .sorted_gathers(true)
      .merge_weight_gradients(true)
      .gather_upstream_in_gemms(true)
      .bf16_boundary(true);
  return s;
}

// The tensors a routing selects by, and those each is computed from in one
// element-wise step (the router's logits before its softmax).
std::set<std::string> router_outputs(const KernelProgram &p) {
  std::set<std::string> scores;
  for (const Step &s : p.steps)
    if (const auto *r = std::get_if<RoutingStep>(&s))
      scores.insert(r->probs);
  std::set<std::string> out = scores;
  for (const Step &s : p.steps)
    if (std::holds_alternative<PointwiseStep>(s) && scores.count(step_output(s)))
      for (const std::string &read : step_reads(s))
        out.insert(read);
  return out;
}

// Leaves out each layer-wide choice the layer does not take: the notes
// name the primitive ("padded_elementwise(true) is not applied: ...").
void drop_choices_not_taken(Schedule &s, const Pipeline &pipeline, const std::vector<Func> &outputs) {
  for (const std::string &note : choices_not_taken(pipeline, s, outputs)) {
    auto names = [&](const char *primitive) { return note.rfind(primitive, 0) == 0; };
    if (names("padded_elementwise("))
      s.padded_elementwise(false);
    else if (names("recompute_elementwise("))
      s.recompute_elementwise(false);
    else if (names("gate_gradient_from_dh("))
      s.gate_gradient_from_dh(false);
    else if (names("chain_summed_gemms("))
      s.chain_summed_gemms(false);
    else if (names("split_pointwise_for_memory("))
      s.split_pointwise_for_memory(false);
    else if (names("gradients_over_saved("))
      s.gradients_over_saved(false);
    else if (names("sorted_saved("))
      s.sorted_saved(false);
    else if (names("sorted_gathers("))
      s.sorted_gathers(false);
    else if (names("merge_weight_gradients("))
      s.merge_weight_gradients(false);
    else if (names("atomic_input_gradient("))
      s.atomic_input_gradient(false);
    else if (names("gather_upstream_in_gemms("))
      s.gather_upstream_in_gemms(false);
    else if (names("bf16_boundary("))
      s.bf16_boundary(false);
    else if (names("gate("))
      s.gate(GateFusion::combine);
  }
}

// Takes back each per-Func choice a GEMM's plan does not take (its note:
// "definition 'o': tma_store(\"o\", true) is not applied: ..."): the
// program is the same without it, and the user sees no note.
void drop_func_choices_not_taken(Schedule &s, const Pipeline &pipeline, const std::vector<Func> &outputs) {
  for (const std::string &note : choices_not_taken(pipeline, s, outputs))
    for (const char *primitive : {"tma_store", "persistent"}) {
      const std::string call = std::string(": ") + primitive + "(\"";
      const size_t at = note.find(call);
      if (at == std::string::npos)
        continue;
      const size_t from = at + call.size(), to = note.find('"', from);
      const std::string func = note.substr(from, to - from);
      if (std::string(primitive) == "tma_store")
        s.tma_store(func, false);
      else
        s.persistent(func, false);
    }
}

} // namespace

Schedule default_schedule(const Pipeline &pipeline, const std::vector<Func> &outputs) {
  Schedule s = layer_wide();
  // A forward alone keeps each intermediate in memory of its own, so that
  // every Func can be read back (`moeforge run --check`); a training step's
  // intermediates share memory by lifetime, and only its outputs and
  // gradients are read.
  if (outputs.empty())
    s.reuse_memory(false);
  drop_choices_not_taken(s, pipeline, outputs);
  // What each GEMM is, read off the program under the anchors' 128 x 128
  // tiles: lowering makes two GEMMs over the same rows one GEMM of two B
  // operands only where their tiles fit that, as 128 x 256 would not.
  // Weight gradients unmerged, so that each Func's GEMM is its own step
  // (the merged dW1 + dW3 would read as one GEMM of two B operands, named
  // by d_w1 alone).
  Schedule probe = s;
  probe.tile(Schedule::all_funcs, 128, 128, 64).merge_weight_gradients(false);
  KernelProgram p;
  size_t forward_steps = 0;
  if (outputs.empty()) {
    p = lower(pipeline, probe);
    forward_steps = p.steps.size();
  } else {
    TrainingProgram t = lower_training(pipeline, outputs, probe);
    forward_steps = t.forward_steps;
    p = std::move(t.program);
  }
  const std::set<std::string> router = router_outputs(p);
  auto routed = [](const GemmStep &g) { return g.route && !g.expert_k; };
  // The down-projection's weight: the B of the forward's last routed GEMM
  // of one B (the GEMM whose rows the combine sums).
  std::string down;
  for (size_t i = 0; i < forward_steps; ++i)
    if (const auto *g = std::get_if<GemmStep>(&p.steps[i]); g && routed(*g) && g->b.size() == 1)
      down = g->b[0];
  for (const Step &step : p.steps) {
    const auto *g = std::get_if<GemmStep>(&step);
    if (!g || g->func.empty())
      continue;
    if (!g->route && router.count(g->output))
      s.tile(g->func, 128, 64, 64);
    else if (g->b.size() == 2)
      s.tile(g->func, 128, 128, 64);
    else if (g->expert_k || (routed(*g) && g->b[0] == down) || (routed(*g) && g->extra.size() == 1))
      s.persistent(g->func, true).tma_store(g->func, true);
  }
  drop_func_choices_not_taken(s, pipeline, outputs);
  // sorted_saved needs the saved tensors' GEMM to store them row by row,
  // which the per-Func choices above decide (GeLU's pre-activation leaves
  // with h by TMA): kept where the program then has a sorted tensor.
  if (s.sorted_saved() && !outputs.empty()) {
    const TrainingProgram t = lower_training(pipeline, outputs, s);
    const auto &ts = t.program.tensors;
    if (std::none_of(ts.begin(), ts.end(), [](const TensorDecl &d) { return d.layout == RowLayout::sorted; }))
      s.sorted_saved(false).sorted_gathers(false); // sorted_gathers sorts only beside sorted_saved's tensors
  }
  return s;
}

} // namespace moeforge
