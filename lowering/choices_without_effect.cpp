#include "lowering/choices_without_effect.h"

#include <functional>
#include <sstream>

#include "dsl/error.h"
#include "lowering/gemm_plan.h"
#include "lowering/lower.h"
#include "lowering/training.h"

namespace moeforge {

namespace {

// Which lowering reads a choice: the other ignores it by design.
enum class ReadBy { both, forward, training };

struct LayerChoice {
  std::string call;                     // as the schedule's text writes it
  bool made;                            // the schedule made it
  std::function<void(Schedule &)> undo; // the schedule without it
  std::string why;                      // why a layer may give it nothing to act on
  ReadBy read_by;
};

// The layer-wide choices of s that leave the program as it is without them:
// `made` is the program under s as program_text(s) would print it.
std::vector<std::string> choices_without_effect(const Schedule &s, const std::string &made,
                                                const std::function<std::string(const Schedule &)> &program_text,
                                                bool training) {
  const bool blocked = s.permutation() == Permutation::blocked;
  const std::vector<LayerChoice> choices = {
      {"padded_elementwise(true)", s.padded_elementwise(), [](Schedule &x) { x.padded_elementwise(false); },
       blocked ? "the blocked permutation keeps every per-pair tensor in the padded order already"
               : "no per-pair tensor of this layer changes its row order with it",
       ReadBy::both},
      // A training step's backward reads the expert GEMM's output ungated
      // (the gate's gradient), so there the gate stays in the combine
      // whatever gate() says (GateFusion): a forward-only choice.
      {"gate(epilogue)", s.gate() == GateFusion::epilogue, [](Schedule &x) { x.gate(GateFusion::combine); },
       s.atomic_combine() ? "atomic_combine(true) moves the whole gated combine into the expert GEMM's epilogue "
                            "wherever the gate multiplies"
                          : "this layer has no combine of a gate times an expert GEMM's output, which is what moves "
                            "into that GEMM's epilogue",
       ReadBy::forward},
      {"bf16_activations(true)", s.bf16_activations(), [](Schedule &x) { x.bf16_activations(false); },
       "the backward keeps no f32 activation of this layer", ReadBy::training},
      {"bf16_weight_gradients(true)", s.bf16_weight_gradients(), [](Schedule &x) { x.bf16_weight_gradients(false); },
       "this layer computes no expert weight's gradient", ReadBy::training},
      {"chain_summed_gemms(true)", s.chain_summed_gemms(), [](Schedule &x) { x.chain_summed_gemms(false); },
       "the backward has no two GEMMs whose outputs are only added together through one combine (SwiGLU's and "
       "GeGLU's input gradients are)",
       ReadBy::training},
      {"gather_in_gemms(true)", s.gather_in_gemms(), [](Schedule &x) { x.gather_in_gemms(false); },
       s.padded_elementwise() ? "the backward copies no token rows into the padded order for a GEMM"
                              : "without padded_elementwise(true) the GEMMs gather token rows themselves already",
       ReadBy::training},
      {"gather_upstream_in_gemms(true)", s.gather_upstream_in_gemms(),
       [](Schedule &x) { x.gather_upstream_in_gemms(false); },
       s.gather_in_gemms()      ? "gather_in_gemms(true) gathers the upstream gradient's rows in the GEMMs already"
       : s.padded_elementwise() ? "the backward copies no upstream gradient's rows into the padded order for a GEMM"
                                : "without padded_elementwise(true) the GEMMs gather token rows themselves already",
       ReadBy::training},
      {"atomic_input_gradient(true)", s.atomic_input_gradient(), [](Schedule &x) { x.atomic_input_gradient(false); },
       s.atomic_combine() ? "atomic_combine(true) adds the input gradient up atomically already"
                          : "the backward sums no input gradient over k > 1 pairs of an expert GEMM whose "
                            "epilogue could add them (a k = 1 layer stores each token's row directly)",
       ReadBy::training},
      {"bf16_boundary(true)", s.bf16_boundary(), [](Schedule &x) { x.bf16_boundary(false); },
       "the layer's outputs, their upstream gradients and its inputs' gradients are scalars, bf16 already or summed "
       "by atomic adds (atomic_combine)",
       ReadBy::both},
      {"split_pointwise_for_memory(true)", s.split_pointwise_for_memory(),
       [](Schedule &x) { x.split_pointwise_for_memory(false); },
       "no element-wise output of the backward lowers its peak as a kernel of its own", ReadBy::training},
      {"gradients_over_saved(true)", s.gradients_over_saved(), [](Schedule &x) { x.gradients_over_saved(false); },
       "no element-wise step of the backward is the last reader of a saved tensor shaped like its output",
       ReadBy::training},
      {"sorted_saved(true)", s.sorted_saved(), [](Schedule &x) { x.sorted_saved(false); },
       s.gradients_over_saved() ? "no saved tensor that a gradient is written over is read only as sorted rows may be "
                                  "(lowering/sorted_rows.h), or none is padded"
                                : "without gradients_over_saved(true) the saved tensors are in pair order already",
       ReadBy::training},
      {"sorted_gathers(true)", s.sorted_gathers(), [](Schedule &x) { x.sorted_gathers(false); },
       s.sorted_saved() ? "no gathered copy is read only by weight gradients whose other operand is stored sorted "
                          "(lowering/sorted_rows.h)"
                        : "without sorted_saved(true) no weight gradient's other operand is stored sorted",
       ReadBy::training},
      {"merge_weight_gradients(true)", s.merge_weight_gradients(), [](Schedule &x) { x.merge_weight_gradients(false); },
       "no two weight gradients reduce the same A over the same rows with B operands stored alike, in the "
       "warp-specialised loop with TMA loads",
       ReadBy::training},
      {"recompute_elementwise(true)", s.recompute_elementwise(), [](Schedule &x) { x.recompute_elementwise(false); },
       s.recompute() ? "recompute(true) recomputes the whole forward already"
                     : "the forward saves no element-wise result that the backward could make again",
       ReadBy::training},
  };
  const ReadBy ignored = training ? ReadBy::forward : ReadBy::training;
  std::vector<std::string> notes;
  for (const LayerChoice &c : choices) {
    if (!c.made || c.read_by == ignored)
      continue;
    Schedule without = s;
    c.undo(without);
    try {
      if (program_text(without) == made)
        notes.push_back(c.call + " is not applied: it changes nothing in this layer's program: " + c.why);
    } catch (const UserError &) {
      // Without the choice the schedule is not a legal one: it mattered.
    }
  }
  return notes;
}

// The training step as text: its program, and what the forward keeps for
// the backward or leaves for it to make again (the memory choices move
// tensors between those lists).
std::string training_text(const TrainingProgram &t) {
  std::ostringstream o;
  o << t.program << "forward steps " << t.forward_steps << "\nsaved";
  for (const std::string &n : t.saved)
    o << " " << n;
  o << "\nrecomputed";
  for (const std::string &n : t.recomputed)
    o << " " << n;
  return o.str();
}

std::string forward_text(const KernelProgram &p) {
  std::ostringstream o;
  o << p;
  return o.str();
}

} // namespace

std::vector<std::string> choices_not_taken(const Pipeline &pipeline, const Schedule &layer_schedule,
                                           const std::vector<Func> &training_outputs) {
  const Schedule schedule = layer_schedule.on_one_rank();
  const bool training = !training_outputs.empty();
  std::vector<std::string> notes, idle;
  if (training) {
    const TrainingProgram t = lower_training(pipeline, training_outputs, schedule);
    notes = not_applied_choices(t.program);
    idle = choices_without_effect(
        schedule, training_text(t),
        [&](const Schedule &s) { return training_text(lower_training(pipeline, training_outputs, s)); }, true);
  } else {
    const KernelProgram p = lower(pipeline, schedule);
    notes = not_applied_choices(p);
    idle = choices_without_effect(
        schedule, forward_text(p), [&](const Schedule &s) { return forward_text(lower(pipeline, s)); }, false);
  }
  notes.insert(notes.end(), idle.begin(), idle.end());
  return notes;
}

} // namespace moeforge
