// moeforge._core: the C++ library as a Python extension (nanobind). The
// package moeforge (python/moeforge/__init__.py) re-exports it.
#include <nanobind/nanobind.h>

#include "dsl/error.h"

namespace moeforge::python {
namespace nb = nanobind;
void bind_algebra(nb::module_ &m);
void bind_schedule(nb::module_ &m);
void bind_layers(nb::module_ &m);
void bind_backends(nb::module_ &m);
#ifdef MOEFORGE_HAVE_CPU_BACKEND
void bind_cpu(nb::module_ &m);
#endif
#ifdef MOEFORGE_HAVE_CUDA
void bind_cuda(nb::module_ &m);
#endif
} // namespace moeforge::python

NB_MODULE(_core, m) {
  namespace nb = nanobind;
  m.doc() = "moeforge: a scheduling DSL for Mixture-of-Experts layers (the C++ core)";
  // One version for C++ and Python: CMake's project version, which
  // pyproject.toml reads too.
  m.attr("__version__") = MOEFORGE_VERSION;
  // A user's mistake (a wrong shape, an unknown name, a bad schedule) is a
  // ValueError subclass carrying the C++ message; InternalError stays a
  // RuntimeError (a bug in moeforge, not in the caller's code).
  nb::exception<moeforge::UserError>(m, "UserError", PyExc_ValueError);
  moeforge::python::bind_algebra(m);
  moeforge::python::bind_schedule(m);
  moeforge::python::bind_layers(m);
  moeforge::python::bind_backends(m);
#ifdef MOEFORGE_HAVE_CPU_BACKEND
  moeforge::python::bind_cpu(m);
#endif
#ifdef MOEFORGE_HAVE_CUDA
  moeforge::python::bind_cuda(m);
#else
  m.attr("has_cuda_backend") = false;
  m.def("gpu_available", []() { return nanobind::make_tuple(false, "moeforge was built without the CUDA backend"); });
#endif
}
