// The Eigen reference (evaluate) and the example layers from Python, with
// numpy arrays (or anything with __dlpack__ in host memory) in and out. The
// compiled backends' layers are bind_backends.cpp's.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>

#include "backends/reference/evaluate.h"
#include "dsl/error.h"
#include "examples/examples.h"
#include "schedules/schedule.h"
#include "tensors.h"

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
      [](const Pipeline &p, const nb::dict &inputs, const std::string &precision, std::optional<Schedule> schedule) {
        TensorMap map = to_tensor_map(inputs, "input");
        Precision prec = parse_precision(precision);
        EvalOptions options;
        if (schedule) {
          schedule->check_names(p);
          options.capacity_factor = schedule->capacity();
          options.fp8 = schedule->fp8_funcs(p);
        }
        nb::gil_scoped_release release;
        return evaluate(p, map, prec, options);
      },
      "pipeline"_a, "inputs"_a, "precision"_a = "f64", "schedule"_a = nb::none(),
      "The Eigen reference: every Func of the pipeline from {name: array} for each Input and Param. With a "
      "schedule, the numbers its layer computes: pairs dropped at its capacity, its FP8 operands rounded.");

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
}

} // namespace moeforge::python
