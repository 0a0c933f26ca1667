// Running layers from Python: the Eigen reference (evaluate), the example
// layers, and the LLVM CPU backend's forward layer and training layer, with
// numpy arrays (or anything with __dlpack__ in host memory) in and out.
// Values cross as HostTensors: the CPU layers hold bf16 storage in their own
// padded layouts, so each upload converts anyway.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>

#include "backends/reference/evaluate.h"
#include "dsl/error.h"
#include "examples/examples.h"
#include "tensors.h"
#include "training_names.h"

#ifdef MOEFORGE_HAVE_CPU_BACKEND
#include "backends/cpu/cpu_layer.h"
#include "backends/cpu/cpu_training.h"
#endif

namespace moeforge::python {

namespace nb = nanobind;
using namespace nb::literals;

namespace {

Precision parse_precision(const std::string &p) {
  if (p == "f64")
    return Precision::f64;
  if (p == "f32")
    return Precision::f32;
  throw UserError("precision must be 'f32' or 'f64', got '" + p + "'");
}

nb::dict routes_dict(const EvalResult &r) {
  nb::dict out;
  for (const auto &[name, route] : r.routes) {
    nb::dict d;
    d["token"] = to_numpy(route.token);
    d["expert"] = to_numpy(route.expert);
    d["k"] = route.k;
    d["dropped"] = route.dropped(); // pairs dropped at an expert's capacity
    out[nb::str(name.c_str())] = d;
  }
  return out;
}

#ifdef MOEFORGE_HAVE_CPU_BACKEND
// A compiled forward layer bound to host memory. The pipeline and the
// compiled program live here because CpuLayer refers to both.
struct PyCpuLayer {
  Pipeline pipeline;
  std::unique_ptr<cpu::CompiledCpuLayer> compiled;
  std::unique_ptr<cpu::CpuLayer> layer;
  PyCpuLayer(const Pipeline &p, const Schedule &s, int64_t tokens) : pipeline(p) {
    check_tokens(tokens);
    compiled = std::make_unique<cpu::CompiledCpuLayer>(cpu::compile_cpu_layer(pipeline, s));
    layer = std::make_unique<cpu::CpuLayer>(*compiled, tokens);
  }
};

// A compiled training program bound to host memory for a token count; the
// program (and the pipeline it refers to) shared by the layers made from
// it for other counts (with_tokens), which compile nothing.
struct PyCpuTraining {
  struct Program {
    Pipeline pipeline;
    std::unique_ptr<cpu::CompiledCpuTraining> compiled;
  };
  std::shared_ptr<Program> program;
  std::unique_ptr<cpu::CpuTrainingLayer> layer;
  PyCpuTraining(const Pipeline &p, const std::vector<Func> &outputs, const Schedule &s, int64_t tokens)
      : program(new Program{p, nullptr}) {
    check_tokens(tokens);
    program->compiled =
        std::make_unique<cpu::CompiledCpuTraining>(cpu::compile_cpu_training(program->pipeline, outputs, s));
    layer = std::make_unique<cpu::CpuTrainingLayer>(*program->compiled, tokens);
  }
  PyCpuTraining(std::shared_ptr<Program> shared, int64_t tokens) : program(std::move(shared)) {
    check_tokens(tokens);
    layer = std::make_unique<cpu::CpuTrainingLayer>(*program->compiled, tokens);
  }
};
#endif

} // namespace

void bind_layers(nb::module_ &m) {
  nb::class_<EvalResult>(m, "EvalResult", "Every Func's values and every route's choices of a reference run.")
      .def("__getitem__", [](const EvalResult &r, const std::string &name) { return to_numpy(r[name]); })
      .def("__contains__", [](const EvalResult &r, const std::string &name) { return r.values.count(name) > 0; })
      .def_prop_ro("values", [](const EvalResult &r) { return to_dict(r.values); })
      .def_prop_ro("routes", &routes_dict)
      .def_ro("extents", &EvalResult::extents);
  m.def(
      "evaluate",
      [](const Pipeline &p, const nb::dict &inputs, const std::string &precision) {
        TensorMap map = to_tensor_map(inputs, "input");
        Precision prec = parse_precision(precision);
        nb::gil_scoped_release release;
        return evaluate(p, map, prec);
      },
      "pipeline"_a, "inputs"_a, "precision"_a = "f64",
      "The Eigen reference: every Func of the pipeline from {name: array} for each Input and Param.");

  nb::class_<ExampleShape>(m, "ExampleShape")
      .def(nb::init<>())
      .def_rw("tokens", &ExampleShape::tokens)
      .def_rw("experts", &ExampleShape::experts)
      .def_rw("topk", &ExampleShape::topk)
      .def_rw("d", &ExampleShape::d)
      .def_rw("f", &ExampleShape::f);
  nb::class_<Example>(m, "Example", "A ready-made layer written in the algebra (moeforge list names them).")
      .def_ro("name", &Example::name)
      .def_ro("description", &Example::description)
      .def_ro("pipeline", &Example::pipeline)
      .def_ro("output", &Example::output)
      .def_ro("route", &Example::route)
      .def_ro("init_scale", &Example::init_scale)
      .def(
          "random_inputs",
          [](const Example &e, const ExampleShape &s, uint64_t seed) { return to_dict(e.random_inputs(s, seed)); },
          "shape"_a, "seed"_a = 1, "Random bf16-exact inputs, weights scaled by fan-in.");
  m.def("example_names", &example_names);
  m.def(
      "make_example",
      [](const std::string &name, int64_t tokens, int64_t experts, int64_t topk, int64_t d, int64_t f) {
        return std::make_pair(make_example(name, ExampleShape{tokens, experts, topk, d, f}, ShapeSpelling::keywords),
                              ExampleShape{tokens, experts, topk, d, f});
      },
      "name"_a, "tokens"_a = 256, "experts"_a = 8, "topk"_a = 2, "d"_a = 64, "f"_a = 128,
      "An example layer and its shape: (Example, ExampleShape).");

#ifdef MOEFORGE_HAVE_CPU_BACKEND
  m.attr("has_cpu_backend") = true;
  nb::class_<PyCpuLayer>(m, "CpuLayer", "A layer compiled by the LLVM CPU backend, bound to `tokens` tokens.")
      .def(nb::init<const Pipeline &, const Schedule &, int64_t>(), "pipeline"_a, "schedule"_a, "tokens"_a)
      .def(
          "upload", [](PyCpuLayer &l, const nb::dict &inputs) { l.layer->upload(to_tensor_map(inputs, "input")); },
          "inputs"_a, "Every Input and Param, {name: array}.")
      .def(
          "upload",
          [](PyCpuLayer &l, const std::string &name, nb::handle a) {
            l.layer->upload(name, to_host_tensor(a, "input '" + name + "'"));
          },
          "name"_a, "array"_a)
      .def("poison", [](PyCpuLayer &l) { l.layer->poison(); })
      .def(
          "run",
          [](PyCpuLayer &l) {
            nb::gil_scoped_release release;
            l.layer->run();
          },
          "The whole forward.")
      .def(
          "download", [](const PyCpuLayer &l, const std::string &name) { return to_numpy(l.layer->download(name)); },
          "func"_a, "A Func's values as the reference lays them out.")
      .def(
          "routed_experts",
          [](const PyCpuLayer &l, const std::string &route) { return to_numpy(l.layer->routed_experts(route)); },
          "route"_a = "route")
      .def(
          "dropped_pairs", [](const PyCpuLayer &l, const std::string &route) { return l.layer->dropped_pairs(route); },
          "route"_a = "route", "Pairs the route dropped at its expert capacity in the last run.")
      .def_prop_ro("tokens", [](const PyCpuLayer &l) { return l.layer->tokens(); });

  nb::class_<PyCpuTraining>(m, "CpuTrainingLayer",
                            "Forward and backward of a layer on the LLVM CPU backend, bound to `tokens` tokens.")
      .def(nb::init<const Pipeline &, const std::vector<Func> &, const Schedule &, int64_t>(), "pipeline"_a,
           "outputs"_a, "schedule"_a, "tokens"_a)
      .def(
          "with_tokens", [](const PyCpuTraining &l, int64_t tokens) { return PyCpuTraining(l.program, tokens); },
          "tokens"_a, "The same compiled program bound to another token count (no compiling).")
      .def(
          "upload", [](PyCpuTraining &l, const nb::dict &inputs) { l.layer->upload(to_tensor_map(inputs, "input")); },
          "inputs"_a, "Every Input and Param of the forward, {name: array}.")
      .def(
          "upload_upstream_gradient",
          [](PyCpuTraining &l, nb::handle grad, std::optional<std::string> output) {
            const std::string name = output.value_or(l.program->compiled->training.output);
            l.layer->upload_upstream_gradient(name, to_host_tensor(grad, "the upstream gradient of '" + name + "'"));
          },
          "grad"_a, "output"_a = nb::none(),
          "d(loss)/d(output), shaped like the output (the first output's unless named).")
      .def("poison", [](PyCpuTraining &l) { l.layer->poison(); })
      .def(
          "forward",
          [](PyCpuTraining &l) {
            nb::gil_scoped_release release;
            l.layer->forward();
          },
          "Routing and every forward step; keeps what the backward reads.")
      .def(
          "backward",
          [](PyCpuTraining &l) {
            nb::gil_scoped_release release;
            l.layer->backward();
          },
          "Every Input's and Param's gradient.")
      .def("profile_forward", [](PyCpuTraining &l) { return l.layer->profile_forward(); })
      .def("profile_backward", [](PyCpuTraining &l) { return l.layer->profile_backward(); })
      .def(
          "output",
          [](const PyCpuTraining &l, std::optional<std::string> name) {
            return to_numpy(name ? l.layer->output(*name) : l.layer->output());
          },
          "name"_a = nb::none())
      .def(
          "gradient", [](const PyCpuTraining &l, const std::string &name) { return to_numpy(l.layer->gradient(name)); },
          "name"_a, "The gradient of an Input or Param by its name ('x', 'w1', ...).")
      .def(
          "download", [](const PyCpuTraining &l, const std::string &name) { return to_numpy(l.layer->download(name)); },
          "func"_a)
      .def(
          "routed_experts",
          [](const PyCpuTraining &l, const std::string &route) { return to_numpy(l.layer->routed_experts(route)); },
          "route"_a = "route")
      .def_prop_ro("saved_bytes", [](const PyCpuTraining &l) { return l.layer->saved_bytes(); })
      .def_prop_ro(
          "written_over_saved", [](const PyCpuTraining &l) { return l.program->compiled->training.written_over_saved; },
          "{gradient: saved tensor} the program writes over (gradients_over_saved); the CPU layer keeps "
          "its own memory, but moeforge.torch refuses a second backward of one forward all the same.")
      .def_prop_ro(
          "one_backward_reason",
          [](const PyCpuTraining &l) { return l.program->compiled->training.one_backward_reason(); },
          "Why a second backward of one forward is refused (the CUDA layer's words); empty where it is not.")
      .def_prop_ro("tokens", [](const PyCpuTraining &l) { return l.layer->layer().tokens(); })
      .def_prop_ro("outputs", [](const PyCpuTraining &l) { return l.program->compiled->training.outputs; })
      .def_prop_ro(
          "routes",
          [](const PyCpuTraining &l) {
            std::vector<std::string> names;
            for (const RoutingNode *r : l.program->compiled->training.program.routes)
              names.push_back(r->name);
            return names;
          },
          "The names of the layer's routes.")
      .def_prop_ro("seeds", [](const PyCpuTraining &l) { return l.program->compiled->training.seeds; })
      .def_prop_ro("gradients", [](const PyCpuTraining &l) { return gradient_names(l.program->compiled->training); });
#else
  m.attr("has_cpu_backend") = false;
#endif
}

} // namespace moeforge::python
