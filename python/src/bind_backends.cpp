// The backend interface from Python (runtime/backend.h): mf.backend("cpu")
// or mf.backend("cuda") compiles layers (mf.Layer, the forward) and training
// layers (mf.TrainingLayer), with numpy arrays (or anything with __dlpack__
// in host memory) in and float64 arrays out. mf.CpuLayer(...) and
// mf.CpuTrainingLayer(...) are the CPU backend's, spelled as before. What
// only the GPU has (another framework's device tensors bound in place,
// caller memory, streams, graphs) is mf.CudaTrainingLayer (bind_cuda.cpp).
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "backends/backends.h"
#include "bind_checked.h"
#include "dsl/error.h"
#include "tensors.h"
#include "training_names.h"

namespace moeforge::python {

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// A token count from Python: any integer (numpy's too), at least 1; one past
// int64 is told so, not answered with nanobind's list of argument types.
int64_t tokens_of(nb::handle tokens, const char *call) {
  const int64_t t = checked_integer(tokens, INT64_MIN, INT64_MAX, call, "tokens");
  check_tokens(t);
  return t;
}

std::unique_ptr<Layer> layer_on(Backend &b, const Pipeline &p, const Schedule &s, nb::handle tokens) {
  return b.layer(p, s, tokens_of(tokens, "layer(pipeline, schedule, tokens)"));
}

std::unique_ptr<TrainingLayer> training_on(Backend &b, const Pipeline &p, const std::vector<Func> &outputs,
                                           const Schedule &s, nb::handle tokens) {
  return b.training_layer(p, outputs, s, tokens_of(tokens, "training_layer(pipeline, outputs, schedule, tokens)"));
}

void bind_layer(nb::module_ &m) {
  nb::class_<Layer>(m, "Layer", "A layer's forward compiled by a backend, bound to `tokens` tokens.")
      .def(
          "with_tokens",
          [](const Layer &l, nb::handle tokens) { return l.with_tokens(tokens_of(tokens, "with_tokens")); }, "tokens"_a,
          "The same compiled program bound to another token count (no compiling).")
      .def(
          "upload", [](Layer &l, const nb::dict &inputs) { l.upload(to_tensor_map(inputs, "input")); }, "inputs"_a,
          "Every Input and Param, {name: array}.")
      .def(
          "upload",
          [](Layer &l, const std::string &name, nb::handle a) {
            l.upload(name, to_host_tensor(a, "input '" + name + "'"));
          },
          "name"_a, "array"_a)
      .def("poison", &Layer::poison, "NaN in every intermediate and output.")
      .def(
          "run",
          [](Layer &l) {
            nb::gil_scoped_release release;
            return l.run();
          },
          "The whole forward; returns its milliseconds.")
      .def("profile", &Layer::profile, "The forward with every step timed: [(step, ms)].")
      .def(
          "download", [](const Layer &l, const std::string &name) { return to_numpy(l.download(name)); }, "func"_a,
          "A Func's values as the reference lays them out.")
      .def(
          "routed_experts", [](const Layer &l, const std::string &route) { return to_numpy(l.routed_experts(route)); },
          "route"_a = "route")
      .def("dropped_pairs", &Layer::dropped_pairs, "route"_a = "route",
           "Pairs the route dropped at its expert capacity in the last run.")
      .def_prop_ro("tokens", &Layer::tokens);
}

void bind_training_layer(nb::module_ &m) {
  nb::class_<TrainingLayer>(m, "TrainingLayer",
                            "A layer's forward and backward compiled by a backend, bound to `tokens` tokens.")
      .def(
          "with_tokens",
          [](const TrainingLayer &l, nb::handle tokens) { return l.with_tokens(tokens_of(tokens, "with_tokens")); },
          "tokens"_a, "The same compiled program bound to another token count (no compiling).")
      .def(
          "upload", [](TrainingLayer &l, const nb::dict &inputs) { l.upload(to_tensor_map(inputs, "input")); },
          "inputs"_a, "Every Input and Param of the forward, {name: array}.")
      .def(
          "upload_upstream_gradient",
          [](TrainingLayer &l, nb::handle grad, std::optional<std::string> output) {
            const std::string name = output.value_or(l.training().output);
            l.upload_upstream_gradient(name, to_host_tensor(grad, "the upstream gradient of '" + name + "'"));
          },
          "grad"_a, "output"_a = nb::none(),
          "d(loss)/d(output), shaped like the output (the first output's unless named).")
      .def("poison", &TrainingLayer::poison)
      .def(
          "forward",
          [](TrainingLayer &l) {
            nb::gil_scoped_release release;
            return l.forward();
          },
          "Routing and every forward step; keeps what the backward reads. Returns its milliseconds.")
      .def(
          "backward",
          [](TrainingLayer &l) {
            nb::gil_scoped_release release;
            return l.backward();
          },
          "Every Input's and Param's gradient. Returns its milliseconds.")
      .def("profile_forward", &TrainingLayer::profile_forward)
      .def("profile_backward", &TrainingLayer::profile_backward)
      .def(
          "output",
          [](const TrainingLayer &l, std::optional<std::string> name) {
            return to_numpy(l.output(name.value_or(l.training().output)));
          },
          "name"_a = nb::none())
      .def(
          "gradient", [](const TrainingLayer &l, const std::string &name) { return to_numpy(l.gradient(name)); },
          "name"_a, "The gradient of an Input or Param by its name ('x', 'w1', ...).")
      .def(
          "download", [](const TrainingLayer &l, const std::string &name) { return to_numpy(l.download(name)); },
          "func"_a)
      .def(
          "routed_experts",
          [](const TrainingLayer &l, const std::string &route) { return to_numpy(l.routed_experts(route)); },
          "route"_a = "route")
      .def_prop_ro("saved_bytes", &TrainingLayer::saved_bytes)
      .def_prop_ro(
          "written_over_saved", [](const TrainingLayer &l) { return l.training().written_over_saved; },
          "{gradient: saved tensor} the program writes over (gradients_over_saved); a layer of this interface "
          "keeps its own memory, but moeforge.torch refuses a second backward of one forward all the same.")
      .def_prop_ro(
          "one_backward_reason", [](const TrainingLayer &l) { return l.training().one_backward_reason(); },
          "Why a second backward of one forward is refused (the CUDA layer's words); empty where it is not.")
      .def_prop_ro("tokens", &TrainingLayer::tokens)
      .def_prop_ro("outputs", [](const TrainingLayer &l) { return l.training().outputs; })
      .def_prop_ro(
          "routes",
          [](const TrainingLayer &l) {
            std::vector<std::string> names;
            for (const RoutingNode *r : l.training().program.routes)
              names.push_back(r->name);
            return names;
          },
          "The names of the layer's routes.")
      .def_prop_ro("seeds", [](const TrainingLayer &l) { return l.training().seeds; })
      .def_prop_ro("gradients", [](const TrainingLayer &l) { return gradient_names(l.training()); });
}

} // namespace

