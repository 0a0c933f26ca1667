// The CPU backend's extras from Python: a training layer on caller memory
// (mf.CpuCallerTrainingLayer), and the forward alone on caller memory
// (mf.CpuCallerLayer, what inference runs: nothing kept for a backward), the calls of mf.CudaTrainingLayer with
// caller_memory=True on host addresses: the caller binds its arrays' memory
// (numpy's arr.ctypes.data, torch's t.data_ptr()) and gives each forward
// memory for what it saves and a workspace, each backward its forward's
// saved memory. moeforge.torch runs its CPU device through it, as its GPU
// through the CUDA class, so a model's forwards in flight, checkpointing and
// any token count work the same on both.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>

#include "backends/cpu/cpu_layer.h"
#include "backends/cpu/cpu_training.h"
#include "bind_checked.h"
#include "tensors.h"
#include "training_names.h"

namespace moeforge::python {

namespace nb = nanobind;
using namespace nb::literals;

namespace {

struct PyCpuCallerTraining {
  Pipeline pipeline;
  std::unique_ptr<cpu::CompiledCpuTraining> compiled;
  std::unique_ptr<cpu::CpuTrainingLayer> layer;
  PyCpuCallerTraining(const Pipeline &p, const std::vector<Func> &outputs, const Schedule &s, nb::handle tokens)
      : pipeline(p) {
    const int64_t t = checked_integer(tokens, INT64_MIN, INT64_MAX, "CpuCallerTrainingLayer", "tokens");
    check_tokens(t);
    {
      nb::gil_scoped_release release;
      compiled = std::make_unique<cpu::CompiledCpuTraining>(cpu::compile_cpu_training(pipeline, outputs, s));
    }
    layer = std::make_unique<cpu::CpuTrainingLayer>(*compiled, t, LayerMemory::caller);
  }
};

uint8_t *host(uintptr_t address) { return reinterpret_cast<uint8_t *>(address); }

struct PyCpuCallerForward {
  Pipeline pipeline;
  std::unique_ptr<cpu::CompiledCpuLayer> compiled;
  std::unique_ptr<cpu::CpuLayer> layer;
  PyCpuCallerForward(const Pipeline &p, const Schedule &s, nb::handle tokens) : pipeline(p) {
    const int64_t t = checked_integer(tokens, INT64_MIN, INT64_MAX, "CpuCallerLayer", "tokens");
    check_tokens(t);
    {
      nb::gil_scoped_release release;
      // A training schedule's choices for the backward's Funcs do not apply.
      compiled = std::make_unique<cpu::CompiledCpuLayer>(cpu::compile_cpu_layer(pipeline, s.only_funcs_of(pipeline)));
    }
    layer = std::make_unique<cpu::CpuLayer>(*compiled, t, 0, LayerMemory::caller);
  }
};

std::vector<std::string> route_names(const KernelProgram &p) {
  std::vector<std::string> names;
  for (const RoutingNode *r : p.routes)
    names.push_back(r->name);
  return names;
}

} // namespace

void bind_cpu(nb::module_ &m) {
  nb::class_<PyCpuCallerForward>(
      m, "CpuCallerLayer",
      "A layer's forward alone on the CPU backend on caller memory (inference: nothing kept for a backward; a "
      "training schedule's choices for the backward's Funcs left out): each "
      "forward is given host memory for its routing tables (`saved`, dropped when the call returns) and a "
      "workspace; set_tokens() changes the token count with no compiling.")
      .def(nb::init<const Pipeline &, const Schedule &, nb::handle>(), "pipeline"_a, "schedule"_a, "tokens"_a = 1)
      .def(
          "set_tokens",
          [](PyCpuCallerForward &l, nb::handle tokens) {
            l.layer->set_tokens(checked_integer(tokens, INT64_MIN, INT64_MAX, "set_tokens", "tokens"));
          },
          "tokens"_a, "The token count of the next forward (any, at least 1; no compiling).")
      .def(
          "step_memory",
          [](const PyCpuCallerForward &l, nb::handle tokens) {
            const StepMemory m =
                l.layer->step_memory(checked_integer(tokens, INT64_MIN, INT64_MAX, "step_memory", "tokens"));
            // A forward alone runs every step from the boundary (0): all of
            // its workspace is the part after it.
            return nb::make_tuple(m.saved_bytes(), std::max(m.workspace_before, m.workspace_after));
          },
          "tokens"_a, "(tables, workspace) bytes of a forward at `tokens` tokens.")
      .def(
          "info", [](const PyCpuCallerForward &l, const std::string &name) { return info_tuple(l.layer->info(name)); },
          "name"_a, "(dtype, shape, contiguous, bytes) of a tensor the layer reads or writes.")
      .def(
          "bind",
          [](PyCpuCallerForward &l, const std::string &name, uintptr_t ptr, size_t bytes) {
            l.layer->bind(name, host(ptr), bytes);
          },
          "name"_a, "ptr"_a, "bytes"_a, "Reads or writes Input, Param or output `name` at host memory the caller owns.")
      .def(
          "forward",
          [](PyCpuCallerForward &l, uintptr_t saved, uintptr_t workspace) {
            nb::gil_scoped_release release;
            l.layer->place({saved}, host(workspace));
            l.layer->run(0, l.compiled->program.steps.size(), "forward()");
          },
          "saved"_a, "workspace"_a = 0,
          "Routing and every step: the routing tables to `saved`, temporaries to `workspace` (step_memory()'s "
          "bytes, 64-byte aligned; 0 where none).")
      .def(
          "routed_experts",
          [](const PyCpuCallerForward &l, const std::string &route) {
            return to_numpy(l.layer->routed_experts(route));
          },
          "route"_a = "route", "The experts the last forward chose (int32, pair order), while its memory lives.")
      .def_prop_ro("outputs", [](const PyCpuCallerForward &l) { return l.compiled->program.outputs; })
      .def_prop_ro("routes", [](const PyCpuCallerForward &l) { return route_names(l.compiled->program); })
      .def_prop_ro("tokens", [](const PyCpuCallerForward &l) { return l.layer->tokens(); });

  nb::class_<PyCpuCallerTraining>(
      m, "CpuCallerTrainingLayer",
      "Forward and backward of a layer on the CPU backend on caller memory: the layer holds no memory for its "
      "intermediates; each forward is given host memory for what it saves (and its routing) and a workspace, "
      "each backward its forward's saved memory (forward(saved, workspace)), so any number of forwards may be in "
      "flight; set_tokens() changes the token count with no compiling. Addresses are the caller's, kept alive "
      "by it while the layer may read or write them.")
      .def(nb::init<const Pipeline &, const std::vector<Func> &, const Schedule &, nb::handle>(), "pipeline"_a,
           "outputs"_a, "schedule"_a, "tokens"_a = 1)
      .def(
          "set_tokens",
          [](PyCpuCallerTraining &l, nb::handle tokens) {
            l.layer->set_tokens(checked_integer(tokens, INT64_MIN, INT64_MAX, "set_tokens", "tokens"));
          },
          "tokens"_a, "The token count of the next forward or backward (any, at least 1; no compiling).")
      .def(
          "step_memory",
          [](const PyCpuCallerTraining &l, nb::handle tokens) {
            const StepMemory m =
                l.layer->step_memory(checked_integer(tokens, INT64_MIN, INT64_MAX, "step_memory", "tokens"));
            return nb::make_tuple(m.saved, m.workspace_before, m.workspace_after);
          },
          "tokens"_a,
          "(saved parts, forward workspace, backward workspace) bytes of a step at `tokens` tokens: a list of the "
          "saved parts' (the activations', then the small values' and the routing tables'), each the caller's memory "
          "of its own.")
      .def(
          "saved_terms", [](const PyCpuCallerTraining &l) { return size_terms_object(l.layer->saved_terms()); },
          "step_memory()'s saved parts over any token count T: None, or for each part its terms (align, [(bytes, "
          "[(a, b, d, m, c), ...]), ...]): the sum over terms of round_up(sum of bytes * prod((a T + b) // d * m + c), "
          "align).")
      .def(
          "info", [](const PyCpuCallerTraining &l, const std::string &name) { return info_tuple(l.layer->info(name)); },
          "name"_a, "(dtype, shape, contiguous, bytes) of a tensor the layer reads or writes.")
      .def(
          "bind",
          [](PyCpuCallerTraining &l, const std::string &name, uintptr_t ptr, size_t bytes) {
            l.layer->bind(name, host(ptr), bytes);
          },
          "name"_a, "ptr"_a, "bytes"_a,
          "Reads or writes tensor `name` (an Input, Param, upstream gradient 'd_y' or output) at host memory the "
          "caller owns and keeps alive, with no copy; its bytes as info(name) says.")
      .def(
          "bind_gradient",
          [](PyCpuCallerTraining &l, const std::string &of, uintptr_t ptr, size_t bytes) {
            l.layer->bind_gradient(of, host(ptr), bytes);
          },
          "of"_a, "ptr"_a, "bytes"_a, "Writes the gradient of Input or Param `of` at host memory the caller owns.")
      .def(
          "forward",
          [](PyCpuCallerTraining &l, const SavedParts &saved, uintptr_t workspace) {
            nb::gil_scoped_release release;
            l.layer->forward(saved, host(workspace));
          },
          "saved"_a, "workspace"_a = 0,
          "Routing and the forward: its activations and routing to `saved` (a list: each saved part's address, "
          "step_memory()'s bytes, 64-byte aligned), its temporaries to `workspace` (0 where it needs none).")
      .def(
          "backward",
          [](PyCpuCallerTraining &l, const SavedParts &saved, uintptr_t workspace) {
            nb::gil_scoped_release release;
            l.layer->backward(saved, host(workspace));
          },
          "saved"_a, "workspace"_a = 0,
          "Every Input's and Param's gradient, reading its forward's `saved` memory (at that forward's token count).")
      .def(
          "upload",
          [](PyCpuCallerTraining &l, const nb::dict &inputs) { l.layer->upload(to_tensor_map(inputs, "input")); },
          "inputs"_a, "Every Input and Param of the forward, copied into the layer's own memory.")
      .def(
          "upload_upstream_gradient",
          [](PyCpuCallerTraining &l, nb::handle grad, std::optional<std::string> output) {
            const std::string name = output.value_or(l.compiled->training.output);
            l.layer->upload_upstream_gradient(name, to_host_tensor(grad, "the upstream gradient of '" + name + "'"));
          },
          "grad"_a, "output"_a = nb::none())
      .def(
          "output",
          [](const PyCpuCallerTraining &l, std::optional<std::string> name) {
            return to_numpy(name ? l.layer->output(*name) : l.layer->output());
          },
          "name"_a = nb::none())
      .def(
          "gradient",
          [](const PyCpuCallerTraining &l, const std::string &name) { return to_numpy(l.layer->gradient(name)); },
          "name"_a)
      .def(
          "download",
          [](const PyCpuCallerTraining &l, const std::string &name) { return to_numpy(l.layer->download(name)); },
          "func"_a)
      .def(
          "routed_experts",
          [](const PyCpuCallerTraining &l, const std::string &route) {
            return to_numpy(l.layer->routed_experts(route));
          },
          "route"_a = "route", "The experts the forward placed last chose (int32, pair order).")
      .def_prop_ro(
          "written_over_saved", [](const PyCpuCallerTraining &l) { return l.compiled->training.written_over_saved; },
          "{gradient: saved tensor} a backward writes over (gradients_over_saved): a forward then serves one backward.")
      .def_prop_ro("one_backward_reason",
                   [](const PyCpuCallerTraining &l) { return l.compiled->training.one_backward_reason(); })
      .def_prop_ro("tokens", [](const PyCpuCallerTraining &l) { return l.layer->layer().tokens(); })
      .def_prop_ro("outputs", [](const PyCpuCallerTraining &l) { return l.compiled->training.outputs; })
      .def_prop_ro("routes", [](const PyCpuCallerTraining &l) { return route_names(l.compiled->training.program); })
      .def_prop_ro(
          "backward_reads", [](const PyCpuCallerTraining &l) { return backward_reads(l.compiled->training); },
          "The forward outputs the backward reads.")
      .def_prop_ro("seeds", [](const PyCpuCallerTraining &l) { return l.compiled->training.seeds; })
      .def_prop_ro("gradients", [](const PyCpuCallerTraining &l) { return gradient_names(l.compiled->training); })
      .def_prop_ro("saved_bytes", [](const PyCpuCallerTraining &l) { return l.layer->saved_bytes(); });
}

} // namespace moeforge::python
