// The moeforge command line, as a function so tests can drive it:
//   moeforge list
//   moeforge print <example> [shape flags]
//   moeforge run <example> [--tokens N --experts E --topk K --d D --f F
//                           --seed S --precision f32|f64] [--check]
//   moeforge train <example> [shape flags, --seed S, --schedule S, --recompute,
//                             --backend cpu|cuda] [--check]
//   moeforge emit <example> [shape flags] [--schedule S] --ir | --cuda | --llvm
// Returns the exit code: 0 success, 1 a failed --check, 2 a usage error (bad
// flag, bad value, impossible shape), with the reason on `err`.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace moeforge {

int run_cli(const std::vector<std::string> &args, std::ostream &out, std::ostream &err);

} // namespace moeforge
