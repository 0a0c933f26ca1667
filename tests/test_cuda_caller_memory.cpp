// A training layer on caller memory (LayerMemory::caller), as a layer inside
// a model runs: one compiled program, no memory of its own, each forward
// given memory for what it saves and a workspace, each backward the saved
// memory of its own forward. Several forwards at different token counts are
// in flight before their backwards run in reverse order (activation
// checkpointing, micro-batches); every memory region and output is poisoned
// first; each step's output and gradients are checked against the float64
// reference and, at one count, bit for bit against the same layer on its
// own memory.
#include <doctest/doctest.h>

#include <map>
#include <string>
#include <vector>

#include "backends/cuda/runtime/training_layer.h"
#include "gpu_test.h"
#include "lowering/default_schedule.h"
#include "runtime/memory_plan.h"
#include "runtime/program_shapes.h"
#include "training_compare.h"
#include "user_error.h"

using namespace moeforge;
using namespace moeforge::testing;

namespace {

cuda::DeviceBuffer poisoned(size_t bytes) {
  cuda::DeviceBuffer b(bytes);
  if (bytes)
    b.fill32(cuda::kPoisonNaN);
  return b;
}

// One forward's saved parts (StepMemory::saved), each a buffer of its own
// (poisoned), as a framework allocates them.
struct Saved {
  std::vector<cuda::DeviceBuffer> buffers;
  Saved() = default;
  explicit Saved(const std::vector<size_t> &bytes) {
    for (size_t b : bytes)
      buffers.push_back(poisoned(b));
  }
  SavedParts parts() const {
    SavedParts out;
    for (const cuda::DeviceBuffer &b : buffers)
      out.push_back(b.ptr());
    return out;
  }
};

// What compare_with_reference reads of a layer, downloaded right after its
// step: the outputs and gradients, and the experts the forward chose.
struct Downloaded {
  std::map<std::string, HostTensor> values;
  std::vector<int32_t> experts;
  HostTensor download(const std::string &name) const { return values.at(name); }
  std::vector<int32_t> routed_experts(const std::string &) const { return experts; }
};

// One forward's inputs and memory, held until its backward.
struct InFlight {
  int64_t tokens = 0;
  TensorMap inputs;
  HostTensor dy;
  std::map<std::string, cuda::DeviceBuffer> bound; // x, the upstream gradient, every output and gradient
  Saved saved;
  std::vector<int32_t> experts;
};

class CallerLayer {
public:
  CallerLayer(cuda::Device &device, const cuda::CompiledTraining &compiled, const TensorMap &params)
      : compiled_(compiled), layer_(device, compiled, 1, cuda::LayerMemory::caller) {
    const KernelProgram &p = compiled.training.program;
    ProgramShapes shapes(p, 1);
    for (const auto &[name, value] : params) {
      const TensorDecl &d = p.tensor(name);
      params_.emplace(name, cuda::DeviceBuffer::from(shapes.encode_input(d, params)));
      layer_.bind(name, params_.at(name).ptr(), params_.at(name).bytes());
    }
  }

  // Binds the step's token-sized tensors (made, poisoned, on the first call).
  void bind(InFlight &f) {
    layer_.set_tokens(f.tokens);
    const TrainingProgram &t = compiled_.training;
    ProgramShapes shapes(t.program, f.tokens);
    TensorMap given = f.inputs;
    given[t.seed] = f.dy;
    for (const std::string &name : {std::string("x"), t.seed})
      if (!f.bound.count(name))
        f.bound.emplace(name, cuda::DeviceBuffer::from(shapes.encode_input(t.program.tensor(name), given)));
    for (const std::string &name : t.program.outputs)
      if (!f.bound.count(name))
        f.bound.emplace(name, poisoned(layer_.info(name).bytes));
    for (auto &[name, b] : f.bound)
      layer_.bind(name, b.ptr(), b.bytes());
  }

  void forward(InFlight &f, const std::string &route, const cuda::Stream &stream) {
    bind(f);
    const cuda::CudaLayer::StepMemory m = layer_.step_memory(f.tokens);
    f.saved = Saved(m.saved);
    cuda::DeviceBuffer workspace = poisoned(m.workspace_before);
    layer_.forward(stream, f.saved.parts(), workspace.ptr());
    stream.synchronize(); // before the workspace is freed
    f.experts = layer_.routed_experts(route);
  }

