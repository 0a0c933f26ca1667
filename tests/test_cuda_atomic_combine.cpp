// Schedule::atomic_combine on the CUDA backend: the plan and source of a
// GEMM that adds its rows into their tokens' (no GPU needed, compiled for
// sm_90a without spills); on a GPU, the forward (plain, persistent,
// clusters, replayed from a graph after a poison, dropped pairs) and the
// lean training step against the float64 reference.
#include <doctest/doctest.h>

#include <string>

#include "atomic_combine_test.h"
#include "backends/cuda/codegen/codegen_cuda.h"
#include "cuda_forward_compare.h"
#include "cuda_resources.h"
#include "cuda_training_step.h"
#include "examples/examples.h"
#include "gpu_test.h"
#include "layer_compare.h"
#include "lowering/gemm_plan.h"
#include "lowering/lower.h"
#include "training_compare.h"

using namespace moeforge;
using testing::atomic_schedule;
using testing::cuda_forward_and_compare;
using testing::gemm_writing;
using testing::shape;

namespace {

// Hopper schedules with the combine in o's epilogue: a block per tile,
// persistent blocks, and persistent two-block clusters.
std::vector<Schedule> hopper_schedules() {
  std::vector<Schedule> out;
  for (int variant = 0; variant < 3; ++variant) {
    Schedule s = atomic_schedule(variant == 2 ? Permutation::blocked : Permutation::scattered,
                                 variant == 1 ? GateFusion::combine : GateFusion::epilogue);
    s.tile("*", 128, 128, 64).mma("*", MmaKind::wgmma_ws).tma("*", true).tile("o", 128, 256, 64);
    if (variant >= 1)
      s.persistent("o", true);
    if (variant == 2)
      s.cluster("o", 2);
    out.push_back(s);
  }
  return out;
}

} // namespace

TEST_CASE("atomic_combine: the CUDA plan adds rows into tokens and says why no TMA store") {
  ExampleShape s = shape(512, 256, 512, 8, 2);
  Example ex = make_example("swiglu_moe", s);
  Schedule sch = atomic_schedule(Permutation::scattered, GateFusion::epilogue);
  sch.tile("*", 128, 128, 64).mma("*", MmaKind::wgmma_ws).tma("*", true).tma_store("o", true);
  KernelProgram p = lower(ex.pipeline, sch);
  const GemmStep *g = gemm_writing(p, "y");
  REQUIRE(g != nullptr);
  GemmPlan plan = plan_gemm(p, *g);
  CHECK_FALSE(plan.out_tma());
  CHECK(plan.pair_rows);
  CHECK(describe(plan, *g).find("added atomically into the tokens' rows") != std::string::npos);
  std::vector<std::string> notes = not_applied_choices(p);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0].find("tma_store(\"o\", true) is not applied: its output is added into each pair's token row "
                      "(atomic_combine), which a TMA store of a tile cannot do") != std::string::npos);
  // The generated GEMM: 8- or 16-byte REDs at row r / k, and the output
  // zeroed before it.
  CudaModuleSource src = generate_cuda(p);
  CHECK(src.source.find("out_row = r / 2;") != std::string::npos);
  CHECK(src.source.find("mf::store2x2<true>(g_y + out_row * N") != std::string::npos);
  int zeroed = 0;
  for (const GeneratedKernel &k : src.kernels)
    zeroed += k.zero_first == "y";
  CHECK(zeroed == 1);
}

TEST_CASE("atomic_combine: the Hopper GEMMs compile for sm_90a without spills") {
  for (const char *example : {"moe_mlp", "swiglu_moe"})
    for (const Schedule &s : hopper_schedules()) {
      Example ex = make_example(example, shape(512, 256, 512, 8, 2));
      testing::check_resources(cuda::compile_layer(ex.pipeline, s), std::string(example) + "\n" + s.to_text());
    }
}

TEST_SUITE("gpu") {
  TEST_CASE("cuda atomic_combine: the forward matches the reference") {
    MOEFORGE_REQUIRE_GPU();
    // 1500 x k = 2 over 8 experts and 700 x k = 4 over 16; d = 200, f = 328:
    // K and N tails.
    for (const ExampleShape &s : {shape(1500, 200, 328, 8, 2), shape(700, 256, 512, 16, 4)})
      for (const char *example : {"moe_mlp", "swiglu_moe"}) {
        Example ex = make_example(example, s);
        TensorMap in = ex.random_inputs(s, 31);
        for (const Schedule &sch : hopper_schedules()) {
          INFO(example << " T=" << s.tokens << " k=" << s.topk << "\n" << sch.to_text());
          testing::Outcome o = cuda_forward_and_compare(ex, in, s.tokens, sch, /*use_graph=*/true);
          CHECK(o.routing_mismatches == 0);
          CHECK(o.y_error <= 1e-2);
        }
      }
    // Dropped pairs (capacity 0.5) add nothing; tokens with none stay zero.
    ExampleShape s = shape(600, 128, 256, 8, 2);
    Example ex = make_example("swiglu_moe", s);
    Schedule capped = hopper_schedules()[1];
    capped.capacity(0.5);
    testing::Outcome o = cuda_forward_and_compare(ex, ex.random_inputs(s, 4), s.tokens, capped, /*use_graph=*/true);
    CHECK(o.routing_mismatches == 0);
    CHECK(o.y_error <= 1e-2);
    testing::check_edge_cases(
        128, 256, {"atomic"}, [&](const Example &e, const TensorMap &in, int64_t tokens, const std::string &) {
          return cuda_forward_and_compare(e, in, tokens, hopper_schedules()[0], /*use_graph=*/true);
        });
  }

  TEST_CASE("cuda atomic_combine: the lean training step, the combine in o's epilogue, matches the reference") {
    MOEFORGE_REQUIRE_GPU();
    testing::check_edge_cases(64, 128, {"scattermoe+padded+lean+atomic", "megablocks+lean+atomic"},
                              [](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &p) {
                                return testing::cuda_train_and_compare(ex, in, tokens,
                                                                       testing::training_preset(p, false));
                              });
  }
}
