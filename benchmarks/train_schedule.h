// The training benchmark's widest schedule, shared with the GPU test that
// checks it, so that what is timed is what is tested.
#pragma once

#include <string>

#include "schedules/presets.h"

namespace moeforge::bench {

// ScatterMoE's routing with warp-specialised wgmma and 128 x 256 tiles for
// every single-B GEMM, the backward's included; SwiGLU's two-B forward GEMM
// (h) stays at 128 columns per B, since 128 accumulator registers per
// thread is all wgmma leaves room for. The pre-activations and the
// backward's per-pair gradients in bf16 (bf16_activations), and tensors
// sharing memory by lifetime (reuse_memory), the expert weights' gradients
// in bf16 (bf16_weight_gradients), and the element-wise results GEMMs read
// in the padded row order (padded_elementwise), which those GEMMs and the
// expert reductions load by TMA.
inline Schedule tuned_wide(bool swiglu) {
  Schedule t = scattermoe();
  t.bf16_activations(true).reuse_memory(true).bf16_weight_gradients(true).padded_elementwise(true);
  t.mma("*", MmaKind::wgmma_ws).tile("*", 128, 256, 64).tile("logits", 128, 64, 64);
  if (swiglu)
    t.tile("h", 128, 128, 64);
  // The expert reductions (the expert weights' gradients) in persistent
  // blocks: their K is one expert's rows, short enough that filling the
  // pipeline and storing the tile cost a tenth of a block per tile.
  // Their tiles leave by TMA from a staging buffer past the ring, so the
  // consumers go on to the next tile's main loop instead of waiting on their
  // stores.
  for (const char *g : {"d_w1", "d_w2", "d_w3"})
    if (swiglu || std::string(g) != "d_w3")
      t.persistent(g, true).tma_store(g, true);
  // The same for the down-projection and its input gradient, whose K is
  // short on fine-grained layers (f = 1408, d = 2048 on fine64: 0.17 and
  // 0.15 ms less there); with padded_elementwise their outputs are in tile
  // order, which a TMA store needs.
  for (const char *g : {"o", "d_h"})
    t.persistent(g, true).tma_store(g, true);
  // GeLU's h GEMM (the pre-activation and h, one after another through one
  // buffer) as well: 0.352 -> 0.319 ms on mbpaper. Not SwiGLU's: its three
  // outputs of a 128 x 128 x 2 tile were slower through TMA (6.32 -> 6.76
  // ms on mixtral a block per tile, 7.38 persistent) than stored directly.
  if (!swiglu)
    t.persistent("h", true).tma_store("h", true);
  // SwiGLU's input gradient dH1 W1^T + dH3 W3^T as one GEMM over both
  // reductions (K = 2f): one per-pair tensor of width d and one epilogue per
  // tile instead of two (fine64 and qwen3moe -0.3 to -0.4 ms a step;
  // mixtral and gptoss within the spread).
  t.chain_summed_gemms(true);
  return t;
}

} // namespace moeforge::bench
