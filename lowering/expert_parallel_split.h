// Expert parallelism's algebra: a layer split at its route into the part
// that runs where the tokens are and the part that runs where the experts
// are, derived from the unchanged algebra of the layer.
//
// The expert side is every Func over the route's pairs that reads a weight
// through expert(r) (h and o of an MLP expert), and what it reads through
// token(r) (x) is what crosses to the experts' ranks. On a rank, the expert
// side runs over the rows it received, under a route of its own that sends
// each received row to the local expert given for it (one-hot selection
// scores, top-1), with the same Func names, so the layer's schedule applies
// to the same expert GEMMs as on one GPU. Its weights are those of its
// E / ranks local experts.
//
// The token side is the rest, with each expert-side Func that the combine
// reads replaced by an Input of the rows that came back (pair order), and
// with one more output per tensor the experts read: its rows gathered in
// pair order (x_rows(r, i) = x(token(r), i)), which is what a rank sends.
// Differentiating each side on its own gives the training step: the token
// side's gradient of a returned Input (d_o_returned = gate * dy) is what goes
// to the experts, whose gradient of a received Input (d_x_rows) comes back
// as the upstream gradient of the dispatched output, which the token side's
// backward sums into d_x over each token's pairs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsl/pipeline.h"

namespace moeforge {

struct ExpertParallelSplit {
  std::string route;         // the route whose experts are spread over the ranks
  int64_t experts = 0;       // E
  int ranks = 1;             // R
  int64_t local_experts = 0; // E / R, rank q owning experts q E/R .. (q+1) E/R - 1

  // One tensor that crosses between the sides: rows of `width` values.
  struct Crossing {
    std::string token_side;  // the token pipeline's Func or Input, in pair order
    std::string expert_side; // the expert pipeline's Input or Func, over received rows
    int64_t width = 0;       // values per row
    DType dtype = DType::bf16;
  };

  // Where the tokens are: the layer's outputs, then one `<x>_rows` output per
  // dispatched tensor; one `<o>_returned` Input per returned tensor.
  std::vector<Func> token_outputs;
  Pipeline token_pipeline() const { return Pipeline(token_outputs); }
  // Where the experts are, over the received rows (the dynamic Dim "N"): one
  // `<x>_rows` Input per dispatched tensor, the selector Input, the local
  // experts' weights (same names, first Dim E / R); one `<o>_rows` output per
  // returned tensor, in received-row order.
  std::vector<Func> expert_outputs;
  Pipeline expert_pipeline() const { return Pipeline(expert_outputs); }

  std::vector<Crossing> dispatched; // token_side: a token output; expert_side: an expert Input
  std::vector<Crossing> returned;   // expert_side: an expert output; token_side: a token Input
  // The expert pipeline's Input "expert_select" [N, E / R] (f32): 1 at each
  // received row's local expert, 0 elsewhere.
  std::string selector;
  // The Params indexed by expert(r), whose rows E / R the ranks split.
  std::vector<std::string> expert_params;
};

// Splits `p` for `ranks` ranks. UserErrors, each naming the problem and the
// fix, for what the split cannot express: not exactly one top_k route
// (expert choice included), ranks not dividing the experts, an expert-side
// Func that reads a per-pair value of the token side (a gate applied inside
// the experts), or a weight shared by every expert, or an expert-side value
// read other than by the combine.
ExpertParallelSplit split_expert_parallel(const Pipeline &p, int ranks);

} // namespace moeforge
