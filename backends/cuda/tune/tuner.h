// The autotuner: times candidate schedules of one layer on the GPU and keeps
// the fastest. The search first times the layer-wide choices (the routed
// rows' format, block size, where the gate multiplies: layout_candidates)
// and starts from the best of them; then it walks the tunable Funcs in
// program order and, for each, times every candidate the search space keeps
// (tune_space.h) with the other Funcs at their best so far (coordinate
// descent), then the Func's raster bands with its winner, in up to two
// passes (the second from where the first ended, stopping early if a pass
// changes nothing), from two starts (the layer-wide choices searched first,
// or the base's kept through the first pass) whose ends meet the base in a
// last run-off. The budget stops it early, the base schedule always timed
// first. Each candidate is the whole layer (forward, or forward + backward)
// replayed from CUDA graphs, so what is compared is what a training loop
// runs.
//
// How a winner is decided: each round's sweep times every candidate once,
// back to back; then a run-off times the best so far and the sweep's
// fastest few side by side, in interleaved rounds, and keeps the lowest
// median. Back-to-back timings drift with the GPU's clock by more than the
// differences between good candidates (28 -> 31 ms over a minute of
// mixtral steps), so a sweep's order alone would pick on noise; a margin
// against it (the earlier 1 %) kept a winner the run-off finds from ever
// replacing the choice before it. The layer-wide round times the whole
// layer (its choices change most kernels); a Func's round times that
// Func's GEMM kernels alone, an event around each step, since they are all
// its choices change and a few percent of one kernel is lost in a whole
// training step's spread.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/layer.h"
#include "backends/cuda/runtime/training_layer.h"
#include "dsl/pipeline.h"
#include "runtime/tensor.h"
#include "schedules/schedule.h"

namespace moeforge::cuda {

struct TuneRequest {
  const Pipeline *pipeline = nullptr;
  std::string output; // the layer's output Func
  int64_t tokens = 0;
  TensorMap inputs;        // every Input and Param
  TensorMap skewed_inputs; // the same under skewed routing, or empty: each candidate is timed under both
  bool training = false;
  HostTensor upstream; // training: d(loss)/d(output)
  Schedule base;       // where the search starts
  double budget_seconds = 120;
  int reps = 5;          // timed replays per candidate, at least (more where a replay is short)
  int runoff_size = 4;   // contenders in each run-off: the best so far and the sweep's fastest
  int runoff_rounds = 5; // interleaved rounds of a run-off
};

struct TuneResult {
  Schedule best;
  // base_ms: the base as timed beside the best in the last run-off where it
  // contended there, else as timed first.
  double best_ms = 0, base_ms = 0;
  int timed = 0, pruned = 0, failed = 0, left = 0; // left: candidates the budget did not reach
  std::vector<std::string> log; // one line per candidate: what it changed, its time or why it was skipped
};

// A candidate compiled for the request (its forward layer, or its training
// step), or why it could not be (a schedule the layer refuses).
struct CompiledCandidate {
  std::optional<CompiledLayer> layer;
  std::optional<CompiledTraining> training;
  std::string error;
};

// Compiles `schedules` for the request, `threads` at a time (NVRTC is the
// search's slow part: seconds per training step, and the candidates of one
// Func are independent), results in the order given. Needs no GPU.
std::vector<CompiledCandidate> compile_candidates(const TuneRequest &request, const std::vector<Schedule> &schedules,
                                                  const std::string &arch, unsigned threads);

// The run-off's decision: `ms[c]` holds contender c's timings, one per
// round; the lowest median wins, ties to the earlier contender (the best so
// far comes first, so a tie keeps it).
size_t runoff_winner(const std::vector<std::vector<double>> &ms);

// `progress` gets a line per candidate (best so far, time left); may be empty.
TuneResult tune(Device &device, const TuneRequest &request, const std::function<void(const std::string &)> &progress);

} // namespace moeforge::cuda
