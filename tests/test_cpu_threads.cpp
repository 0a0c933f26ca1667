// The CPU backend's GEMMs split their outermost loop (routing tiles, experts,
// rows) over threads: MOEFORGE_CPU_THREADS, else every core. Each output
// element is computed by one call in the same order whatever the split, so
// any thread count gives the same bits, forward and backward.
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>

#include "backends/cpu/cpu_training.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "schedules/presets.h"
#include "user_error.h"

using namespace moeforge;

namespace {

// Sets MOEFORGE_CPU_THREADS for the layers made in its lifetime.
struct ThreadsEnv {
  std::string saved;
  bool had;
  explicit ThreadsEnv(const std::string &value) {
    const char *v = std::getenv("MOEFORGE_CPU_THREADS");
    had = v != nullptr;
    saved = v ? v : "";
    ::setenv("MOEFORGE_CPU_THREADS", value.c_str(), 1);
  }
  ~ThreadsEnv() {
    if (had)
      ::setenv("MOEFORGE_CPU_THREADS", saved.c_str(), 1);
    else
      ::unsetenv("MOEFORGE_CPU_THREADS");
  }
};

} // namespace

TEST_SUITE("cpu") {
  TEST_CASE("cpu threads: any thread count gives the same bits, forward and every gradient") {
    ExampleShape s = testing::shape(333, 64, 96, 8, 2); // tiles and experts not a multiple of the threads
    for (const char *name : {"swiglu_moe", "moe_mlp"})
      for (const char *p : {"megablocks", "scattermoe"}) {
        INFO(name << " / " << p);
        Example ex = make_example(name, s);
        TensorMap in = ex.random_inputs(s, 31);
        std::mt19937_64 rng(32);
        HostTensor dy = random_tensor({s.tokens, s.d}, rng);
        cpu::CompiledCpuTraining c = cpu::compile_cpu_training(ex.pipeline, ex.pipeline.func(ex.output), preset(p));
        std::vector<std::vector<HostTensor>> results;
        for (const char *threads : {"1", "2", "3", "7"}) {
          ThreadsEnv env(threads);
          cpu::CpuTrainingLayer layer(c, s.tokens);
          layer.upload(in);
          layer.poison();
          layer.forward();
          layer.upload_upstream_gradient(dy);
          layer.backward();
          std::vector<HostTensor> r{layer.output()};
          for (const std::string &of : c.training.of)
            r.push_back(layer.gradient(of));
          results.push_back(r);
        }
        for (size_t t = 1; t < results.size(); ++t)
          for (size_t i = 0; i < results[0].size(); ++i) {
            INFO("tensor " << i << ", threads case " << t);
            CHECK(results[t][i].data == results[0][i].data);
          }
      }
  }

  TEST_CASE("cpu threads: a thread count that is not a whole number from 1 to 1024 is a user error") {
    Example ex = make_example("moe_mlp", ExampleShape{});
    cpu::CompiledCpuTraining c =
        cpu::compile_cpu_training(ex.pipeline, ex.pipeline.func(ex.output), preset("scattermoe"));
    for (const char *bad : {"0", "-2", "x", "2000", "3.5"}) {
      INFO(bad);
      ThreadsEnv env(bad);
      CHECK(testing::user_error_of([&] { cpu::CpuTrainingLayer layer(c, 16); }) ==
            std::string("MOEFORGE_CPU_THREADS must be a whole number from 1 to 1024, got '") + bad + "'");
    }
  }
}
