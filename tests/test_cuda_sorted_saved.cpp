// Schedule::sorted_saved on the CUDA backend: gemm_h stores the saved
// pre-activations row by row at each tile's sorted row, the input
// gradient's GEMM loads dH1 and dH3 by TMA from there, and the weight
// gradients' expert reductions load them as B shifted by the padding before
// the expert, running past its rows where A's are zero. Compiled for
// sm_90a here; on a GPU the step equals the padded layout's bit for bit and
// the float64 reference within tolerance.
#include <doctest/doctest.h>

#include "backends/cuda/runtime/cuda_backend.h"
#include "backends/cuda/runtime/training_layer.h"
#include "cuda_resources.h"
#include "cuda_training_step.h"
#include "gpu_test.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "same_step.h"
#include "training_compare.h"

using namespace moeforge;
using testing::shape;

TEST_CASE("cuda sorted saved: the default at the bench shapes compiles for sm_90a without spills") {
  for (const ExampleShape &s : {shape(16384, 2048, 1408, 64, 8), shape(8192, 2880, 2880, 128, 4),
                                shape(8192, 4096, 14336, 8, 2), shape(16384, 2048, 768, 128, 8)}) {
    INFO("d " << s.d << " f " << s.f << " E " << s.experts);
    Example ex = make_example("swiglu_moe", s);
    const Func out = ex.pipeline.func(ex.output);
    const Schedule sch = default_schedule(ex.pipeline, {out}).sorted_gathers(false); // B shifted under a padded A
    REQUIRE(sch.sorted_saved());
    cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, out, sch);
    REQUIRE(c.training.program.tensor("h_rhs").layout == RowLayout::sorted);
    testing::check_resources(c.layer, "swiglu_moe / default");
    const std::string &src = c.layer.source.source;
    CHECK(src.find("const long long sbase = p0 - ") != std::string::npos); // gemm_h's stores, dX's A
    CHECK(src.find("const int b_shift = ") != std::string::npos);          // dW1's and dW3's B
    CHECK(src.find("offsets_unpadded") != std::string::npos);
  }
}

TEST_CASE("cuda sorted gathers: x's rows stored sorted compile for sm_90a without spills at the bench shapes") {
  for (const ExampleShape &s : {shape(16384, 2048, 1408, 64, 8), shape(8192, 2880, 2880, 128, 4),
                                shape(8192, 4096, 14336, 8, 2), shape(16384, 2048, 768, 128, 8)}) {
    INFO("d " << s.d << " f " << s.f << " E " << s.experts);
    Example ex = make_example("swiglu_moe", s);
    const Func out = ex.pipeline.func(ex.output);
    const Schedule sch = default_schedule(ex.pipeline, {out}).sorted_gathers(true);
    cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, out, sch);
    REQUIRE(c.training.program.tensor("x_rows_route").layout == RowLayout::sorted);
    testing::check_resources(c.layer, "swiglu_moe / default + sorted_gathers");
    const std::string &src = c.layer.source.source;
    CHECK(src.find("its row stored sorted") != std::string::npos);      // the gather
    CHECK(src.find("<true, true, false, true>(") != std::string::npos); // dW1's and dW3's masked A
    CHECK(src.find("const int b_shift = ") == std::string::npos);       // both operands start unpadded
  }
}

TEST_SUITE("gpu") {
  TEST_CASE("cuda sorted saved: the default's step equals the padded layout's, bit for bit, at odd token counts") {
    MOEFORGE_REQUIRE_GPU();
    const std::unique_ptr<Backend> backend = cuda::make_backend();
    for (int64_t tokens : {1, 37, 200, 4096})
      for (const ExampleShape &s : {shape(tokens, 64, 128, 8, 2), shape(tokens, 128, 192, 16, 4)}) {
        INFO("T " << s.tokens << " E " << s.experts << " k " << s.topk);
        Example ex = make_example("swiglu_moe", s);
        const Func out = ex.pipeline.func(ex.output);
        const Schedule sorted = default_schedule(ex.pipeline, {out}).sorted_gathers(false);
        REQUIRE(sorted.sorted_saved());
        // The router's weight gradient is summed by split-K slices adding
        // atomically (their order varies from run to run, at 4096 tokens).
        testing::check_same_step(*backend, ex, ex.random_inputs(s, 41), s.tokens, sorted,
                                 Schedule(sorted).sorted_saved(false), {"wr"});
      }
  }

  TEST_CASE("cuda sorted saved: the MoE edge cases against the float64 reference") {
    MOEFORGE_REQUIRE_GPU();
    // The layer's own default, where the pass applies (bf16 activations,
    // the gradients over the saved pre-activations, dW by TMA).
    testing::check_edge_cases(64, 128, {"default"},
                              [](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &) {
                                const Func out = ex.pipeline.func(ex.output);
                                return testing::cuda_train_and_compare(
                                    ex, in, tokens, default_schedule(ex.pipeline, {out}).sorted_gathers(false));
                              });
  }

  TEST_CASE("cuda sorted gathers: x's rows without padding give the padded copy's step, bit for bit") {
    MOEFORGE_REQUIRE_GPU();
    const std::unique_ptr<Backend> backend = cuda::make_backend();
    // 4096 tokens of 16 experts: experts of ~1000 pairs, several k-tiles
    // each, the last one partial.
    for (int64_t tokens : {1, 37, 200, 4096})
      for (const ExampleShape &s : {shape(tokens, 64, 128, 8, 2), shape(tokens, 128, 192, 16, 4)}) {
        INFO("T " << s.tokens << " E " << s.experts << " k " << s.topk);
        Example ex = make_example("swiglu_moe", s);
        const Func out = ex.pipeline.func(ex.output);
        const Schedule base = default_schedule(ex.pipeline, {out});
        testing::check_same_step(*backend, ex, ex.random_inputs(s, 43), s.tokens, Schedule(base).sorted_gathers(true),
                                 Schedule(base).sorted_gathers(false), {"wr"});
      }
  }

  TEST_CASE("cuda sorted gathers: the MoE edge cases against the float64 reference") {
    MOEFORGE_REQUIRE_GPU();
    testing::check_edge_cases(64, 128, {"default"},
                              [](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &) {
                                const Func out = ex.pipeline.func(ex.output);
                                return testing::cuda_train_and_compare(
                                    ex, in, tokens, default_schedule(ex.pipeline, {out}).sorted_gathers(true));
                              });
  }
}
