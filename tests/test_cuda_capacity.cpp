// Capacity dropping (Schedule::capacity) and expert-choice routing on the
// CUDA backend: the generated kernels compile for sm_90a without spills (no
// GPU needed); on a GPU, the device routing's capacity choice against the
// host oracle, and the layer's forward and training against the reference
// under the same capacity, outputs poisoned first.
#include <doctest/doctest.h>

#include <random>

#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/layer.h"
#include "backends/cuda/runtime/routing_kernels.h"
#include "backends/cuda/runtime/stream.h"
#include "backends/cuda/runtime/training_layer.h"
#include "cuda_resources.h"
#include "cuda_training_step.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "runtime/routing_host.h"
#include "schedules/presets.h"
#include "tests/gpu_test.h"
#include "training_compare.h"

using namespace moeforge;

namespace {

ExampleShape small_shape() { return testing::shape(150, 64, 128, 8, 2); }

Schedule capped(const std::string &p, double factor) {
  Schedule s = testing::training_preset(p, false);
  s.capacity(factor);
  return s;
}

void check_same(const std::vector<int32_t> &got, const std::vector<int32_t> &want, const char *what,
                const RoutingShape &s) {
  INFO(what << " for " << s.to_string());
  REQUIRE(got.size() == want.size());
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i] && bad++ == 0)
      first = i;
  INFO("first difference at " << first << ": " << (bad ? got[first] : 0) << " vs " << (bad ? want[first] : 0));
  CHECK(bad == 0);
}

// The forward alone, as the layer runs it (the gate and the softmax in the
// routing), poisoned first, against the reference under the same capacity.
testing::Outcome gpu_forward(cuda::Device &device, const Example &ex, const TensorMap &in, int64_t tokens,
                             const Schedule &schedule, int64_t *dropped = nullptr) {
  cuda::CompiledLayer fl = cuda::compile_layer(ex.pipeline, schedule, device.arch_specific());
  cuda::CudaLayer layer(device, fl, tokens);
  layer.upload(in);
  layer.poison();
  cuda::Stream stream;
  layer.enqueue(stream);
  stream.synchronize();
  if (dropped)
    *dropped = layer.dropped_pairs(ex.route);
  return testing::compare_with_reference(ex, in, fl.program, layer, schedule.to_text(), 2e-2, 0, schedule.capacity());
}

} // namespace

TEST_CASE("cuda capacity: capped and expert-choice layers compile for sm_90a without spills") {
  for (const char *p : {"megablocks", "scattermoe"}) {
    Example ex = make_example("moe_mlp", small_shape());
    testing::check_resources(cuda::compile_layer(ex.pipeline, capped(p, 1.25)), std::string("moe_mlp capped / ") + p);
    testing::check_resources(
        cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), capped(std::string(p) + "+lean", 1.0)).layer,
        std::string("moe_mlp capped training / ") + p);
    Example ec = make_example("expert_choice_moe", small_shape());
    testing::check_resources(cuda::compile_layer(ec.pipeline, preset(p)), std::string("expert_choice_moe / ") + p);
    cuda::CompiledTraining t = cuda::compile_training(ec.pipeline, ec.pipeline.func(ec.output), preset(p));
    testing::check_resources(t.layer, std::string("expert_choice_moe training / ") + p);
    // The combine skips a dropped pair.
    CHECK(t.layer.source.source.find("continue;  // dropped at capacity") != std::string::npos);
  }
  // The routing module holds the capacity kernel.
  const std::vector<std::string> &names = cuda::routing_kernel_names();
  CHECK(std::find(names.begin(), names.end(), "moe_capacity_keep") != names.end());
  CHECK_FALSE(cuda::compile_routing_kernels("sm_90a").cubin.empty());
}

