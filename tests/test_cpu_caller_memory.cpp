// A CPU training layer on caller memory (LayerMemory::caller), as a layer
// inside a model runs: one compiled program, no memory of its own for its
// intermediates, each forward given memory for what it saves (with its
// routing tables) and a workspace, each backward the saved memory of its own
// forward. The GPU runs the same memory plan (plan_step_memory), so these
// tests check the plan with real kernels on every CI run: a plan that let
// two live tensors share bytes, or left a saved tensor in the workspace,
// gives a wrong gradient here. Every region is poisoned (NaN) before each
// call. The forward alone (inference: boundary 0) keeps nothing but its
// routing tables.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backends/cpu/cpu_layer.h"
#include "backends/cpu/cpu_training.h"
#include "lowering/default_schedule.h"
#include "runtime/memory_plan.h"
#include "runtime/routing_format.h"
#include "training_compare.h"
#include "user_error.h"

using namespace moeforge;
using namespace moeforge::testing;

namespace {

// Host memory as a framework's allocator hands it out: 64-byte aligned,
// filled with a pattern that reads as NaN in f32 and in bf16.
class Region {
public:
  explicit Region(size_t bytes) : bytes_(bytes) {
    if (bytes == 0)
      return;
    const size_t rounded = (bytes + 63) / 64 * 64;
    p_.reset(static_cast<uint8_t *>(std::aligned_alloc(64, rounded)));
    REQUIRE(p_ != nullptr);
    poison();
  }
  void poison() {
    const uint32_t nan = 0x7FC07FC0u;
    for (size_t at = 0; at + 4 <= bytes_; at += 4)
      std::memcpy(p_.get() + at, &nan, 4);
  }
  uint8_t *get() const { return p_.get(); }
  size_t bytes() const { return bytes_; }

private:
  struct Free {
    void operator()(uint8_t *p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> p_;
  size_t bytes_ = 0;
};

// One forward's saved parts (StepMemory::saved), each a Region of its own,
// as a framework allocates them.
class Saved {
public:
  Saved() = default;
  explicit Saved(const std::vector<size_t> &bytes) {
    for (size_t b : bytes)
      regions_.push_back(std::make_unique<Region>(b));
  }
  SavedParts parts() const {
    SavedParts out;
    for (const auto &r : regions_)
      out.push_back(reinterpret_cast<uintptr_t>(r->get()));
    return out;
  }

private:
  std::vector<std::unique_ptr<Region>> regions_;
};

// What compare_with_reference reads of a layer, taken right after its step.
struct Downloaded {
  std::map<std::string, HostTensor> values;
  std::vector<int32_t> experts;
  HostTensor download(const std::string &name) const { return values.at(name); }
  std::vector<int32_t> routed_experts(const std::string &) const { return experts; }
};

// A training preset (training_compare.h), or "default": the layer's default
// schedule, the one whose backward writes over what its forward saved.
Schedule schedule_for(const Example &ex, const std::string &name) {
  return name == "default" ? default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)})
                           : training_preset(name, false);
}

// One forward's inputs and memory, held until its backward.
struct InFlight {
  int64_t tokens = 0;
  TensorMap inputs;
  HostTensor dy;
  std::map<std::string, std::vector<uint8_t>> bound; // x, the upstream gradient, every output and gradient
  Saved saved;
  std::vector<int32_t> experts;
  std::map<std::string, HostTensor> outputs; // the forward's, taken as it returns
};

class CallerLayer {
public:
  CallerLayer(const cpu::CompiledCpuTraining &compiled, const TensorMap &params)
      : compiled_(compiled), layer_(compiled, 1, LayerMemory::caller) {
    const KernelProgram &p = compiled.training.program;
    ProgramShapes shapes(p, 1);
    for (const auto &[name, value] : params) {
      params_[name] = shapes.encode_input(p.tensor(name), params);
      layer_.bind(name, params_[name].data(), params_[name].size());
    }
  }

