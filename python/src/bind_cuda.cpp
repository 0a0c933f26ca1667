// The CUDA backend from Python: a training layer (forward and backward, or
// the forward alone) compiled for the GPU and bound to a token count. Two
// ways in and out: host arrays (upload / output / gradient: synchronous, for
// tests and small work) and device pointers (copy_in / copy_out /
// copy_gradient: device-to-device on the caller's stream, no host
// synchronisation) or bind / bind_gradient (the layer reads and writes the
// caller's memory itself, no copy), which moeforge.torch uses with torch's
// tensors and current stream.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "backends/cuda/codegen/compile_cache.h"
#include "backends/cuda/runtime/driver.h"
#include "backends/cuda/runtime/training_layer.h"
#include "backends/cuda/tune/tune_cache.h"
#include "backends/cuda/tune/tune_layer.h"
#include "dsl/error.h"
#include "examples/skewed_routing.h"
#include "lowering/default_schedule.h"
#include "tensors.h"
#include "training_names.h"

namespace moeforge::python {

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// One Device per ordinal for the process: it holds the primary context,
// which PyTorch's CUDA runtime uses as well.
std::shared_ptr<cuda::Device> device(int ordinal) {
  static std::mutex mutex;
  static std::map<int, std::shared_ptr<cuda::Device>> devices;
  std::lock_guard<std::mutex> lock(mutex);
  std::string why;
  if (!cuda::gpu_available(&why))
    throw UserError("the CUDA backend needs a GPU: " + why + " (use the CPU backend: CpuTrainingLayer)");
  auto &d = devices[ordinal];
  if (!d)
    d = std::make_shared<cuda::Device>(ordinal);
  d->make_current();
  return d;
}

cuda::Stream stream_of(uintptr_t handle) { return cuda::Stream::borrow(reinterpret_cast<CUstream>(handle)); }

// A layer's forward alone on caller memory (inference: nothing kept for a
// backward): the memory of each forward (its routing tables and a
// workspace) is given by the caller for the call, as torch's allocator
// gives moeforge.torch's.
struct PyCudaCallerForward {
  std::shared_ptr<cuda::Device> dev;
  Pipeline pipeline;
  std::unique_ptr<cuda::CompiledLayer> compiled;
  std::unique_ptr<cuda::CudaLayer> layer;
  // Each forward as one CUDA graph once its addresses repeat (off until
  // replay_graphs(True)): a decoding step's kernels take microseconds, so
  // their launches are most of its time.
  cuda::GraphReplay replay;
  bool replay_on = false;
  PyCudaCallerForward(const Pipeline &p, const Schedule &s, int64_t tokens, int ordinal) : pipeline(p) {
    check_tokens(tokens);
    dev = device(ordinal);
    {
      nb::gil_scoped_release release; // NVRTC takes seconds on large layers
      // A training schedule's choices for the backward's Funcs do not apply.
      compiled = std::make_unique<cuda::CompiledLayer>(
          cuda::compile_layer(pipeline, s.only_funcs_of(pipeline), dev->arch_specific()));
    }
    layer = std::make_unique<cuda::CudaLayer>(*dev, *compiled, tokens, 0, cuda::LayerMemory::caller);
  }
};

struct PyCudaTraining {
  std::shared_ptr<cuda::Device> dev;
  Pipeline pipeline;
  std::unique_ptr<cuda::CompiledTraining> compiled;
  std::unique_ptr<cuda::TrainingLayer> layer;
  PyCudaTraining(const Pipeline &p, const std::vector<Func> &outputs, const Schedule &s, int64_t tokens, int ordinal,
                 bool caller_memory)
      : pipeline(p) {
    check_tokens(tokens);
    dev = device(ordinal);
    {
      nb::gil_scoped_release release; // NVRTC takes seconds on large layers
      compiled =
          std::make_unique<cuda::CompiledTraining>(cuda::compile_training(pipeline, outputs, s, dev->arch_specific()));
    }
    layer = std::make_unique<cuda::TrainingLayer>(*dev, *compiled, tokens,
                                                  caller_memory ? cuda::LayerMemory::caller : cuda::LayerMemory::owned);
  }
};

} // namespace

