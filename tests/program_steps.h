// Finding a kernel program's steps in tests: a GEMM by the tensor it writes
// or by its step name, any step's index by its name; a test fails (not
// crashes) when there is none.
#pragma once

#include <doctest/doctest.h>

#include <string>

#include "lowering/kernel_program.h"

namespace moeforge::testing {

inline const GemmStep &gemm_writing(const KernelProgram &p, const std::string &out) {
  for (const Step &s : p.steps)
    if (auto *g = std::get_if<GemmStep>(&s); g && g->output == out)
      return *g;
  FAIL("no GEMM writes " << out);
  throw 0;
}

inline const GemmStep &gemm_named(const KernelProgram &p, const std::string &name) {
  for (const Step &s : p.steps)
    if (auto *g = std::get_if<GemmStep>(&s); g && g->name == name)
      return *g;
  FAIL("no GEMM step " << name);
  throw 0;
}

// The index of the step named `name` in p.
inline size_t step_index(const KernelProgram &p, const std::string &name) {
  for (size_t i = 0; i < p.steps.size(); ++i)
    if (step_name(p.steps[i]) == name)
      return i;
  FAIL("no step " << name);
  return 0;
}

} // namespace moeforge::testing