TEST_SUITE("gpu") {
  TEST_CASE("cuda capacity: the device routing keeps what the host oracle keeps, by token order and by score") {
    MOEFORGE_REQUIRE_GPU();
    cuda::Device device;
    cuda::DeviceRouting routing(device);
    cuda::Stream stream;
    std::mt19937 rng(5);
    struct Case {
      int64_t tokens;
      int experts, k, block;
      int64_t capacity;
      KeepPriority priority;
      bool skewed;
    };
    const Case cases[] = {
        {1000, 8, 2, 128, 250, KeepPriority::token_order, false},
        {1000, 8, 2, 64, 40, KeepPriority::token_order, true},
        {4097, 64, 8, 128, 300, KeepPriority::token_order, true},
        {3000, 8, 1, 128, 0, KeepPriority::token_order, false},
        {500, 8, 8, 64, 125, KeepPriority::score, false},
        {2000, 16, 16, 128, 250, KeepPriority::score, true},
        {7, 4, 4, 64, 2, KeepPriority::score, false},
    };
    for (const Case &c : cases) {
      RoutingShape s{c.tokens, c.experts, c.k, c.block};
      s.capacity = c.capacity;
      s.priority = c.priority;
      std::vector<float> probs(static_cast<size_t>(c.tokens * c.experts));
      std::uniform_real_distribution<float> u(0.0f, 1.0f);
      for (size_t i = 0; i < probs.size(); ++i) // skewed: low experts score higher
        probs[i] = u(rng) * (c.skewed ? 1.0f / (1.0f + static_cast<float>(i % c.experts)) : 1.0f);
      // A tie in the scores: the earlier token must win it everywhere.
      probs[static_cast<size_t>(c.experts)] = probs[0];
      HostTopK top = top_k_on_host(s, probs);
      RoutingTables want = route_on_host(s, top.expert, top.gate);
      REQUIRE(verify_routing_tables(s, want, top.gate).empty());
      cuda::DeviceBuffer d_probs = cuda::DeviceBuffer::from(probs);
      cuda::RoutingPlan plan(s);
      for (uint32_t poison : {0xffffffffu, 0x7fc00000u}) {
        plan.poison(poison);
        routing.run(d_probs.ptr(), plan, stream);
        stream.synchronize();
        RoutingTables got = plan.download();
        CAPTURE(s.to_string());
        check_same(got.counts, want.counts, "counts", s);
        check_same(got.pair_pos, want.pair_pos, "pair_pos", s);
        check_same(got.sorted_pair, want.sorted_pair, "sorted_pair", s);
        check_same(got.tile_expert, want.tile_expert, "tile_expert", s);
        check_same(got.tile_rows, want.tile_rows, "tile_rows", s);
        CHECK(got.num_tiles == want.num_tiles);
        CHECK(verify_routing_tables(s, got, top.gate).empty());
      }
      CHECK(dropped_pairs(s, want) > 0);
    }
  }

  TEST_CASE("cuda capacity: capped forward and training match the reference under the same capacity") {
    MOEFORGE_REQUIRE_GPU();
    static cuda::Device device;
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (const char *p : {"megablocks", "scattermoe+padded+lean"}) {
        ExampleShape s = small_shape();
        Example ex = make_example(name, s);
        TensorMap in = ex.random_inputs(s, 9);
        INFO(name << " / " << p);
        Schedule fs = capped(p, 1.0);
        int64_t dropped = -1;
        testing::Outcome f = gpu_forward(device, ex, in, s.tokens, fs, &dropped);
        CHECK(f.routing_mismatches == 0);
        EvalOptions cap;
        cap.capacity_factor = 1.0;
        const int64_t want = evaluate(ex.pipeline, in, Precision::f64, cap).routes.at(ex.route).dropped();
        CHECK(want > 0);
        CHECK(dropped == want);
        testing::Outcome o = testing::cuda_train_and_compare(ex, in, s.tokens, fs);
        CHECK(o.routing_mismatches == 0);
        CHECK(o.worst_error <= 2e-2);
      }
  }

  TEST_CASE("cuda capacity: expert_choice_moe forward and training match the reference") {
    MOEFORGE_REQUIRE_GPU();
    static cuda::Device device;
    for (const char *p : {"megablocks", "scattermoe+padded+lean"}) {
      ExampleShape s = small_shape();
      Example ex = make_example("expert_choice_moe", s);
      TensorMap in = ex.random_inputs(s, 4);
      INFO(p);
      Schedule sched = testing::training_preset(p, false);
      testing::Outcome o = testing::cuda_train_and_compare(ex, in, s.tokens, sched);
      CHECK(o.routing_mismatches == 0);
      CHECK(o.worst_error <= 2e-2);
      int64_t dropped = -1;
      testing::Outcome f = gpu_forward(device, ex, in, s.tokens, sched, &dropped);
      CHECK(f.routing_mismatches == 0);
      // Each expert took C = ceil(2 * 150 / 8) = 38 tokens.
      CHECK(dropped == s.tokens * s.experts - s.experts * 38);
    }
  }

  TEST_CASE("cuda capacity: fewer padded rows than pairs (the bound by the kept pairs)") {
    MOEFORGE_REQUIRE_GPU();
    static cuda::Device device;
    // As test_cpu_capacity.cpp's case: 8000 offered pairs in 2048 padded
    // rows (expert choice, cf 1), and a top-2 route keeping 1000 of 2000.
    struct Case {
      const char *example;
      int64_t tokens, topk;
      double capacity;
    };
    for (const Case &c : {Case{"expert_choice_moe", 1000, 1, 0}, Case{"moe_mlp", 1000, 2, 0.25}})
      for (const char *p : {"megablocks", "scattermoe+padded+lean"}) {
        ExampleShape s = testing::shape(c.tokens, 64, 128, 8, c.topk);
        Example ex = make_example(c.example, s);
        TensorMap in = ex.random_inputs(s, 6);
        Schedule sched = testing::training_preset(p, false);
        if (c.capacity > 0)
          sched.capacity(c.capacity);
        INFO(c.example << " / " << p);
        testing::Outcome o = testing::cuda_train_and_compare(ex, in, s.tokens, sched);
        CHECK(o.routing_mismatches == 0);
        CHECK(o.worst_error <= 2e-2);
        CHECK(gpu_forward(device, ex, in, s.tokens, sched).routing_mismatches == 0);
      }
  }
}
