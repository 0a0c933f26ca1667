// fuse_attention: an attention between two contractions over the tokens,
//   p(r, u) = softmax(u, c * sum(j, q(r, j) * key(u, j)))
//   z(r, c') = sum(u, p(r, u) * value(u, c'))
// lowered as a GEMM over a run-time column count (the scores), a row
// softmax and a GEMM over a run-time reduction, becomes one AttentionStep
// that takes the softmax online and never stores the scores (a pairs x T
// f32 tensor: 4 GiB at T = 16384 with 32768 rows).
//
// Forward programs only (lower()): a training backward reads p. It applies
// where the scores and p are read by nothing else, q and z share their row
// layout, and key and value are dense rows over the tokens; elsewhere the
// three steps stay, and Schedule::fused_attention(true) is reported as not
// applied.
#pragma once

#include "lowering/kernel_program.h"
#include "schedules/schedule.h"

namespace moeforge {

KernelProgram fuse_attention(KernelProgram p, const Schedule &schedule);

// The note a schedule's fused_attention(true) gets where no attention fuses.
extern const char *const kFusedAttentionNotApplied;

} // namespace moeforge
