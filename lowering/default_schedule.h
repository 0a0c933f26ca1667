// The schedule a layer runs when its user names none (MoELayer without a
// schedule, the CLI's --schedule auto with nothing tuned): the fastest
// hand-written training schedule measured, bench_moe_train's tuned_wide in
// its lean memory mode (benchmarks/schedules/train/tuned_wide_*.sched say
// what each choice is for), with its per-Func choices made by rule from
// what each GEMM of *this* layer is, so that any layer gets them, not only
// Funcs of the benchmark's names:
//   every contraction  128 x 256 x 64 tiles, four stages, warp-specialised
//                      wgmma fed by TMA, element-wise work in the epilogue
//   the router         (the dense GEMM whose output the routing selects by,
//                      directly or through its softmax) 128 x 64: its N is E
//   two B operands     (SwiGLU's gate and up projections) 128 x 128 each:
//                      128 accumulator registers a thread is all wgmma
//                      leaves room for
//   an expert          (a weight gradient: a sum over one expert's rows)
//   reduction          persistent blocks, tiles stored by TMA
//   a routed GEMM with one B operand that stores two results (GeLU's
//                      pre-activation and h) persistent with TMA stores
// and layer-wide: ScatterMoE's routing in blocks of 128, the gate in the
// epilogue, bf16 activations and weight gradients, per-pair results in the
// padded row order, memory shared by lifetime (in a training step; a
// forward alone keeps every Func readable), and the lean memory mode
// (the backward makes the activation's output again from the stored
// pre-activation, and the gate's gradient from dH, so the expert outputs
// are not kept), with the backward's GEMMs gathering dy's rows themselves
// (no T k x d copy; dW2 still walks persistently, its B by cp.async: on an
// H200 the 8-layer stacks of the four training shapes within -2.6..+0.9 %
// of the copy's step time, 0.09-0.24 GiB lower). A layer-wide choice this layer gives nothing to act on is
// left out, so the default never draws a "not applied" note.
#pragma once

#include <vector>

#include "dsl/pipeline.h"
#include "schedules/schedule.h"

namespace moeforge {

// For the training step of `outputs` (its backward's GEMMs get the rules
// too), or with no outputs, the forward alone.
Schedule default_schedule(const Pipeline &pipeline, const std::vector<Func> &outputs = {});

} // namespace moeforge
