// Schedule::sorted_saved on the CUDA backend: gemm_h stores the saved
// pre-activations row by row at each tile's sorted row, the input
// gradient's GEMM loads dH1 and dH3 by TMA from there, and the weight
// gradients' expert reductions load them as B shifted by the padding before
// the expert, running past its rows where A's are zero. Compiled for
// sm_90a here; on a GPU the step equals the padded layout's bit for bit and
// the float64 reference within tolerance.
#include <doctest/doctest.h>

#include <functional>

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

TEST_CASE("cuda sorted saved: the default at the bench shapes compiles for sm_90a without spills") {
  testing::check_bench_shapes(
      "default",
      [](const Schedule &def) {
        REQUIRE(def.sorted_saved());
        return Schedule(def).sorted_gathers(false); // B shifted under a padded A
      },
      [](const cuda::CompiledTraining &c) {
        REQUIRE(c.training.program.tensor("h_rhs").layout == RowLayout::sorted);
        const std::string &src = c.layer.source.source;
        CHECK(src.find("const long long sbase = p0 - ") != std::string::npos); // gemm_h's stores, dX's A
        CHECK(src.find("const int b_shift = ") != std::string::npos);          // dW1's and dW3's B
        CHECK(src.find("offsets_unpadded") != std::string::npos);
      });
}

TEST_CASE("cuda sorted gathers: x's rows stored sorted compile for sm_90a without spills at the bench shapes") {
  testing::check_bench_shapes(
      "default + sorted_gathers", [](const Schedule &def) { return Schedule(def).sorted_gathers(true); },
      [](const cuda::CompiledTraining &c) {
        REQUIRE(c.training.program.tensor("x_rows_route").layout == RowLayout::sorted);
        const std::string &src = c.layer.source.source;
        CHECK(src.find("its row stored sorted") != std::string::npos);      // the gather
        CHECK(src.find("<true, true, false, true>(") != std::string::npos); // dW1's and dW3's masked A
        CHECK(src.find("const int b_shift = ") == std::string::npos);       // both operands start unpadded
      });
}

namespace {

// On the GPU: the step under `sorted` (from the layer's default) equals the
// step under `padded` bit for bit, at odd token counts and at 4096 (16
// experts of ~1000 pairs: several k-tiles each, the last one partial). The
// router's weight gradient is left out: split-K slices add it atomically,
// in an order that varies from run to run at 4096 tokens.
void check_same_as_padded(uint64_t seed, const std::function<Schedule(const Schedule &)> &sorted,
                          const std::function<Schedule(const Schedule &)> &padded) {
  const std::unique_ptr<Backend> backend = cuda::make_backend();
  for (int64_t tokens : {1, 37, 200, 4096})
    for (const ExampleShape &s : {shape(tokens, 64, 128, 8, 2), shape(tokens, 128, 192, 16, 4)}) {
      INFO("T " << s.tokens << " E " << s.experts << " k " << s.topk);
      Example ex = make_example("swiglu_moe", s);
      const Schedule def = default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)});
      REQUIRE(def.sorted_saved());
      testing::check_same_step(*backend, ex, ex.random_inputs(s, seed), s.tokens, sorted(def), padded(def), {"wr"});
    }
}

// The MoE edge cases against the float64 reference under the layer's
// default with sorted_gathers as given.
void check_edge_cases_with_gathers(bool gathers) {
  testing::check_edge_cases(64, 128, {"default"},
                            [gathers](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &) {
                              const Func out = ex.pipeline.func(ex.output);
                              return testing::cuda_train_and_compare(
                                  ex, in, tokens, default_schedule(ex.pipeline, {out}).sorted_gathers(gathers));
                            });
}

} // namespace

TEST_SUITE("gpu") {
  TEST_CASE("cuda sorted saved: the default's step equals the padded layout's, bit for bit, at odd token counts") {
    MOEFORGE_REQUIRE_GPU();
    // B shifted under a padded A: x's copy padded (sorted_gathers off).
    check_same_as_padded(
        41, [](const Schedule &d) { return Schedule(d).sorted_gathers(false); },
        [](const Schedule &d) { return Schedule(d).sorted_gathers(false).sorted_saved(false); });
  }

  TEST_CASE("cuda sorted saved: the MoE edge cases against the float64 reference") {
    MOEFORGE_REQUIRE_GPU();
    // The layer's own default, where the pass applies (bf16 activations,
    // the gradients over the saved pre-activations, dW by TMA).
    check_edge_cases_with_gathers(false);
  }

  TEST_CASE("cuda sorted gathers: x's rows without padding give the padded copy's step, bit for bit") {
    MOEFORGE_REQUIRE_GPU();
    check_same_as_padded(
        43, [](const Schedule &d) { return Schedule(d).sorted_gathers(true); },
        [](const Schedule &d) { return Schedule(d).sorted_gathers(false); });
  }

  TEST_CASE("cuda sorted gathers: the MoE edge cases against the float64 reference") {
    MOEFORGE_REQUIRE_GPU();
    check_edge_cases_with_gathers(true);
  }
}
