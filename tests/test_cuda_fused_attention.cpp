// fused_attention on the CUDA backend (lowering/fuse_attention.h,
// tiles/attention.cuh): the softmax online over every key and value row, on
// the tensor cores (16 query rows a warp) where the head dims allow, else a
// warp per query row; in training its gradients too, the probabilities made
// again from each row's log-sum-exp (on the tensor cores 16 row slots a
// warp for the query's, 16 tokens a warp for the key's and value's; else a
// warp per row or per token). Without a GPU: the kernels
// compile for sm_90a without spills; on a GPU: the forward and the training
// step against the float64 reference at token counts that are no multiple
// of 8 and at 4096 or 1024 (loops over many blocks), outputs poisoned.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "backends/cuda/runtime/layer.h"
#include "backends/cuda/runtime/training_layer.h"
#include "cuda_forward_compare.h"
#include "cuda_resources.h"
#include "cuda_training_step.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "tests/gpu_test.h"
#include "training_compare.h"

using namespace moeforge;

namespace {

ExampleShape attention_shape(int64_t tokens, int64_t d = 64) { return testing::shape(tokens, d, 32, 8, 2); }

Schedule fused(const Example &ex) { return default_schedule(ex.pipeline, {}).fused_attention(true); }

// A training schedule with the attention fused: the layer's default, or a
// preset as training_preset makes it.
Schedule fused_training(const Example &ex, const std::string &preset) {
  const Schedule s = preset == "default" ? default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)})
                                         : testing::training_preset(preset, false);
  return Schedule(s).fused_attention(true);
}

cuda::CompiledTraining compile_fused_training(const Example &ex, const std::string &preset) {
  return cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), fused_training(ex, preset));
}

// Every gradient of a training step with the attention fused, against
// the float64 reference; at 1024 tokens (many blocks of tokens and of
// row slots in each warp's loop) in a case of its own, which memcheck
// runs take apart.
void check_fused_training(const std::vector<int64_t> &token_counts) {
  for (const char *name : {"moa", "attention"})
    for (int64_t tokens : token_counts)
      for (const char *preset : {"default", "megablocks", "scattermoe+lean"}) {
        ExampleShape s = attention_shape(tokens);
        Example ex = make_example(name, s);
        INFO(std::string(name) << " / T " << tokens << " / " << std::string(preset));
        testing::Outcome o =
            testing::cuda_train_and_compare(ex, ex.random_inputs(s, 29), tokens, fused_training(ex, preset));
        CHECK(o.routing_mismatches == 0);
        CHECK(o.worst_error <= 2e-2);
      }
}

} // namespace

TEST_CASE("cuda fused attention: moa and attention compile for sm_90a without spills") {
  for (const char *name : {"moa", "attention"}) {
    Example ex = make_example(name, attention_shape(37));
    cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, fused(ex));
    testing::check_resources(c, std::string(name) + " / fused_attention");
    const std::string &src = c.source.source;
    // Head dims of 32 and 64: the tensor-core form.
    CHECK(src.find("mf::attention_rows_mma<") != std::string::npos);
    // No kernel makes the scores.
    CHECK(src.find("gemm_p_s") == std::string::npos);
  }
  // moa's rows in pair order (no padded_elementwise): all real, no route.
  Example pairs = make_example("moa", attention_shape(37));
  testing::check_resources(cuda::compile_layer(pairs.pipeline, fused(pairs).padded_elementwise(false)),
                           "moa / pair order / fused_attention");
  // moa's head dim of 128 (its output accumulators: 64 floats a thread).
  ExampleShape wide = attention_shape(37);
  wide.f = 128;
  Example moa = make_example("moa", wide);
  testing::check_resources(cuda::compile_layer(moa.pipeline, fused(moa)), "moa / head 128 / fused_attention");
  // A head dim of 40, no multiple of 16: a warp per row on the CUDA cores.
  Example ex = make_example("attention", attention_shape(37, 40));
  cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, fused(ex));
  testing::check_resources(c, "attention / d 40 / fused_attention");
  CHECK(c.source.source.find("mf::attention_row_warp<40, 40>") != std::string::npos);
}

