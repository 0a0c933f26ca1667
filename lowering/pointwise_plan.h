// How one element-wise step runs on the CUDA target (sm_90a): how its
// threads walk the elements, how many consecutive elements each takes, and
// whether it walks the padded order's row slots; resolved before any code
// is printed, with the user errors for what the target cannot run. The
// companion of gemm_plan.h for PointwiseStep; it needs no CUDA, so tests
// check it anywhere.
#pragma once

#include "lowering/kernel_program.h"

namespace moeforge {

// Who computes an element.
enum class ElementWalk {
  thread,       // a thread per element (per_thread consecutive ones)
  warp,         // a warp per element: a long reduction split over its lanes, or a softmax's row
  block,        // a block per element: few elements, each a long reduction
  warp_per_row, // a warp per row whose row sums ride along (PointwiseStep's row_sum outputs)
};

struct PointwisePlan {
  ElementWalk walk = ElementWalk::thread;
  // Consecutive elements of the innermost index a thread (a lane, with
  // warp_per_row) takes: 8 when the index is a static multiple of eight and
  // every output can take 16-byte stores, else 1.
  int per_thread = 1;
  // A [pairs, n] result stored in the padded order (padded_elementwise): the
  // grid walks row slots q < max(P, max_padded_rows), slot q computes pair q
  // and zeroes padded row q where that is padding.
  bool padded_rows = false;
};

// s's plan; a user error where the CUDA target cannot run s (a row sum over
// a run-time row length; a padded-order result that is a reduction or has
// a run-time row length).
PointwisePlan plan_pointwise(const KernelProgram &prog, const PointwiseStep &s);

// Whether s's [pairs, n] result can be made in the padded order: a thread
// per element walking its row slots, so a value over a static row length,
// not a softmax or a long reduction (whose warps walk the pairs). Lowering
// leaves the others in pair order; plan_pointwise refuses them padded.
bool padded_order_serves(const PointwiseStep &s);

// Whether e holds a reduction long enough to split over a warp's lanes (a
// sum over a run-time extent, or over 64 or more).
bool has_long_reduction(const Expr &e);
// Whether e sums over the pairs of a token or an expert indexed by v (the
// loop bounds would then differ between a thread's consecutive elements).
bool sums_over_routes_of(const Expr &e, const Var &v);

} // namespace moeforge
