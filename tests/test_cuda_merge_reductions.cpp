// Schedule::merge_weight_gradients on the CUDA backend: SwiGLU's dW1 and
// dW3 as one persistent expert reduction whose stages carry both B
// operands' 128 columns side by side, read by one m64n256 wgmma, each
// gradient staged and stored by TMA in turn. Compiled for sm_90a here at
// the bench shapes; on a GPU the step equals the two reductions' bit for
// bit and the float64 reference within tolerance.
#include <doctest/doctest.h>

#include "backends/cuda/runtime/cuda_backend.h"
#include "backends/cuda/runtime/training_layer.h"
#include "cuda_bench_shapes.h"
#include "cuda_training_step.h"
#include "gpu_test.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "same_step.h"
#include "training_compare.h"

using namespace moeforge;
using testing::shape;

TEST_CASE("cuda merge weight gradients: the default (which merges them) compiles for sm_90a without spills") {
  testing::check_bench_shapes(
      "default", [](const Schedule &def) { return def; },
      [](const cuda::CompiledTraining &c) {
        const std::string &src = c.layer.source.source;
        CHECK(src.find("mf::WgmmaRowsWsConfig<128, 128, 4, 2>") != std::string::npos);
        CHECK(src.find("gemm_d_w1_d_w3") != std::string::npos);
        CHECK(src.find("gemm_d_w3(") == std::string::npos); // no kernel of its own
      });
}

TEST_SUITE("gpu") {
  TEST_CASE("cuda merge weight gradients: the merged step equals the two reductions', bit for bit") {
    MOEFORGE_REQUIRE_GPU();
    // Odd token counts, and 4096 (experts of ~1000 pairs: several k-tiles,
    // the last partial); f = 192 is an odd multiple of the 64-column box
    // (the second tile holds 64 columns of each gradient). The router's
    // weight gradient is summed atomically in no fixed order.
    const std::unique_ptr<Backend> backend = cuda::make_backend();
    for (int64_t tokens : {1, 37, 200, 4096})
      for (const ExampleShape &s : {shape(tokens, 64, 128, 8, 2), shape(tokens, 128, 192, 16, 4)}) {
        INFO("T " << s.tokens << " E " << s.experts << " k " << s.topk);
        Example ex = make_example("swiglu_moe", s);
        const Schedule merged = default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)});
        REQUIRE(merged.merge_weight_gradients());
        testing::check_same_step(*backend, ex, ex.random_inputs(s, 53), s.tokens, merged,
                                 Schedule(merged).merge_weight_gradients(false), {"wr"});
      }
  }

  TEST_CASE("cuda merge weight gradients: the MoE edge cases against the float64 reference") {
    MOEFORGE_REQUIRE_GPU();
    testing::check_edge_cases(64, 128, {"default"},
                              [](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &) {
                                const Func out = ex.pipeline.func(ex.output);
                                return testing::cuda_train_and_compare(
                                    ex, in, tokens, default_schedule(ex.pipeline, {out}).merge_weight_gradients(true));
                              });
  }
}
