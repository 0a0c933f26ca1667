// The backends by name: make_backend("cpu") or make_backend("cuda"), for
// whichever of them the including target links (moeforge::cpu defines
// MOEFORGE_HAVE_CPU_BACKEND, moeforge::cuda MOEFORGE_HAVE_CUDA). The choice
// is made in the caller's own translation unit, which is what keeps a
// program that links one backend free of the other's dependencies (LLVM,
// the CUDA toolkit); so these functions have internal linkage.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dsl/error.h"
#include "runtime/backend.h"

#ifdef MOEFORGE_HAVE_CPU_BACKEND
#include "backends/cpu/cpu_backend.h"
#endif
#ifdef MOEFORGE_HAVE_CUDA
#include "backends/cuda/runtime/cuda_backend.h"
#endif

namespace moeforge {

// The backends built into this program, "cpu" before "cuda".
static inline std::vector<std::string> backend_names() {
  std::vector<std::string> names;
#ifdef MOEFORGE_HAVE_CPU_BACKEND
  names.push_back("cpu");
#endif
#ifdef MOEFORGE_HAVE_CUDA
  names.push_back("cuda");
#endif
  return names;
}

// A UserError for a name that is not built in, naming those that are.
// "cuda" on a machine without a GPU is a UserError with the driver's reason.
static inline std::unique_ptr<Backend> make_backend(const std::string &name) {
#ifdef MOEFORGE_HAVE_CPU_BACKEND
  if (name == "cpu")
    return cpu::make_backend();
#endif
#ifdef MOEFORGE_HAVE_CUDA
  if (name == "cuda")
    return cuda::make_backend();
#endif
  std::string built;
  for (const std::string &n : backend_names())
    built += (built.empty() ? "'" : ", '") + n + "'";
  throw UserError(
      "no backend '" + name + "' in this build; " +
      (built.empty() ? std::string("none is (built without LLVM 19 and the CUDA toolkit)") : "built: " + built) +
      (name == "reference" ? " (the Eigen reference is evaluate(pipeline, inputs), not a backend)" : ""));
}

} // namespace moeforge