  // Binds the step's token-sized tensors (made, outputs poisoned, on the
  // first call).
  void bind(InFlight &f) {
    layer_.set_tokens(f.tokens);
    const TrainingProgram &t = compiled_.training;
    ProgramShapes shapes(t.program, f.tokens);
    TensorMap given = f.inputs;
    given[t.seed] = f.dy;
    for (const std::string &name : {std::string("x"), t.seed})
      if (!f.bound.count(name))
        f.bound[name] = shapes.encode_input(t.program.tensor(name), given);
    for (const std::string &name : t.program.outputs)
      if (!f.bound.count(name))
        f.bound[name].assign(layer_.info(name).bytes, 0xFF); // NaN in f32 and bf16
    for (auto &[name, b] : f.bound)
      layer_.bind(name, b.data(), b.size());
  }

  void forward(InFlight &f, const std::string &route) {
    bind(f);
    const StepMemory m = layer_.step_memory(f.tokens);
    f.saved = Saved(m.saved);
    Region workspace(m.workspace_before);
    layer_.forward(f.saved.parts(), workspace.get());
    f.experts = layer_.routed_experts(route);
    for (const std::string &name : compiled_.training.outputs)
      f.outputs[name] = layer_.download(name);
  }

  Downloaded backward(InFlight &f) {
    bind(f);
    Region workspace(layer_.step_memory(f.tokens).workspace_after);
    layer_.backward(f.saved.parts(), workspace.get());
    Downloaded d;
    d.values = f.outputs;
    for (const std::string &name : compiled_.training.gradients)
      d.values[name] = layer_.download(name);
    d.experts = f.experts;
    return d;
  }

  cpu::CpuTrainingLayer &layer() { return layer_; }

private:
  const cpu::CompiledCpuTraining &compiled_;
  cpu::CpuTrainingLayer layer_;
  std::map<std::string, std::vector<uint8_t>> params_;
};

} // namespace

TEST_CASE("cpu caller memory: forwards in flight at several token counts, each backward on its own forward") {
  for (const char *name : {"moe_mlp", "swiglu_moe"})
    for (const char *p :
         {"scattermoe", "megablocks", "scattermoe+padded+lean", "megablocks+chain+atomic+gather", "default"}) {
      INFO(name << " / " << p);
      const Schedule schedule = schedule_for(make_example(name, shape(64, 64, 128, 8, 2)), p);
      ExampleShape s0 = shape(64, 64, 128, 8, 2);
      Example ex = make_example(name, s0);
      cpu::CompiledCpuTraining compiled = cpu::compile_cpu_training(ex.pipeline, ex.pipeline.func(ex.output), schedule);
      TensorMap params = ex.random_inputs(s0, 30);
      params.erase("x");
      CallerLayer layer(compiled, params);
      std::vector<InFlight> steps;
      for (int64_t tokens : {37, 300, 1, 129}) {
        InFlight f;
        f.tokens = tokens;
        f.inputs = ex.random_inputs(shape(tokens, 64, 128, 8, 2), 31 + tokens);
        for (const auto &[n, v] : params)
          f.inputs[n] = v;
        f.dy = upstream_gradient(ex, f.inputs, 40 + tokens);
        steps.push_back(std::move(f));
      }
      for (InFlight &f : steps)
        layer.forward(f, ex.route);
      // Only what the program outputs survives a step: the comparison skips
      // intermediates, as for tensors sharing memory.
      KernelProgram outputs_only = compiled.training.program;
      outputs_only.reuse_memory = true;
      for (auto f = steps.rbegin(); f != steps.rend(); ++f) {
        INFO(f->tokens << " tokens");
        Downloaded got = layer.backward(*f);
        TensorMap given = f->inputs;
        given[compiled.training.seed] = f->dy;
        Outcome o = compare_with_reference(training_example(ex), given, outputs_only, got, schedule.to_text(), 2e-2,
                                           1e-3, schedule.capacity());
        CHECK(o.routing_mismatches == 0);
      }
      // A second backward on one forward's memory: the same gradients where
      // the first left what the forward saved; refused where it wrote over
      // it, until the forward runs again.
      if (!compiled.training.written_over_saved.empty()) {
        CHECK_THROWS_WITH_AS(layer.backward(steps.front()), doctest::Contains("run the forward again"), UserError);
        layer.forward(steps.front(), ex.route);
      }
      Downloaded once = layer.backward(steps.front());
      if (!compiled.training.written_over_saved.empty())
        layer.forward(steps.front(), ex.route);
      Downloaded again = layer.backward(steps.front());
      for (const auto &[n, v] : once.values) {
        INFO(n);
        CHECK(again.values.at(n).data == v.data);
      }
    }
}

