// A check the tests of passes that move steps share: the program still runs
// every step after what it reads.
#pragma once

#include <doctest/doctest.h>

#include <set>
#include <string>

#include "lowering/kernel_program.h"

namespace moeforge::testing {

// Every tensor a step of p reads is an input or written by an earlier step
// (a GEMM's accumulators, read in its epilogue, are registers, not tensors).
inline bool reads_follow_writes(const KernelProgram &p) {
  std::set<std::string> have;
  for (const TensorDecl &t : p.tensors)
    if (t.is_input)
      have.insert(t.name);
  for (const Step &s : p.steps) {
    for (const std::string &r : step_reads(s))
      if (p.find(r) && !have.count(r)) {
        MESSAGE("unwritten read " << r << " in " << step_name(s));
        return false;
      }
    for (const std::string &o : step_outputs(s))
      have.insert(o);
  }
  return true;
}

} // namespace moeforge::testing
