// Choices a schedule made that a layer's program does not take, as every
// command says them before it runs (the CLI's `note` lines, Python's
// moeforge.not_applied and MoELayer's warnings).
//
// Besides the GEMM plans' notes (not_applied_choices), the layer-wide
// choices the layer gives nothing to act on: without a note such a choice
// runs as if it were absent, unseen (padded_elementwise under the blocked
// permutation, whose per-pair tensors are padded already; chain_summed_gemms
// on a GeLU layer, with no two GEMMs summed; a gate in the epilogue of a
// layer without a gated combine). Each such choice the schedule made is
// lowered again without it; where the program comes out the same, a note
// says so and why. Only here, where notes are asked for: compiling and
// tuning lower a schedule once. atomic_combine and gate_gradient_from_dh
// say so from their own passes (KernelProgram::not_applied), with the
// reason those found.
#pragma once

#include <string>
#include <vector>

#include "dsl/pipeline.h"
#include "schedules/schedule.h"

namespace moeforge {

// The notes of the forward's program under `schedule` (the unsplit layer's
// where the experts spread over ranks: each side has its own program), or with
// `training_outputs`, the training step's (forward and backward of those
// Funcs). A training step reads the training-only choices (a forward
// ignores them by design) and keeps the gate in the combine whatever gate()
// says (its backward reads the expert outputs ungated), so gate() is a
// forward's choice.
std::vector<std::string> choices_not_taken(const Pipeline &pipeline, const Schedule &schedule,
                                           const std::vector<Func> &training_outputs = {});

} // namespace moeforge