TEST_CASE("cpu caller memory: the same step as on the layer's own memory, bit for bit") {
  ExampleShape s = shape(300, 64, 128, 8, 2);
  for (const char *name : {"swiglu_moe", "moe_mlp", "deepseek_moe"})
    for (const char *preset_name :
         {"scattermoe", "scattermoe+padded+lean", "scattermoe+padded+lean+over+split", "megablocks+chain+atomic"}) {
      INFO(name << " / " << preset_name);
      Example ex = make_example(name, s);
      const Schedule schedule = training_preset(preset_name, false);
      cpu::CompiledCpuTraining compiled = cpu::compile_cpu_training(ex.pipeline, ex.pipeline.func(ex.output), schedule);
      TensorMap inputs = ex.random_inputs(s, 50);
      HostTensor dy = upstream_gradient(ex, inputs, 51);

      cpu::CpuTrainingLayer owned(compiled, s.tokens);
      owned.upload(inputs);
      owned.poison();
      owned.upload_upstream_gradient(dy);
      owned.forward();
      owned.backward();

      TensorMap params = inputs;
      params.erase("x");
      CallerLayer caller(compiled, params);
      InFlight f;
      f.tokens = s.tokens;
      f.inputs = inputs;
      f.dy = dy;
      caller.forward(f, ex.route);
      Downloaded got = caller.backward(f);
      for (const std::string &n : compiled.training.program.outputs) { // the outputs and every gradient
        INFO(n);
        CHECK(got.values.at(n).data == owned.download(n).data);
      }
      // Some intermediates were scratch in the outputs' memory before those
      // were written (runtime/memory_plan.h, InOutput::scratch): they too
      // gave these values.
      {
        ProgramShapes at(compiled.training.program, s.tokens);
        const StepMemoryPlan plan = plan_step_memory(
            compiled.training.program,
            [&](const TensorDecl &t) { return static_cast<size_t>(at.elements(t)) * dtype_bytes(t.dtype); },
            compiled.training.forward_steps);
        CHECK(std::any_of(plan.in_output.begin(), plan.in_output.end(),
                          [](const auto &entry) { return entry.second.scratch; }));
      }
      // What a step needs: the saved parts are what the forward keeps (the
      // activations, then the small values with the routing tables); saved
      // and workspace together less than every intermediate one buffer each.
      const StepMemory m = caller.layer().step_memory(s.tokens);
      CHECK(m.saved_bytes() >= static_cast<size_t>(saved_bytes(compiled.training, s.tokens)));
      CHECK(m.saved_bytes() <= static_cast<size_t>(saved_bytes(compiled.training, s.tokens)) + 64 * 1024);
      const CallerMemoryLayout layout =
          caller_memory_layout(compiled.training.program, ProgramShapes(compiled.training.program, s.tokens),
                               compiled.training.forward_steps, routing_table_bytes);
      REQUIRE(m.saved.size() == 2);
      for (const auto &[name, at] : layout.saved_at)
        CHECK(at.second + layout.plan.saved.size.at(name) <= m.saved.at(at.first));
      size_t separate = 0;
      ProgramShapes shapes(compiled.training.program, s.tokens);
      for (const TensorDecl &t : compiled.training.program.tensors)
        if (!t.is_input)
          separate += static_cast<size_t>(shapes.elements(t)) * dtype_bytes(t.dtype);
      CHECK(m.saved_bytes() + std::max(m.workspace_before, m.workspace_after) < separate);
    }
}

