// The autotuner's search space as data: for each contraction the schedule can
// tile, the per-Func choices (tile, stages, persistent blocks, TMA stores,
// two-block clusters; then the raster band, tried apart),
// each pruned before anything is timed by the GEMM plan pass's legality
// (lowering and plan_gemm reject it), by what the plan makes of it (a
// choice whose plans equal another's, a request the kernel would not take
// up, is one candidate, not two) and by a cheap model of the tile against
// the GEMM's columns (model_prune).
#pragma once

#include <string>
#include <vector>

#include "dsl/pipeline.h"
#include "lowering/kernel_program.h"
#include "schedules/schedule.h"

namespace moeforge::cuda {

// One Func's settings in a candidate.
struct FuncChoice {
  int tile_m = 128, tile_n = 128, stages = 4;
  bool persistent = false, tma_store = false;
  int cluster = 1;          // row tiles per cluster: 2 multicasts B to a pair of blocks
  int raster = 0;           // row tiles per band of the block order; 0: as the base has it
  int narrow_tail = -1;     // the last column tile's wgmmas narrower (1) or not (0); -1: as the base has it
  std::string text() const; // "128x256, 4 stages, persistent, tma_store, cluster 2, raster 2"
};

struct PrunedChoice {
  FuncChoice choice;
  std::string why; // the legality error, or the candidate it duplicates
};

// The candidates for one Func: legal and distinct, in the order tried.
struct FuncCandidates {
  std::string func;
  std::vector<FuncChoice> kept;
  std::vector<PrunedChoice> pruned;
};

// The layer-wide choices tried before any Func's: the product of the routed
// rows' format (blocked or scattered), the block (128 or 256 rows), where the
// gate multiplies (combine or the last GEMM's epilogue), padded_elementwise
// and chain_summed_gemms, each combination but `base`'s own, pruned by
// legality and by equal programs as candidates_for does. `what` names the
// change ("permutation(scattered) block(256)"). Precision and memory
// choices stay as `base` has them.
struct LayoutCandidate {
  std::string what;
  Schedule schedule;
};
struct LayoutCandidates {
  std::vector<LayoutCandidate> kept;
  std::vector<std::pair<std::string, std::string>> pruned; // what, why
};
LayoutCandidates layout_candidates(const Pipeline &pipeline, const std::string &output, const Schedule &base,
                                   bool training);

// Every choice the space offers one Func (the product of the knobs' ranges).
std::vector<FuncChoice> func_choices();

// Why the cheap model drops `choice` for `func` in `program` (the program
// lowered with it), or "" where it keeps it: a tile twice as wide as the
// GEMM's columns or more (its half covers them with less padding), or a
// 64-column tile over 256 columns or more (it reads A twice as often as a
// 128-column tile; narrow tiles are for narrow GEMMs), unless its row tiles
// average 32 rows or fewer at `tokens` tokens (a routed GEMM's T k / E: a
// decoding step's), where A's bytes are at most half of B's and the narrow
// tile gives the grid twice the blocks to stream the weights with; likewise
// a ring of more than 4 stages (64-column tiles take 6 and 8) only there.
// tokens 0: count every row tile full.
std::string model_prune(const KernelProgram &program, const std::string &func, const FuncChoice &choice,
                        int64_t tokens = 0);

// `base` with `choice` applied to `func`.
Schedule with_choice(const Schedule &base, const std::string &func, const FuncChoice &choice);

// func's settings in `s` as a choice (its raster band named): with_choice(s,
// func, choice_in(s, func)) plans as s does.
FuncChoice choice_in(const Schedule &s, const std::string &func);

// The raster bands tried for a Func once its tile, stages and walk are
// chosen: row tiles per band of the block order (8 is the default). Routed
// GEMMs have a few row tiles an expert (mbpaper ~2.5, fine64 ~16), and a
// band of one or two of them was measured ahead of 8 on both; 16 behind.
std::vector<int> raster_choices();

// func's candidates around `base` that change its raster band alone (each
// raster_choices() value but base's own), its other settings as base has
// them; pruned as candidates_for prunes.
FuncCandidates raster_candidates_for(const Pipeline &pipeline, const std::string &output, const Schedule &base,
                                     const std::string &func, bool training, int64_t tokens = 0);

// func's settings in `base` with its narrow tail (GemmTiling::narrow_tail)
// switched: one candidate, tried once the tile is chosen, pruned as
// candidates_for prunes (where the GEMM has no narrow tail its plans are
// base's own).
FuncCandidates narrow_tail_candidates_for(const Pipeline &pipeline, const std::string &output, const Schedule &base,
                                          const std::string &func, bool training, int64_t tokens = 0);

// The Funcs whose GEMMs the schedule tiles, in program order (the forward's,
// or with `training` the training step's), for `pipeline`'s output `output`.
std::vector<std::string> tunable_funcs(const Pipeline &pipeline, const std::string &output, const Schedule &base,
                                       bool training);

// func's candidates around `base` (the other Funcs as base has them); a
// choice that gives base's own plans is pruned as "the same plans as the
// current settings". `tokens`: the count tuned for, which model_prune
// judges narrow tiles by (0: every row tile full).
FuncCandidates candidates_for(const Pipeline &pipeline, const std::string &output, const Schedule &base,
                              const std::string &func, bool training, int64_t tokens = 0);

} // namespace moeforge::cuda
