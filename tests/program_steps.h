// Finding a kernel program's GEMM steps in tests: by the tensor they write
// or by their step name; a test fails (not crashes) when there is none.
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

} // namespace moeforge::testing
