// The CLI's LLVM CPU backend beyond the backend interface (built with
// MOEFORGE_HAVE_CPU_BACKEND): `emit --llvm`.
#include "backends/cpu/cpu_layer.h"
#include "tools/cli_backend.h"

namespace moeforge {

std::string cli_llvm_ir(const Pipeline &pipeline, const Schedule &schedule) {
  return cpu::cpu_llvm_ir(pipeline, schedule, /*optimised=*/true);
}

} // namespace moeforge