void bind_backends(nb::module_ &m) {
  bind_layer(m);
  bind_training_layer(m);
  nb::class_<Backend>(m, "Backend", "Compiles layers for one kind of machine: mf.backend('cpu') or ('cuda').")
      .def_prop_ro("name", &Backend::name)
      .def_prop_ro("description", &Backend::description)
      .def("layer", &layer_on, "pipeline"_a, "schedule"_a, "tokens"_a,
           "The forward, compiled and bound to `tokens` tokens (a Layer).")
      .def("training_layer", &training_on, "pipeline"_a, "outputs"_a, "schedule"_a, "tokens"_a,
           "Forward and backward of forward outputs `outputs`, compiled and bound (a TrainingLayer).");
  m.def("backend", &make_backend, "name"_a, "A backend by name: 'cpu' (LLVM JIT) or 'cuda'.");
  m.def("backend_names", &backend_names, "The backends this build has.");
#ifdef MOEFORGE_HAVE_CPU_BACKEND
  m.attr("has_cpu_backend") = true;
  m.def(
      "CpuLayer",
      [](const Pipeline &p, const Schedule &s, nb::handle tokens) {
        return layer_on(*make_backend("cpu"), p, s, tokens);
      },
      "pipeline"_a, "schedule"_a, "tokens"_a, "mf.backend('cpu').layer(pipeline, schedule, tokens).");
  m.def(
      "CpuTrainingLayer",
      [](const Pipeline &p, const std::vector<Func> &outputs, const Schedule &s, nb::handle tokens) {
        return training_on(*make_backend("cpu"), p, outputs, s, tokens);
      },
      "pipeline"_a, "outputs"_a, "schedule"_a, "tokens"_a,
      "mf.backend('cpu').training_layer(pipeline, outputs, schedule, tokens).");
#else
  m.attr("has_cpu_backend") = false;
#endif
}

} // namespace moeforge::python
