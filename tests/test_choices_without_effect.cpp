// Layer-wide choices a layer gives nothing to act on are said, with why
// (lowering/choices_without_effect.h), for the forward and the training
// step, after the GEMM plans' notes; choices that change the program are not.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "examples/examples.h"
#include "lowering/choices_without_effect.h"
#include "lowering/lower.h"
#include "schedules/presets.h"

using namespace moeforge;

namespace {

const ExampleShape kShape{96, 8, 2, 64, 128};

std::vector<std::string> forward_notes(const std::string &example, const Schedule &s) {
  return choices_not_taken(make_example(example, kShape).pipeline, s);
}

std::vector<std::string> training_notes(const std::string &example, const Schedule &s) {
  Example ex = make_example(example, kShape);
  return choices_not_taken(ex.pipeline, s, {ex.pipeline.func(ex.output)});
}

// The note about `call`, or "" when there is none.
std::string note_on(const std::vector<std::string> &notes, const std::string &call) {
  for (const std::string &n : notes)
    if (n.rfind(call + " is not applied: ", 0) == 0)
      return n;
  return "";
}

} // namespace

TEST_CASE("choices without effect: padded_elementwise under the blocked permutation is said, not when it acts") {
  Schedule blocked = preset("megablocks");
  blocked.padded_elementwise(true);
  CHECK(note_on(forward_notes("swiglu_moe", blocked), "padded_elementwise(true)") ==
        "padded_elementwise(true) is not applied: it changes nothing in this layer's program: the blocked "
        "permutation keeps every per-pair tensor in the padded order already");
  // Scattered rows: the combine's input moves to the padded order.
  Schedule scattered = preset("scattermoe");
  scattered.padded_elementwise(true);
  CHECK(note_on(forward_notes("swiglu_moe", scattered), "padded_elementwise(true)").empty());
  CHECK(note_on(training_notes("swiglu_moe", scattered), "padded_elementwise(true)").empty());
  // After the GEMM plans' notes. The program itself does not carry it:
  // compiling and tuning lower a schedule once and never pay for the check.
  Schedule both = blocked;
  both.tma("h", false).tma_store("h", true);
  const std::vector<std::string> notes = forward_notes("moe_mlp", both);
  REQUIRE(notes.size() == 2);
  CHECK(notes[0].rfind("definition 'h': tma_store(\"h\", true) is not applied: ", 0) == 0);
  CHECK(notes[1].rfind("padded_elementwise(true) is not applied: ", 0) == 0);
  Example ex = make_example("moe_mlp", kShape);
  CHECK(lower(ex.pipeline, both).not_applied.empty());
  // Experts spread over ranks: the unsplit layer's notes (lower() itself
  // refuses expert_parallel).
  Schedule spread = blocked;
  spread.expert_parallel(2);
  CHECK(note_on(forward_notes("swiglu_moe", spread), "padded_elementwise(true)") ==
        note_on(forward_notes("swiglu_moe", blocked), "padded_elementwise(true)"));
  CHECK_FALSE(note_on(forward_notes("swiglu_moe", spread), "padded_elementwise(true)").empty());
}

TEST_CASE(
    "choices without effect: the gate in the epilogue of a layer without a gated combine, or beside atomic_combine") {
  Schedule s = preset("scattermoe");
  REQUIRE(s.gate() == GateFusion::epilogue);
  // A routed layer's forward takes it.
  CHECK(note_on(forward_notes("swiglu_moe", s), "gate(epilogue)").empty());
  // A dense MLP has no combine at all.
  CHECK(note_on(forward_notes("dense_mlp", s), "gate(epilogue)") ==
        "gate(epilogue) is not applied: it changes nothing in this layer's program: this layer has no combine of a "
        "gate times an expert GEMM's output, which is what moves into that GEMM's epilogue");
  // A training step keeps the gate in the combine by design (its backward
  // reads o ungated): a forward's choice, not said there.
  CHECK(note_on(training_notes("swiglu_moe", s), "gate(epilogue)").empty());
  // Beside atomic_combine the gate's place is moot: the whole gated combine
  // goes into o's epilogue either way.
  Schedule atomic = s;
  atomic.atomic_combine(true);
  CHECK(note_on(forward_notes("swiglu_moe", atomic), "gate(epilogue)") ==
        "gate(epilogue) is not applied: it changes nothing in this layer's program: atomic_combine(true) moves the "
        "whole gated combine into the expert GEMM's epilogue wherever the gate multiplies");
}

TEST_CASE("choices without effect: training-only choices, said in training and not in a forward") {
  Schedule s = preset("scattermoe");
  s.chain_summed_gemms(true);
  // GeLU's input gradient is one GEMM: nothing to chain.
  CHECK(note_on(training_notes("moe_mlp", s), "chain_summed_gemms(true)") ==
        "chain_summed_gemms(true) is not applied: it changes nothing in this layer's program: the backward has no "
        "two GEMMs whose outputs are only added together through one combine (SwiGLU's and GeGLU's input gradients "
        "are)");
  CHECK(note_on(training_notes("swiglu_moe", s), "chain_summed_gemms(true)").empty());
  // A forward never reads it: nothing said there.
  CHECK(note_on(forward_notes("moe_mlp", s), "chain_summed_gemms(true)").empty());

  // recompute(true) already makes the whole forward again.
  Schedule lean = preset("scattermoe");
  lean.recompute_elementwise(true);
  CHECK(note_on(training_notes("swiglu_moe", lean), "recompute_elementwise(true)").empty());
  lean.recompute(true);
  CHECK(note_on(training_notes("swiglu_moe", lean), "recompute_elementwise(true)") ==
        "recompute_elementwise(true) is not applied: it changes nothing in this layer's program: recompute(true) "
        "recomputes the whole forward already");

  // bf16 activations and weight gradients act on a routed layer.
  Schedule bf16 = preset("scattermoe");
  bf16.bf16_activations(true).bf16_weight_gradients(true);
  const std::vector<std::string> notes = training_notes("swiglu_moe", bf16);
  CHECK(note_on(notes, "bf16_activations(true)").empty());
  CHECK(note_on(notes, "bf16_weight_gradients(true)").empty());
}
