// Schedule::concurrent_steps on the GPU: a training step whose independent
// kernels run on several streams (runtime/step_streams.h) gives the
// reference's values, eagerly and replayed from a captured graph.
#include <doctest/doctest.h>

#include <random>

#include "backends/cuda/training_layer.h"
#include "benchmarks/train_schedule.h"
#include "gpu_test.h"
#include "layer_compare.h"
#include "training_compare.h"

using namespace moeforge;

namespace {

using testing::shape;

Schedule side_by_side(const char *example, bool lean) {
  Schedule s = bench::tuned_wide(std::string(example) == "swiglu_moe");
  s.recompute_elementwise(lean).gate_gradient_from_dh(lean).concurrent_steps(true);
  return s;
}

} // namespace

TEST_SUITE("gpu") {
  TEST_CASE("cuda concurrent steps: a training step on several streams matches the reference") {
    MOEFORGE_REQUIRE_GPU();
    static cuda::Device device;
    // One token (most experts empty), dims no tile divides, 128 experts.
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (ExampleShape s : {shape(1, 64, 128, 8, 2), shape(300, 200, 328, 8, 2), shape(700, 136, 200, 128, 4)})
        for (bool lean : {false, true}) {
          Example ex = make_example(name, s);
          Schedule sch = side_by_side(name, lean);
          INFO(name << " T " << s.tokens << " d " << s.d << " f " << s.f << " E " << s.experts
                    << (lean ? " lean" : " store"));
          cuda::CompiledTraining compiled =
              cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), sch, device.arch_specific());
          REQUIRE(compiled.training.program.concurrent_steps);
          cuda::TrainingLayer layer(device, compiled, s.tokens);
          testing::Outcome o =
              testing::step_and_compare(ex, ex.random_inputs(s, 13), compiled.training.program, compiled.training.seed,
                                        layer, sch, [](cuda::TrainingLayer &l) {
                                          cuda::Stream stream;
                                          l.forward(stream);
                                          l.backward(stream);
                                          stream.synchronize();
                                        });
          CHECK(o.routing_mismatches == 0);
        }
  }

  TEST_CASE("cuda concurrent steps: captured and replayed, the streams join back and the values hold") {
    MOEFORGE_REQUIRE_GPU();
    cuda::Device device;
    ExampleShape s = shape(500, 64, 128, 8, 2);
    Example ex = make_example("swiglu_moe", s);
    std::mt19937_64 rng(5);
    HostTensor dy = random_tensor({s.tokens, s.d}, rng);
    TensorMap in = ex.random_inputs(s, 17);
    const std::vector<std::string> outs = {"y", "d_x", "d_wr", "d_w1", "d_w3", "d_w2"};
    // The same kernels in program order on one stream.
    Schedule one = side_by_side("swiglu_moe", true);
    one.concurrent_steps(false);
    cuda::CompiledTraining in_order =
        cuda::compile_training(ex.pipeline, ex.pipeline.func("y"), one, device.arch_specific());
    cuda::CompiledTraining concurrent = cuda::compile_training(
        ex.pipeline, ex.pipeline.func("y"), side_by_side("swiglu_moe", true), device.arch_specific());
    cuda::Stream stream;
    std::map<std::string, HostTensor> want;
    {
      cuda::TrainingLayer l(device, in_order, s.tokens);
      l.upload(in);
      l.upload_upstream_gradient(dy);
      l.forward(stream);
      l.backward(stream);
      stream.synchronize();
      for (const std::string &o : outs)
        want[o] = l.download(o);
    }
    cuda::TrainingLayer layer(device, concurrent, s.tokens);
    layer.replay_graphs(true);
    layer.upload(in);
    for (const char *what : {"first step (eager)", "second (captured)", "third (replayed)", "fourth (replayed)"}) {
      layer.poison();
      layer.upload_upstream_gradient(dy);
      layer.forward(stream);
      layer.backward(stream);
      stream.synchronize();
      for (const std::string &o : outs) {
        INFO(what << ": " << o);
        // The same kernels on the same inputs: equal but for the order of
        // the router gradient's split-K float atomics.
        CHECK(max_normalized_error(layer.download(o), want.at(o)) <= 1e-5);
      }
    }
  }
}
