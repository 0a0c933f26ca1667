// Schedule::split_pointwise_for_memory (lowering/split_for_memory.h): an
// element-wise output merged beside outputs it does not need runs as a
// kernel of its own where that lowers the backward's peak. The values are
// checked on the CPU backend in test_cpu_training.cpp ("+split" presets) and
// on the GPU in test_cuda_training.cpp; here, what the program becomes.
#include <doctest/doctest.h>

#include <algorithm>

#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/training.h"
#include "program_order.h"
#include "runtime/memory_plan.h"
#include "runtime/program_shapes.h"

using namespace moeforge;

namespace {

struct Lowered {
  TrainingProgram t;
  size_t workspace_after = 0;
};

Lowered lowered(const ExampleShape &s, bool split) {
  Example ex = make_example("swiglu_moe", s);
  const Func out = ex.pipeline.func(ex.output);
  Schedule sch = default_schedule(ex.pipeline, {out});
  // Over the backward's own tensors (what the split was measured on; over
  // the saved ones: test_gradients_over_saved.cpp), dy's rows copied per
  // pair, as the split was measured.
  sch.split_pointwise_for_memory(split).gradients_over_saved(false).gather_upstream_in_gemms(false);
  Lowered l{lower_training(ex.pipeline, out, sch), 0};
  ProgramShapes shapes(l.t.program, s.tokens);
  auto bytes = [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); };
  // Without scratch in the outputs, so that the split's own effect shows.
  l.workspace_after = plan_step_memory(l.t.program, bytes, l.t.forward_steps, 256, OutputScratch::off).workspace_after;
  return l;
}

long index_of(const KernelProgram &p, const std::string &step) {
  for (size_t i = 0; i < p.steps.size(); ++i)
    if (step_name(p.steps[i]) == step)
      return static_cast<long>(i);
  return -1;
}

} // namespace

TEST_CASE("split for memory: mixtral's gated h is made, read by dW2 and freed before dA exists") {
  const ExampleShape s = testing::shape(8192, 4096, 14336, 8, 2); // mixtral
  const Lowered merged = lowered(s, false), split = lowered(s, true);
  const KernelProgram &p = split.t.program;
  CHECK(testing::reads_follow_writes(p));
  // Merged: one kernel writes the activation gradients and the gated h.
  CHECK(index_of(merged.t.program, "pointwise_d_x_s_a_d_route_gate_d_x_s_a2_h_gated") >= 0);
  // Split: the gated h alone, then dW2, then the dA GEMM and the kernel
  // that makes the activation gradients from it.
  const long h_gated = index_of(p, "pointwise_h_gated"), d_w2 = index_of(p, "gemm_d_w2"), d_h = index_of(p, "gemm_d_h"),
             grads = index_of(p, "pointwise_d_x_s_a_d_route_gate_d_x_s_a2");
  REQUIRE(h_gated >= 0);
  REQUIRE(grads >= 0);
  CHECK(h_gated < d_w2);
  CHECK(d_w2 < d_h);
  CHECK(d_h < grads);
  // The same kernels otherwise: one step more.
  CHECK(p.steps.size() == merged.t.program.steps.size() + 1);
  auto sorted = [](std::vector<std::string> v) {
    std::sort(v.begin(), v.end());
    return v;
  };
  CHECK(sorted(split.t.saved) == sorted(merged.t.saved));
  // The peak lost a T k x f bf16 tensor's worth, less the width-d tensors
  // that now set it (x's padded rows and the input gradient's pair rows,
  // 136 MiB each): 1564 -> 1224 MiB.
  const size_t mib = size_t(1) << 20;
  CHECK(merged.workspace_after > 1500 * mib);
  CHECK(split.workspace_after <= merged.workspace_after - 300 * mib);
}

TEST_CASE("split for memory: no backward workspace grows, SwiGLU or GeLU, at four shapes") {
  // The split is kept only where the steps' best order then holds fewer
  // bytes at once (where none does, the default leaves the choice out);
  // the memory plan places them, so check what it places.
  for (const char *example : {"moe_mlp", "swiglu_moe"})
    for (const ExampleShape &s : {testing::shape(16384, 1024, 4096, 64, 1), testing::shape(16384, 2048, 768, 128, 8),
                                  testing::shape(8192, 2880, 2880, 128, 4), testing::shape(37, 64, 128, 8, 2)}) {
      Example ex = make_example(example, s);
      const Func out = ex.pipeline.func(ex.output);
      Schedule sch = default_schedule(ex.pipeline, {out});
      INFO(std::string(example) << " T " << s.tokens << " f " << s.f);
      auto workspace = [&](bool split) {
        TrainingProgram t = lower_training(ex.pipeline, out, Schedule(sch).split_pointwise_for_memory(split));
        CHECK(testing::reads_follow_writes(t.program));
        ProgramShapes shapes(t.program, s.tokens);
        auto bytes = [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); };
        return plan_step_memory(t.program, bytes, t.forward_steps, 256, OutputScratch::off).workspace_after;
      };
      CHECK(workspace(true) <= workspace(false));
    }
}
