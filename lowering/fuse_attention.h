// fuse_attention: an attention between two contractions over the tokens,
//   p(r, u) = softmax(u, c * sum(j, q(r, j) * key(u, j)))
//   z(r, c') = sum(u, p(r, u) * value(u, c'))
// lowered as a GEMM over a run-time column count (the scores), a row
// softmax and a GEMM over a run-time reduction, becomes one AttentionStep
// that takes the softmax online and never stores the scores (a pairs x T
// f32 tensor: 4 GiB at T = 16384 with 32768 rows).
//
// It applies where the scores and p are read by nothing else (in training,
// nothing but the backward's steps from them), q's and z's rows are dense
// or one route's (pair order or padded, not necessarily alike), and key and
// value are dense rows over the tokens; elsewhere the three steps stay, and
// Schedule::fused_attention(true) is reported as not applied.
#pragma once

#include <functional>
#include <map>
#include <string>

#include "lowering/kernel_program.h"
#include "schedules/schedule.h"

namespace moeforge {

// A forward program (lower()).
KernelProgram fuse_attention(KernelProgram p, const Schedule &schedule);

// A training program (lower_training), steps [0, forward_steps) its
// forward: the forward's attention as above, writing each row's
// log-sum-exp beside z, and the backward's steps from p and z's gradient to
// q's, key's and value's gradients (every step on a path between them:
// p's transpose, d_p = d_z value^T, the softmax's gradient, the three
// GEMMs) as two AttentionSteps, query_gradient and key_gradient, that make
// p again from the log-sum-exp, so the probabilities are not stored either.
// It applies only where those steps read nothing but p, z's gradient, q,
// key and value (or the backward's recomputed copies of them, `copies`)
// and nothing outside them reads what they write but the three gradients;
// their values are then the attention's gradients whatever the steps are,
// because autodiff made them as such. `gradient` names a forward tensor's
// gradient tensor ("" where it has none). Returns the new forward step
// count.
size_t fuse_attention_training(KernelProgram &p, size_t forward_steps, const Schedule &schedule,
                               const std::function<std::string(const std::string &)> &gradient,
                               const std::map<std::string, std::string> &copies);

// The note a schedule's fused_attention(true) gets where no attention fuses.
extern const char *const kFusedAttentionNotApplied;

} // namespace moeforge
