// Attention over the tokens on the CUDA backend: Mixture-of-Attention (heads
// as experts, keys and values shared) and plain softmax attention. Their
// scores p(r, u) have one column per token, so the GEMMs making them (and
// their gradients) have a column extent known at run time, and the rows of
// p, its gradients and their transposes have a run-time length: each such
// intermediate's rows are padded to 8 elements (stride8), the GEMMs read
// B^T by guarded rows and zero-fill A's elements past K. Without a GPU: the
// plans and the kernels compiling for sm_90a without spills; on a GPU: the
// forward and the training step against the float64 reference at token
// counts that are no multiple of 8, outputs poisoned.
#include <doctest/doctest.h>

#include <string>

#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/layer.h"
#include "backends/cuda/runtime/stream.h"
#include "backends/cuda/runtime/training_layer.h"
#include "cuda_forward_compare.h"
#include "cuda_resources.h"
#include "cuda_training_step.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/gemm_plan.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "program_steps.h"
#include "schedules/presets.h"
#include "tests/gpu_test.h"
#include "training_compare.h"

using namespace moeforge;
using testing::gemm_writing;

namespace {

ExampleShape attention_shape(int64_t tokens) { return testing::shape(tokens, 64, 32, 8, 2); }

// A training schedule by name: a preset as training_preset makes it, or
// "default", the layer's default training schedule (what `moeforge train`
// and MoELayer run without one).
Schedule training_schedule(const Example &ex, const std::string &name) {
  return name == "default" ? default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)})
                           : testing::training_preset(name, false);
}

} // namespace

TEST_CASE("cuda attention: the scores' GEMM plans a run-time column count, its rows padded to 8") {
  Example ex = make_example("moa", attention_shape(37));
  KernelProgram p = lower(ex.pipeline, preset("scattermoe"));
  const GemmStep &scores = gemm_writing(p, "p_s");
  REQUIRE(scores.n.is_dynamic());
  REQUIRE(scores.plan != nullptr);
  // B = key^T read by rows (no tensor map has a run-time shape here), the
  // output's rows padded.
  CHECK(scores.plan->b_load == OperandLoad::cp_async);
  CHECK(scores.plan->store != TileStore::tma);
  CHECK(p.tensor("p_s").stride8);
  CHECK(p.tensor("p").stride8);
  // Rows of a static length stay dense, and so do the caller's tensors.
  CHECK_FALSE(p.tensor("q").stride8);
  CHECK_FALSE(p.tensor("x").stride8);
  CHECK_FALSE(p.tensor("y").stride8);
  // The training step's transposed scores and score gradients too.
  TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), preset("scattermoe"));
  for (const char *name : {"p_s", "p", "d_p", "d_q_a", "d_key_a", "p_T", "x_T"}) {
    INFO(std::string(name));
    CHECK(t.program.tensor(name).stride8);
  }
}

TEST_CASE("cuda attention: moa and attention compile for sm_90a without spills, forward and training") {
  for (const char *name : {"moa", "attention"})
    for (const char *p : {"megablocks", "scattermoe"}) {
      Example ex = make_example(name, attention_shape(37));
      const std::string what = std::string(name) + " / " + p;
      cuda::CompiledLayer f = cuda::compile_layer(ex.pipeline, preset(p));
      testing::check_resources(f, what);
      // The run-time column count and the padded row stride.
      const std::string src = f.source.source;
      CHECK(src.find("const int N = (int)") != std::string::npos);
      CHECK(src.find("const long long LDC = (N + 7) / 8 * 8;") != std::string::npos);
    }
  // The training schedules the GPU case below runs.
  for (const char *name : {"moa", "attention"})
    for (const char *p : {"megablocks", "scattermoe+lean", "default"}) {
      Example ex = make_example(name, attention_shape(37));
      testing::check_resources(
          cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), training_schedule(ex, p)).layer,
          std::string(name) + " / " + p + " training");
    }
}

TEST_SUITE("gpu") {
  TEST_CASE("cuda gpu: moa and attention forward match the reference at 1, 37 and 300 tokens") {
    MOEFORGE_REQUIRE_GPU();
    for (const char *name : {"moa", "attention"})
      for (int64_t tokens : {1, 37, 300})
        for (const char *p : {"megablocks", "scattermoe"}) {
          ExampleShape s = attention_shape(tokens);
          Example ex = make_example(name, s);
          TensorMap in = ex.random_inputs(s, 31);
          INFO(std::string(name) << " / T " << tokens << " / " << std::string(p));
          testing::Outcome o = testing::cuda_forward_and_compare(ex, in, tokens, preset(p));
          CHECK(o.routing_mismatches == 0);
          CHECK(o.worst_error <= 2e-2);
        }
  }

  TEST_CASE("cuda gpu: moa and attention train: every gradient against the reference at 1, 37 and 300 tokens") {
    MOEFORGE_REQUIRE_GPU();
    for (const char *name : {"moa", "attention"})
      for (int64_t tokens : {1, 37, 300})
        // The default's padded_elementwise leaves the scores' and the
        // query's gradients in pair order (rows of a run-time length, sums
        // over the tokens), which the padded order's kernels do not take.
        for (const char *p : {"megablocks", "scattermoe+lean", "default"}) {
          ExampleShape s = attention_shape(tokens);
          Example ex = make_example(name, s);
          INFO(std::string(name) << " / T " << tokens << " / " << std::string(p));
          testing::Outcome o =
              testing::cuda_train_and_compare(ex, ex.random_inputs(s, 29), s.tokens, training_schedule(ex, p));
          CHECK(o.routing_mismatches == 0);
          CHECK(o.worst_error <= 2e-2);
        }
  }
}