TEST_CASE("cpu caller memory: misuse is a user error that says what to call") {
  ExampleShape s = shape(64, 64, 128, 8, 2);
  Example ex = make_example("swiglu_moe", s);
  const Schedule schedule = schedule_for(ex, "default");
  cpu::CompiledCpuTraining compiled = cpu::compile_cpu_training(ex.pipeline, ex.pipeline.func(ex.output), schedule);
  TensorMap params = ex.random_inputs(s, 60);
  params.erase("x");
  CallerLayer caller(compiled, params);
  cpu::CpuTrainingLayer &l = caller.layer();
  CHECK_THROWS_WITH_AS(l.forward(), doctest::Contains("runs on caller memory; call forward(saved, workspace)"),
                       UserError);
  CHECK_THROWS_WITH_AS(l.set_tokens(0), doctest::Contains("at least one token"), UserError);
  l.set_tokens(64);
  const StepMemory m = l.step_memory(64);
  const Saved saved_memory(m.saved);
  const SavedParts saved = saved_memory.parts();
  Region workspace(m.workspace_before + m.workspace_after);
  SavedParts misaligned = saved, missing = saved, one_short(saved.begin(), saved.end() - 1);
  misaligned[0] += 16;
  missing[0] = 0;
  CHECK_THROWS_WITH_AS(l.forward(misaligned, workspace.get()),
                       doctest::Contains("saved part 0 must start at a 64-byte"), UserError);
  CHECK_THROWS_WITH_AS(l.forward(missing, workspace.get()), doctest::Contains("has no memory (address 0)"), UserError);
  const std::string count_words = std::to_string(saved.size() - 1) + " saved parts given; this layer's forward saves " +
                                  std::to_string(saved.size());
  CHECK_THROWS_WITH_AS(l.forward(one_short, workspace.get()), doctest::Contains(count_words.c_str()), UserError);
  CHECK_THROWS_WITH_AS(l.forward(saved, workspace.get() + 16), doctest::Contains("workspace must start at a 64-byte"),
                       UserError);
  // x is not bound or uploaded at this count yet.
  CHECK_THROWS_WITH_AS(l.forward(saved, workspace.get()), doctest::Contains("'x'"), UserError);
  InFlight f;
  f.tokens = 64;
  f.inputs = ex.random_inputs(s, 61);
  for (const auto &[n, v] : params)
    f.inputs[n] = v;
  f.dy = upstream_gradient(ex, f.inputs, 62);
  caller.bind(f);
  CHECK_THROWS_WITH_AS(l.backward(saved, workspace.get()),
                       doctest::Contains("no forward at 64 tokens wrote its activations"), UserError);
  l.forward(saved, workspace.get());
  REQUIRE(!compiled.training.written_over_saved.empty());
  const std::string over = compiled.training.written_over_saved.begin()->second;
  CHECK_NOTHROW(l.download(over)); // what the forward saved, until the backward writes over it
  // Another count's backward on this forward's memory.
  l.set_tokens(65);
  CHECK_THROWS_WITH_AS(l.backward(saved, workspace.get()),
                       doctest::Contains("no forward at 65 tokens wrote its activations"), UserError);
  l.set_tokens(64);
  // A workspace intermediate has no value after its call; a saved one the
  // backward writes over is refused once it ran.
  const ProgramShapes shapes(compiled.training.program, 64);
  const StepMemoryPlan plan = plan_step_memory(
      compiled.training.program, [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); },
      compiled.training.forward_steps);
  REQUIRE(!plan.workspace.offset.empty());
  CHECK_THROWS_WITH_AS(l.download(plan.workspace.offset.begin()->first), doctest::Contains("lives in the workspace"),
                       UserError);
  caller.bind(f);
  l.backward(saved, workspace.get());
  CHECK_THROWS_WITH_AS(l.download(over), doctest::Contains("the backward wrote a gradient over it"), UserError);
  // An intermediate is placed, never bound; a bind of the wrong size says both.
  CHECK_THROWS_WITH_AS(l.bind(plan.workspace.offset.begin()->first, workspace.get(), 4),
                       doctest::Contains("is an intermediate"), UserError);
  std::vector<uint8_t> small(8);
  CHECK_THROWS_WITH_AS(l.bind("x", small.data(), small.size()), doctest::Contains("8 bytes at"), UserError);
  // The layer's own memory takes the other calls.
  cpu::CpuTrainingLayer owned(compiled, 64);
  CHECK_THROWS_WITH_AS(owned.forward(saved, workspace.get()), doctest::Contains("holds memory of its own"), UserError);
  CHECK_THROWS_WITH_AS(owned.step_memory(64), doctest::Contains("holds memory of its own"), UserError);
  CHECK_THROWS_WITH_AS(owned.set_tokens(32), doctest::Contains("make a layer for another count"), UserError);
}

