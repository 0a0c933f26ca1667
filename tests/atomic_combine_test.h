// Shared by the atomic_combine tests (lowering, CPU, CUDA): the schedule they
// start from and where its combine went.
#pragma once

#include <string>
#include <variant>

#include "lowering/kernel_program.h"
#include "schedules/schedule.h"

namespace moeforge::testing {

inline Schedule atomic_schedule(Permutation perm, GateFusion gate) {
  Schedule s("atomic");
  s.permutation(perm).gate(gate).atomic_combine(true);
  return s;
}

// The GEMM step that writes `name`; null when another kind of step (or none)
// writes it.
inline const GemmStep *gemm_writing(const KernelProgram &p, const std::string &name) {
  for (const Step &s : p.steps)
    if (auto *g = std::get_if<GemmStep>(&s); g && g->output == name)
      return g;
  return nullptr;
}

} // namespace moeforge::testing