void bind_cuda(nb::module_ &m) {
  m.attr("has_cuda_backend") = true;
  m.def(
      "gpu_available",
      []() {
        std::string why;
        bool ok = cuda::gpu_available(&why);
        return std::make_pair(ok, why);
      },
      "(True, '') where the CUDA backend can run, else (False, why).");

  m.def(
      "cached_schedule",
      [](const Pipeline &pipeline, int64_t tokens, bool training, int ordinal) {
        std::shared_ptr<cuda::Device> dev = device(ordinal);
        const std::filesystem::path dir = cuda::CompileCache::default_directory();
        if (dir.empty())
          return nb::make_tuple(nb::none(), "no cache directory (MOEFORGE_CACHE_DIR or HOME)");
        const cuda::TuneKey key = cuda::tune_key(pipeline, tokens, dev->name(), training, MOEFORGE_VERSION);
        cuda::TuneCache cache(dir);
        std::string why;
        if (std::optional<Schedule> s = cache.load(key, &why))
          return nb::make_tuple(nb::cast(*s), cache.entry_path(key).string() + ", tuned on " + dev->name());
        return nb::make_tuple(nb::none(), why);
      },
      "pipeline"_a, "tokens"_a, "training"_a = true, "device"_a = 0,
      "(schedule, where) of what `moeforge tune` cached for this layer, token count's bucket and GPU, or (None, "
      "why not).");

  m.def(
      "tune",
      [](const Pipeline &pipeline, int64_t tokens, std::optional<std::vector<Func>> outputs,
         std::optional<Schedule> schedule, bool training, double budget_seconds, uint64_t seed, int ordinal,
         const std::map<std::string, double> &init_scale, bool progress) {
        user_check(tokens > 0) << "tune(tokens=0): tuning times the layer at a token count; give the count a step "
                                  "runs (e.g. batch x sequence length)";
        user_check(budget_seconds > 0 && budget_seconds <= 24 * 3600)
            << "tune(budget_seconds=" << budget_seconds << "): give a budget from a few seconds to 86400";
        const std::vector<Func> outs = outputs && !outputs->empty() ? *outputs : pipeline.outputs();
        cuda::TuneRequest r;
        r.pipeline = &pipeline;
        r.output = outs.front().name();
        r.tokens = tokens;
        r.training = training;
        r.budget_seconds = budget_seconds;
        // Where the search starts: the schedule given, else the layer's
        // default (what MoELayer runs with nothing tuned).
        r.base = schedule   ? *schedule
                 : training ? default_schedule(pipeline, {outs.front()})
                            : default_schedule(pipeline);
        r.inputs = cuda::layer_inputs(pipeline, tokens, seed, init_scale);
        if (training)
          r.upstream = cuda::upstream_like(outs.front(), tokens, seed);
        // Timed under skewed routing too where the router is x wr (as the
        // CLI's tune does), so the winner holds up when the load is uneven.
        if (pipeline.routes().size() == 1)
          if (std::optional<SkewedInputs> skewed =
                  skewed_router_inputs(r.inputs, pipeline.routes().front()->k, 2.5, nullptr))
            r.skewed_inputs = skewed->inputs;
        // Last: what the request needs is made (and checked) without a GPU.
        std::shared_ptr<cuda::Device> dev = device(ordinal);
        cuda::StoredTune t;
        {
          nb::gil_scoped_release release; // minutes of compiling and timing
          t = cuda::tune_and_store(*dev, r, [&](const std::string &line) {
            if (progress) {
              nb::gil_scoped_acquire hold;
              nb::print(nb::str(("moeforge.tune: " + line).c_str()));
            }
          });
        }
        nb::dict info;
        info["device"] = dev->name();
        info["base_ms"] = t.result.base_ms;
        info["best_ms"] = t.result.best_ms;
        info["timed"] = t.result.timed;
        info["pruned"] = t.result.pruned;
        info["failed"] = t.result.failed;
        info["left"] = t.result.left;
        info["skewed"] = !r.skewed_inputs.empty();
        info["cached"] = t.cached;
        return nb::make_tuple(nb::cast(t.result.best), info);
      },
      "pipeline"_a, "tokens"_a, "outputs"_a = nb::none(), "schedule"_a = nb::none(), "training"_a = true,
      "budget_seconds"_a = 120.0, "seed"_a = 0, "device"_a = 0, "init_scale"_a = std::map<std::string, double>{},
      "progress"_a = false,
      "Times candidate schedules of the layer on the GPU (as `moeforge tune` does: the layer-wide choices, then "
      "each contraction's tiles, stages, walk and stores, within budget_seconds) from `schedule` (default: the "
      "layer's default schedule), on random inputs at `tokens` tokens (Params U(+-1/sqrt(fan-in)) unless "
      "init_scale names them), under uniform and, where the router is x wr, skewed routing; stores the fastest in "
      "the tuned-schedule cache, where schedule=\"auto\" (moeforge.torch.MoELayer) and `--schedule auto` find "
      "it for this layer, the token count's power-of-two bucket and this GPU. Returns (schedule, info): info has "
      "base_ms, best_ms, timed, pruned, failed, left, device and cached (the entry's path, '' if not written).");

  nb::class_<PyCudaCallerForward>(
      m, "CudaCallerLayer",
      "A layer's forward alone on the GPU on caller memory (inference: nothing kept for a backward; a training "
      "schedule's choices for the backward's Funcs left out): each forward "
      "is given device memory for its routing tables (`saved`, free once the forward's work is done) and a "
      "workspace; set_tokens() changes the token count with no compiling.")
      .def(nb::init<const Pipeline &, const Schedule &, int64_t, int>(), "pipeline"_a, "schedule"_a, "tokens"_a = 1,
           "device"_a = 0)
      .def(
          "set_tokens",
          [](PyCudaCallerForward &l, int64_t tokens) {
            l.dev->make_current();
            l.layer->set_tokens(tokens);
          },
          "tokens"_a, "The token count of the next forward (any, at least 1; no compiling).")
      .def(
          "step_memory",
          [](const PyCudaCallerForward &l, int64_t tokens) {
            const StepMemory m = l.layer->step_memory(tokens);
            // A forward alone runs every step from the boundary (0): all of
            // its workspace is the part after it.
            return nb::make_tuple(m.saved_bytes(), std::max(m.workspace_before, m.workspace_after));
          },
          "tokens"_a, "(tables, workspace) bytes of a forward at `tokens` tokens.")
      .def(
          "info", [](const PyCudaCallerForward &l, const std::string &name) { return info_tuple(l.layer->info(name)); },
          "name"_a, "(dtype, shape, contiguous, bytes) of a tensor the layer reads or writes.")
      .def(
          "bind",
          [](PyCudaCallerForward &l, const std::string &name, uintptr_t ptr, size_t bytes) {
            l.dev->make_current();
            l.layer->bind(name, static_cast<CUdeviceptr>(ptr), bytes);
          },
          "name"_a, "ptr"_a, "bytes"_a,
          "Reads or writes Input, Param or output `name` at device memory the caller owns.")
      .def(
          "forward",
          [](PyCudaCallerForward &l, uintptr_t stream, uintptr_t saved, uintptr_t workspace) {
            l.dev->make_current();
            l.layer->place({saved}, static_cast<CUdeviceptr>(workspace));
            l.replay.run(*l.layer, 0, l.compiled->program.steps.size(), stream_of(stream), "enqueue()", l.replay_on);
          },
          "stream"_a, "saved"_a, "workspace"_a = 0,
          "Enqueues routing and every step on the stream: the routing tables to `saved`, temporaries to "
          "`workspace` (step_memory()'s bytes, 256-byte aligned; 0 where none).")
      .def(
          "replay_graphs", [](PyCudaCallerForward &l, bool on) { l.replay_on = on; }, "on"_a = true,
          "Runs each forward as one CUDA graph: eagerly the first time at a token count and set of addresses, "
          "captured the second, replayed after (eagerly inside someone else's capture).")
      .def(
          "graph_counts",
          [](const PyCudaCallerForward &l) {
            const cuda::GraphReplay::Counts &c = l.replay.counts();
            return nb::make_tuple(c.replayed, c.captured, c.eager);
          },
          "(replayed, captured, eager) forwards since the layer was made.")
      .def(
          "check_routing_scores",
          [](PyCudaCallerForward &l, uintptr_t stream) {
            l.dev->make_current();
            l.layer->check_routing_scores(stream_of(stream), "check_routing_scores()");
          },
          "stream"_a = 0,
          "Raises moeforge.UserError naming the token and expert if a routing score of work queued so far was "
          "NaN or infinite (forward() checks it first).")
      .def(
          "pairs",
          [](const PyCudaCallerForward &l, const std::string &route) {
            return l.layer->routing_plan(route).shape.pairs();
          },
          "route"_a = "route")
      .def(
          "copy_routed_experts",
          [](const PyCudaCallerForward &l, const std::string &route, uintptr_t dst, size_t bytes, uintptr_t stream) {
            l.dev->make_current();
            l.layer->copy_routed_experts(route, static_cast<CUdeviceptr>(dst), bytes, stream_of(stream));
          },
          "route"_a, "dst"_a, "bytes"_a, "stream"_a = 0)
      .def_prop_ro("outputs", [](const PyCudaCallerForward &l) { return l.compiled->program.outputs; })
      .def_prop_ro("routes",
                   [](const PyCudaCallerForward &l) {
                     std::vector<std::string> names;
                     for (const RoutingNode *r : l.compiled->program.routes)
                       names.push_back(r->name);
                     return names;
                   })
      .def_prop_ro("tokens", [](const PyCudaCallerForward &l) { return l.layer->tokens(); });

  nb::class_<PyCudaTraining>(m, "CudaTrainingLayer",
                             "Forward and backward of a layer on the GPU, bound to `tokens` tokens.")
      .def(nb::init<const Pipeline &, const std::vector<Func> &, const Schedule &, int64_t, int, bool>(), "pipeline"_a,
           "outputs"_a, "schedule"_a, "tokens"_a, "device"_a = 0, "caller_memory"_a = false,
           "caller_memory: the layer holds no memory of its own; each forward is given memory for what it saves "
           "and a workspace, each backward its forward's saved memory (forward(stream, saved, workspace)), and "
           "set_tokens() changes the token count with no compiling.")
      .def(
          "set_tokens",
          [](PyCudaTraining &l, int64_t tokens) {
            l.dev->make_current();
            l.layer->set_tokens(tokens);
          },
          "tokens"_a, "The token count of the next forward or backward (caller memory: any; owned: up to the first).")
      .def(
          "step_memory",
          [](const PyCudaTraining &l, int64_t tokens) {
            const cuda::CudaLayer::StepMemory m = l.layer->step_memory(tokens);
            return nb::make_tuple(m.saved, m.workspace_before, m.workspace_after);
          },
          "tokens"_a,
          "(saved parts, forward workspace, backward workspace) bytes of a step at `tokens` tokens on caller "
          "memory: a list of the saved parts' (the activations', then the small values' and the routing tables'), "
          "each the caller's memory of its own.")
      .def(
          "saved_terms", [](const PyCudaTraining &l) { return size_terms_object(l.layer->saved_terms()); },
          "step_memory()'s saved parts over any token count T: None, or for each part its terms (align, [(bytes, "
          "[(a, b, d, m, c), ...]), ...]): the sum over terms of round_up(sum of bytes * prod((a T + b) // d * m + c), "
          "align).")
      .def(
          "pairs",
          [](const PyCudaTraining &l, const std::string &route) {
            return l.layer->layer().routing_plan(route).shape.pairs();
          },
          "route"_a = "route", "The routed (token, expert) pairs of route `route` at the current token count.")
      .def(
          "copy_routed_experts",
          [](const PyCudaTraining &l, const std::string &route, uintptr_t dst, size_t bytes, uintptr_t stream) {
            l.dev->make_current();
            l.layer->layer().copy_routed_experts(route, static_cast<CUdeviceptr>(dst), bytes, stream_of(stream));
          },
          "route"_a, "dst"_a, "bytes"_a, "stream"_a = 0,
          "The experts the last forward placed chose (int32, pair order) into device memory, on the stream.")
      .def(
          "upload",
          [](PyCudaTraining &l, const nb::dict &inputs) {
            l.dev->make_current();
            l.layer->upload(to_tensor_map(inputs, "input"));
          },
          "inputs"_a, "Every Input and Param of the forward from host arrays (synchronous).")
      .def(
          "upload_upstream_gradient",
          [](PyCudaTraining &l, nb::handle grad, std::optional<std::string> output) {
            l.dev->make_current();
            const std::string name = output.value_or(l.compiled->training.output);
            l.layer->upload_upstream_gradient(name, to_host_tensor(grad, "the upstream gradient of '" + name + "'"));
          },
          "grad"_a, "output"_a = nb::none())
      .def("poison",
           [](PyCudaTraining &l) {
             l.dev->make_current();
             l.layer->poison();
           })
      .def(
          "forward",
          [](PyCudaTraining &l, uintptr_t stream, std::optional<SavedParts> saved, std::optional<uintptr_t> workspace) {
            l.dev->make_current();
            if (saved)
              l.layer->forward(stream_of(stream), *saved, workspace.value_or(0));
            else
              l.layer->forward(stream_of(stream));
          },
          "stream"_a = 0, "saved"_a = nb::none(), "workspace"_a = nb::none(),
          "Enqueues routing and the forward on the stream (a CUstream handle; 0: the legacy one); on caller "
          "memory, its activations go to `saved` (a list: each saved part's address) and its temporaries to "
          "`workspace` (device addresses).")
      .def(
          "check_routing_scores",
          [](PyCudaTraining &l, uintptr_t stream) {
            l.dev->make_current();
            l.layer->check_routing_scores(stream_of(stream), "check_routing_scores()");
          },
          "stream"_a = 0,
          "Raises moeforge.UserError naming the token and expert if a routing score of work queued so far was "
          "NaN or infinite (waits for the stream only then; forward() and backward() check it first). Call it "
          "after waiting for the stream to see the last step's.")
      .def(
          "replay_graphs", [](PyCudaTraining &l, bool on) { l.layer->replay_graphs(on); }, "on"_a = true,
          "Replays the forward and the backward each as one CUDA graph while no tensor was bound elsewhere "
          "(captured again after a bind that moved one; the last few address sets each keep theirs).")
      .def(
          "graph_counts",
          [](const PyCudaTraining &l) {
            const cuda::TrainingLayer::GraphCounts c = l.layer->graph_counts();
            nb::dict d;
            d["replayed"] = c.replayed;
            d["captured"] = c.captured;
            d["eager"] = c.eager;
            return d;
          },
          "How the entry points' calls ran since the layer was made: {'replayed', 'captured', 'eager'} counts "
          "(a training loop at steady addresses replays).")
      .def(
          "backward",
          [](PyCudaTraining &l, uintptr_t stream, std::optional<SavedParts> saved, std::optional<uintptr_t> workspace) {
            l.dev->make_current();
            if (saved)
              l.layer->backward(stream_of(stream), *saved, workspace.value_or(0));
            else
              l.layer->backward(stream_of(stream));
          },
          "stream"_a = 0, "saved"_a = nb::none(), "workspace"_a = nb::none(),
          "Enqueues the backward: every Input's and Param's gradient; on caller memory, reading its forward's "
          "`saved` memory (at that forward's token count).")
      .def(
          "info", [](const PyCudaTraining &l, const std::string &name) { return info_tuple(l.layer->info(name)); },
          "name"_a, "(dtype, shape, contiguous, bytes) of a tensor the layer holds.")
      .def(
          "copy_in",
          [](PyCudaTraining &l, const std::string &name, uintptr_t src, size_t bytes, uintptr_t stream) {
            l.dev->make_current();
            l.layer->copy_in(name, static_cast<CUdeviceptr>(src), bytes, stream_of(stream));
          },
          "name"_a, "src"_a, "bytes"_a, "stream"_a = 0,
          "Device-to-device into an Input, Param or upstream gradient ('d_y'), on the stream.")
      .def(
          "copy_out",
          [](const PyCudaTraining &l, const std::string &name, uintptr_t dst, size_t bytes, uintptr_t stream) {
            l.dev->make_current();
            l.layer->copy_out(name, static_cast<CUdeviceptr>(dst), bytes, stream_of(stream));
          },
          "name"_a, "dst"_a, "bytes"_a, "stream"_a = 0)
      .def(
          "copy_gradient",
          [](const PyCudaTraining &l, const std::string &of, uintptr_t dst, size_t bytes, uintptr_t stream) {
            l.dev->make_current();
            l.layer->copy_gradient(of, static_cast<CUdeviceptr>(dst), bytes, stream_of(stream));
          },
          "of"_a, "dst"_a, "bytes"_a, "stream"_a = 0, "The gradient of Input or Param `of`, device-to-device.")
      .def(
          "bind",
          [](PyCudaTraining &l, const std::string &name, uintptr_t ptr, size_t bytes) {
            l.dev->make_current();
            l.layer->bind(name, static_cast<CUdeviceptr>(ptr), bytes);
          },
          "name"_a, "ptr"_a, "bytes"_a,
          "Reads or writes tensor `name` (an Input, Param, upstream gradient or output) at device memory the "
          "caller owns and keeps alive, with no copy.")
      .def(
          "bind_gradient",
          [](PyCudaTraining &l, const std::string &of, uintptr_t ptr, size_t bytes) {
            l.dev->make_current();
            l.layer->bind_gradient(of, static_cast<CUdeviceptr>(ptr), bytes);
          },
          "of"_a, "ptr"_a, "bytes"_a, "Writes the gradient of Input or Param `of` at device memory the caller owns.")
      .def(
          "output",
          [](const PyCudaTraining &l, std::optional<std::string> name) {
            l.dev->make_current();
            return to_numpy(name ? l.layer->output(*name) : l.layer->output());
          },
          "name"_a = nb::none())
      .def(
          "gradient",
          [](const PyCudaTraining &l, const std::string &name) {
            l.dev->make_current();
            return to_numpy(l.layer->gradient(name));
          },
          "name"_a)
      .def(
          "routed_experts",
          [](const PyCudaTraining &l, const std::string &route) {
            l.dev->make_current();
            return to_numpy(l.layer->routed_experts(route));
          },
          "route"_a = "route", "The experts the last forward chose, pair order (synchronises).")
      .def_prop_ro("saved_bytes", [](const PyCudaTraining &l) { return l.layer->saved_bytes(); })
      .def_prop_ro(
          "written_over_saved", [](const PyCudaTraining &l) { return l.compiled->training.written_over_saved; },
          "{gradient: saved tensor} a backward writes over (gradients_over_saved): on caller memory a forward "
          "then serves one backward.")
      .def_prop_ro("tokens", [](const PyCudaTraining &l) { return l.layer->layer().tokens(); })
      .def_prop_ro("outputs", [](const PyCudaTraining &l) { return l.compiled->training.outputs; })
      .def_prop_ro(
          "routes",
          [](const PyCudaTraining &l) {
            std::vector<std::string> names;
            for (const RoutingNode *r : l.compiled->training.program.routes)
              names.push_back(r->name);
            return names;
          },
          "The names of the layer's routes.")
      .def_prop_ro(
          "backward_reads", [](const PyCudaTraining &l) { return backward_reads(l.compiled->training); },
          "The forward outputs the backward reads.")
      .def_prop_ro("seeds", [](const PyCudaTraining &l) { return l.compiled->training.seeds; })
      .def_prop_ro("gradients", [](const PyCudaTraining &l) { return gradient_names(l.compiled->training); });
}

} // namespace moeforge::python