TEST_CASE("cpu caller memory: the forward alone at any token count through one program, keeping nothing") {
  for (const char *name : {"moe_mlp", "swiglu_moe", "deepseek_moe"}) {
    INFO(name);
    const ExampleShape s0 = shape(64, 64, 128, 8, 2);
    Example ex = make_example(name, s0);
    const Schedule schedule = default_schedule(ex.pipeline);
    cpu::CompiledCpuLayer compiled = cpu::compile_cpu_layer(ex.pipeline, schedule);
    const KernelProgram &p = compiled.program;
    TensorMap params = ex.random_inputs(s0, 70);
    params.erase("x");
    cpu::CpuLayer layer(compiled, 1, 0, LayerMemory::caller);
    std::map<std::string, std::vector<uint8_t>> held;
    for (const auto &[n, v] : params) {
      held[n] = ProgramShapes(p, 1).encode_input(p.tensor(n), params);
      layer.bind(n, held[n].data(), held[n].size());
    }
    KernelProgram outputs_only = p; // only the outputs outlive the call
    outputs_only.reuse_memory = true;
    for (int64_t tokens : {1, 2, 3, 7, 64, 255, 4096}) {
      INFO(tokens << " tokens");
      layer.set_tokens(tokens);
      TensorMap inputs = ex.random_inputs(shape(tokens, 64, 128, 8, 2), 71 + tokens);
      for (const auto &[n, v] : params)
        inputs[n] = v;
      std::vector<uint8_t> x = ProgramShapes(p, tokens).encode_input(p.tensor("x"), inputs);
      layer.bind("x", x.data(), x.size());
      std::map<std::string, std::vector<uint8_t>> outs;
      for (const std::string &o : p.outputs) {
        outs[o].assign(layer.info(o).bytes, 0xFF); // NaN in f32 and bf16
        layer.bind(o, outs[o].data(), outs[o].size());
      }
      const StepMemory m = layer.step_memory(tokens);
      // Nothing kept: the saved region holds the routing tables alone.
      size_t tables = 0;
      const ProgramShapes shapes(p, tokens);
      for (const auto &[r, shape] : shapes.routings())
        tables += (routing_table_bytes(shape) + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment;
      CHECK(m.saved == std::vector<size_t>{tables});
      CHECK(m.workspace_before == 0);
      const Saved saved(m.saved);
      Region workspace(m.workspace_after);
      layer.place(saved.parts(), workspace.get());
      layer.run();
      Downloaded got;
      for (const std::string &o : p.outputs)
        got.values[o] = layer.download(o);
      if (!ex.route.empty())
        got.experts = layer.routed_experts(ex.route);
      Outcome o = compare_with_reference(ex, inputs, outputs_only, got, schedule.to_text(), 2e-2, 1e-3);
      CHECK(o.routing_mismatches == 0);
    }
    CHECK_THROWS_WITH_AS(layer.set_tokens(0), doctest::Contains("at least one token"), UserError);
  }
}
