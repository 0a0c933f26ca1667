// fused_attention on the CUDA backend (lowering/fuse_attention.h,
// tiles/attention.cuh): the softmax online over every key and value row, on
// the tensor cores (16 query rows a warp) where the head dims allow, else a
// warp per query row. Without a GPU: the kernels compile for sm_90a without
// spills; on a GPU: the forward against the float64 reference at token
// counts that are no multiple of 8 and at 4096 (a row's loop over many
// blocks of tokens), outputs poisoned.
#include <doctest/doctest.h>

#include <string>

#include "backends/cuda/runtime/layer.h"
#include "cuda_forward_compare.h"
#include "cuda_resources.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "tests/gpu_test.h"

using namespace moeforge;

namespace {

ExampleShape attention_shape(int64_t tokens, int64_t d = 64) { return testing::shape(tokens, d, 32, 8, 2); }

Schedule fused(const Example &ex) { return default_schedule(ex.pipeline, {}).fused_attention(true); }

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
}