  Downloaded backward(InFlight &f, const cuda::Stream &stream) {
    bind(f);
    cuda::DeviceBuffer workspace = poisoned(layer_.step_memory(f.tokens).workspace_after);
    layer_.backward(stream, f.saved.parts(), workspace.ptr());
    stream.synchronize();
    Downloaded d;
    for (const std::string &name : compiled_.training.program.outputs)
      d.values[name] = layer_.download(name);
    d.experts = f.experts;
    return d;
  }

  cuda::TrainingLayer &layer() { return layer_; }

private:
  const cuda::CompiledTraining &compiled_;
  cuda::TrainingLayer layer_;
  std::map<std::string, cuda::DeviceBuffer> params_;
};

} // namespace

TEST_SUITE("gpu") {
  TEST_CASE("cuda caller memory: forwards in flight at several token counts, each backward on its own forward") {
    MOEFORGE_REQUIRE_GPU();
    static cuda::Device device;
    cuda::Stream stream;
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (const char *p : {"scattermoe", "megablocks", "scattermoe+padded+lean", "scattermoe+padded+lean+over",
                            "scattermoe+padded+lean+over+upstream+boundary"}) {
        INFO(name << " / " << p);
        const Schedule schedule = training_preset(p, false);
        ExampleShape s0 = shape(64, 64, 128, 8, 2);
        Example ex = make_example(name, s0);
        cuda::CompiledTraining compiled =
            cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), schedule, device.arch_specific());
        TensorMap params = ex.random_inputs(s0, 30);
        params.erase("x");
        CallerLayer layer(device, compiled, params);
        std::vector<InFlight> steps;
        for (int64_t tokens : {37, 300, 1, 129}) {
          InFlight f;
          f.tokens = tokens;
          ExampleShape s = shape(tokens, 64, 128, 8, 2);
          f.inputs = ex.random_inputs(s, 31 + tokens);
          for (const auto &[n, v] : params)
            f.inputs[n] = v;
          f.dy = upstream_gradient(ex, f.inputs, 40 + tokens);
          steps.push_back(std::move(f));
        }
        for (InFlight &f : steps)
          layer.forward(f, ex.route, stream);
        // Only what the program outputs survives the step: the comparison
        // skips intermediates as for tensors sharing memory.
        KernelProgram outputs_only = compiled.training.program;
        outputs_only.reuse_memory = true;
        for (auto f = steps.rbegin(); f != steps.rend(); ++f) {
          INFO(f->tokens << " tokens");
          Downloaded got = layer.backward(*f, stream);
          TensorMap given = f->inputs;
          given[compiled.training.seed] = f->dy;
          Outcome o = compare_with_reference(training_example(ex), given, outputs_only, got, schedule.to_text(), 2e-2,
                                             1e-3, schedule.capacity());
          CHECK(o.routing_mismatches == 0);
        }
        // A second backward on the last one's memory: the same gradients;
        // refused where the first wrote over what the forward saved, until
        // the forward runs again.
        if (!compiled.training.written_over_saved.empty()) {
          CHECK_THROWS_WITH_AS(layer.backward(steps.front(), stream), doctest::Contains("run the forward again"),
                               UserError);
          layer.forward(steps.front(), ex.route, stream);
        }
        Downloaded again = layer.backward(steps.front(), stream);
        if (!compiled.training.written_over_saved.empty())
          layer.forward(steps.front(), ex.route, stream);
        Downloaded once = layer.backward(steps.front(), stream);
        for (const auto &[n, v] : once.values) {
          INFO(n);
          CHECK(max_normalized_error(again.values.at(n), v) < 1e-5);
        }
      }
  }

  TEST_CASE("cuda caller memory: the same step as on the layer's own memory, bit for bit") {
    MOEFORGE_REQUIRE_GPU();
    static cuda::Device device;
    cuda::Stream stream;
    ExampleShape s = shape(300, 64, 128, 8, 2);
    Example ex = make_example("swiglu_moe", s);
    for (const char *preset_name : {"scattermoe+padded+lean", "scattermoe+padded+lean+over"}) {
      INFO(preset_name);
      const Schedule schedule = training_preset(preset_name, false);
      cuda::CompiledTraining compiled =
          cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), schedule, device.arch_specific());
      TensorMap inputs = ex.random_inputs(s, 50);
      HostTensor dy = upstream_gradient(ex, inputs, 51);

      cuda::TrainingLayer owned(device, compiled, s.tokens);
      owned.upload(inputs);
      owned.poison();
      owned.upload_upstream_gradient(dy);
      owned.forward(stream);
      owned.backward(stream);
      stream.synchronize();

      TensorMap params = inputs;
      params.erase("x");
      CallerLayer caller(device, compiled, params);
      InFlight f;
      f.tokens = s.tokens;
      f.inputs = inputs;
      f.dy = dy;
      caller.forward(f, ex.route, stream);
      Downloaded got = caller.backward(f, stream);
      CHECK(got.values.at("y").data == owned.output().data);
      for (const char *w : {"x", "w1", "w3", "w2"}) {
        INFO(w);
        CHECK(got.values.at(compiled.training.gradient_of(w)).data == owned.gradient(w).data);
      }
      // d_wr's K slices add in whatever order they finish.
      CHECK(max_normalized_error(got.values.at("d_wr"), owned.gradient("wr")) < 1e-5);
      // What a step needs: the saved region is what the forward keeps (and the
      // routing tables, a little larger for their alignment and scratch).
      const cuda::CudaLayer::StepMemory m = caller.layer().step_memory(s.tokens);
      CHECK(m.saved_bytes() >= static_cast<size_t>(saved_bytes(compiled.training, s.tokens)));
      CHECK(m.saved_bytes() <= static_cast<size_t>(saved_bytes(compiled.training, s.tokens)) + 64 * 1024);
      CHECK(m.saved_bytes() + std::max(m.workspace_before, m.workspace_after) < owned.layer().activation_bytes());
    }
  }

  TEST_CASE("cuda caller memory: misuse is a user error that says what to call") {
    MOEFORGE_REQUIRE_GPU();
    static cuda::Device device;
    cuda::Stream stream;
    ExampleShape s = shape(64, 64, 128, 8, 2);
    Example ex = make_example("moe_mlp", s);
    cuda::CompiledTraining compiled =
        cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), preset("scattermoe"), device.arch_specific());
    TensorMap params = ex.random_inputs(s, 60);
    params.erase("x");
    CallerLayer caller(device, compiled, params);
    cuda::TrainingLayer &l = caller.layer();
    CHECK_THROWS_WITH_AS(l.forward(stream), doctest::Contains("runs on caller memory; call forward(stream, saved"),
                         UserError);
    CHECK_THROWS_WITH_AS(l.set_tokens(0), doctest::Contains("at least one token"), UserError);
    l.set_tokens(64);
    const cuda::CudaLayer::StepMemory m = l.step_memory(64);
    const Saved saved_memory(m.saved);
    const SavedParts saved = saved_memory.parts();
    cuda::DeviceBuffer workspace(m.workspace_before + m.workspace_after);
    SavedParts misaligned = saved;
    misaligned.back() += 16;
    CHECK_THROWS_WITH_AS(l.forward(stream, misaligned, workspace.ptr()), doctest::Contains("256-byte aligned"),
                         UserError);
    CHECK_THROWS_WITH_AS(l.forward(stream, SavedParts(saved.begin() + 1, saved.end()), workspace.ptr()),
                         doctest::Contains("saved parts given"), UserError);
    // x and y are not bound at this count yet.
    CHECK_THROWS_WITH_AS(l.forward(stream, saved, workspace.ptr()), doctest::Contains("'x'"), UserError);
    InFlight f;
    f.tokens = 64;
    f.inputs = ex.random_inputs(s, 61);
    f.dy = upstream_gradient(ex, f.inputs, 62);
    caller.bind(f);
    CHECK_THROWS_WITH_AS(l.backward(stream, saved, workspace.ptr()),
                         doctest::Contains("no forward at 64 tokens wrote its activations"), UserError);
    // An intermediate of the workspace (as the plan places them) has no value
    // to read after its step.
    ProgramShapes shapes(compiled.training.program, 64);
    const StepMemoryPlan plan = plan_step_memory(
        compiled.training.program,
        [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); },
        compiled.training.forward_steps);
    REQUIRE(!plan.workspace.offset.empty());
    CHECK_THROWS_WITH_AS(l.layer().download(plan.workspace.offset.begin()->first),
                         doctest::Contains("lives in the workspace"), UserError);
    cuda::TrainingLayer owned(device, compiled, 64);
    CHECK_THROWS_WITH_AS(owned.forward(stream, saved, workspace.ptr()), doctest::Contains("holds memory of its own"),
                         UserError);
  }

  TEST_CASE("cuda caller memory: the forward alone at any token count through one program, replayed from a graph") {
    MOEFORGE_REQUIRE_GPU();
    static cuda::Device device;
    cuda::Stream stream;
    for (const char *name : {"moe_mlp", "swiglu_moe"}) {
      INFO(name);
      const ExampleShape s0 = shape(64, 64, 128, 8, 2);
      Example ex = make_example(name, s0);
      const Schedule schedule = default_schedule(ex.pipeline);
      cuda::CompiledLayer compiled = cuda::compile_layer(ex.pipeline, schedule, device.arch_specific());
      const KernelProgram &p = compiled.program;
      TensorMap params = ex.random_inputs(s0, 80);
      params.erase("x");
      cuda::CudaLayer layer(device, compiled, 1, 0, cuda::LayerMemory::caller);
      std::map<std::string, cuda::DeviceBuffer> held;
      for (const auto &[n, v] : params) {
        held.emplace(n, cuda::DeviceBuffer::from(ProgramShapes(p, 1).encode_input(p.tensor(n), params)));
        layer.bind(n, held.at(n).ptr(), held.at(n).bytes());
      }
      KernelProgram outputs_only = p; // only the outputs outlive the call
      outputs_only.reuse_memory = true;
      for (int64_t tokens : {1, 2, 3, 7, 64, 255, 4096}) {
        INFO(tokens << " tokens");
        layer.set_tokens(tokens);
        TensorMap inputs = ex.random_inputs(shape(tokens, 64, 128, 8, 2), 81 + tokens);
        for (const auto &[n, v] : params)
          inputs[n] = v;
        cuda::DeviceBuffer x = cuda::DeviceBuffer::from(ProgramShapes(p, tokens).encode_input(p.tensor("x"), inputs));
        layer.bind("x", x.ptr(), x.bytes());
        std::map<std::string, cuda::DeviceBuffer> outs;
        for (const std::string &o : p.outputs) {
          outs.emplace(o, poisoned(layer.info(o).bytes));
          layer.bind(o, outs.at(o).ptr(), outs.at(o).bytes());
        }
        const cuda::CudaLayer::StepMemory m = layer.step_memory(tokens);
        CHECK(m.workspace_before == 0); // a forward alone runs every step from its boundary, 0
        CHECK(m.saved.size() == 1);     // the routing tables alone
        const Saved saved(m.saved);
        cuda::DeviceBuffer workspace = poisoned(m.workspace_after);
        layer.place(saved.parts(), workspace.ptr());
        layer.enqueue(stream);
        stream.synchronize();
        Downloaded got;
        for (const std::string &o : p.outputs)
          got.values[o] = layer.download(o);
        got.experts = layer.routed_experts(ex.route);
        Outcome o = compare_with_reference(ex, inputs, outputs_only, got, schedule.to_text(), 2e-2, 1e-3);
        CHECK(o.routing_mismatches == 0);
        if (tokens == 64) { // captured once, replayed on poisoned outputs: the same bits
          cuda::CudaGraph graph = cuda::CudaGraph::capture(stream, [&] { layer.enqueue(stream); });
          for (auto &[n, b] : outs)
            b.fill32(cuda::kPoisonNaN);
          graph.launch(stream);
          stream.synchronize();
          for (const std::string &n : p.outputs) {
            INFO(n);
            CHECK(layer.download(n).data == got.values.at(n).data);
          }
        }
      }
    }
  }
}