TEST_CASE("cuda fused attention: training's forward and gradients compile for sm_90a without spills") {
  for (const char *name : {"moa", "attention"})
    for (const char *preset : {"default", "megablocks", "scattermoe+lean"}) {
      Example ex = make_example(name, attention_shape(37));
      const std::string what = std::string(name) + " / " + preset + " / fused_attention training";
      cuda::CompiledTraining c = compile_fused_training(ex, preset);
      testing::check_resources(c.layer, what);
      const std::string &src = c.layer.source.source;
      INFO(what);
      CHECK(src.find("mf::attention_query_gradient_mma<") != std::string::npos);
      CHECK(src.find("mf::attention_key_gradient_mma<") != std::string::npos);
      // No kernel makes the scores or their gradients.
      CHECK(src.find("gemm_p_s") == std::string::npos);
      CHECK(src.find("gemm_d_p") == std::string::npos);
    }
  // moa's head dim of 128: the key's part holds d_key's and d_value's
  // accumulators (64 floats each a thread).
  ExampleShape wide = attention_shape(37);
  wide.f = 128;
  Example moa = make_example("moa", wide);
  testing::check_resources(compile_fused_training(moa, "default").layer, "moa / head 128 / fused training");
  // A head dim of 40 (no multiple of 16): a warp per row, and per token,
  // on the CUDA cores.
  Example odd = make_example("attention", attention_shape(37, 40));
  cuda::CompiledTraining c = compile_fused_training(odd, "default");
  testing::check_resources(c.layer, "attention / d 40 / fused training");
  CHECK(c.layer.source.source.find("mf::attention_query_gradient_warp<40, 40>") != std::string::npos);
  CHECK(c.layer.source.source.find("mf::attention_key_gradient_warp<40, 40>") != std::string::npos);
}

TEST_SUITE("gpu") {
  TEST_CASE("cuda gpu: fused attention forward matches the reference at 1, 37, 300 and 4096 tokens") {
    MOEFORGE_REQUIRE_GPU();
    for (const char *name : {"moa", "attention"})
      for (int64_t tokens : {1, 37, 300, 4096}) {
        ExampleShape s = attention_shape(tokens);
        Example ex = make_example(name, s);
        INFO(std::string(name) << " / T " << tokens);
        testing::Outcome o = testing::cuda_forward_and_compare(ex, ex.random_inputs(s, 31), tokens, fused(ex));
        CHECK(o.routing_mismatches == 0);
        CHECK(o.worst_error <= 2e-2);
      }
    // The CUDA-core form (a head dim of 40).
    for (int64_t tokens : {1, 37, 300}) {
      ExampleShape s = attention_shape(tokens, 40);
      Example ex = make_example("attention", s);
      INFO("attention / d 40 / T " << tokens);
      CHECK(testing::cuda_forward_and_compare(ex, ex.random_inputs(s, 31), tokens, fused(ex)).worst_error <= 2e-2);
    }
  }

  TEST_CASE("cuda gpu: fused attention trains: every gradient against the reference at 1, 37 and 300 tokens") {
    MOEFORGE_REQUIRE_GPU();
    check_fused_training({1, 37, 300});
    // The CUDA-core form (a head dim of 40).
    for (int64_t tokens : {1, 37, 300}) {
      ExampleShape s = attention_shape(tokens, 40);
      Example ex = make_example("attention", s);
      INFO("attention / d 40 / T " << tokens);
      testing::Outcome o =
          testing::cuda_train_and_compare(ex, ex.random_inputs(s, 29), tokens, fused_training(ex, "default"));
      CHECK(o.worst_error <= 2e-2);
    }
    // moa's head dim of 128: d_key and d_value in two blocks per tokens.
    for (int64_t tokens : {37, 300}) {
      ExampleShape s = attention_shape(tokens);
      s.f = 128;
      Example ex = make_example("moa", s);
      INFO("moa / head 128 / T " << tokens);
      testing::Outcome o =
          testing::cuda_train_and_compare(ex, ex.random_inputs(s, 29), tokens, fused_training(ex, "default"));
      CHECK(o.routing_mismatches == 0);
      CHECK(o.worst_error <= 2e-2);
    }
  }

  TEST_CASE("cuda gpu: fused attention trains: every gradient against the reference at 1024 tokens") {
    MOEFORGE_REQUIRE_GPU();
    check_fused_training({1024});
  }
}
