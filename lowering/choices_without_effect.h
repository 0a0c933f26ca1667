// Layer-wide choices a layer gives nothing to act on. Without a note such a
// choice runs as if it were absent, unseen: padded_elementwise under the
// blocked permutation (whose per-pair tensors are padded already),
// chain_summed_gemms on a GeLU layer (no two GEMMs summed), a gate in the
// epilogue of a layer without a gated combine. Each such choice the
// schedule made is lowered again without it; where the program comes out
// the same, a note says so and why. KernelProgram::not_applied carries the
// notes and every command prints them (not_applied_choices).
// atomic_combine and gate_gradient_from_dh say so from their own passes,
// with the reason those found.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "schedules/schedule.h"

namespace moeforge {

// `program_text(s)`: the program lowered under s, as text (everything the
// choices can change). `training`: the lowering is a training step's, which
// reads the training-only choices (a forward ignores them by design) and
// keeps the gate in the combine whatever gate() says (its backward reads
// the expert outputs ungated), so gate() is a forward's choice.
std::vector<std::string> choices_without_effect(const Schedule &schedule,
                                                const std::function<std::string(const Schedule &)> &program_text,
                                                bool training);

} // namespace moeforge
