// The CLI's command line: which command, which example at which shape, and
// each command's flags, parsed and checked before anything runs (a flag that
// does not belong to the command, or a value out of range, is a UserError
// that names the flag and what it takes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backends/reference/evaluate.h"
#include "examples/examples.h"

namespace moeforge {

struct Options {
  std::string command, example;
  ExampleShape shape;
  uint64_t seed = 1;
  Precision precision = Precision::f32;
  bool check = false;
  bool check_full = false;      // --check=full: every token, not a sample (run)
  double capacity = 0;          // run, train: --capacity, the schedule's expert capacity (0: dropless)
  bool recompute = false;       // train: schedule.recompute(true)
  bool aux = false;             // train: with the example's auxiliary losses as more outputs
  std::string schedule;         // empty: auto for run, train and tune; megablocks for emit
  std::string backend;          // empty: the GPU when there is one, else the CPU backend, else the reference
  std::string emit;             // ir, passes, cuda, llvm or plan
  bool emit_training = false;   // emit --train: the training step's program; tune --train: the training step
  int64_t budget_seconds = 120; // tune
  int ranks = 1;                // run, train: --ranks, GPUs the experts spread over (1: the unsplit layer)
};

// args without the program's name: the command, its example and flags.
Options parse_options(const std::vector<std::string> &args);

} // namespace moeforge
