// Schedule::pingpong: persistent blocks whose two consumer warpgroups take the
// tiles in turns. Without a GPU: the primitive's text, the rules every
// backend applies alike (messages asserted), the plan and its notes, the
// generated source, and sm_90a compiles without spills or serialised wgmmas
// at the design shapes. On a GPU: the forward (gathered and tile-order A,
// tiles of an expert's last rows under 64, K and N tails, replayed from a
// graph after a poison) and the training step (B^T read in place by the
// input gradient) against the float64 reference.
#include <doctest/doctest.h>

#include <string>

#include "atomic_combine_test.h"
#include "backends/cuda/codegen_cuda.h"
#include "cuda_forward_compare.h"
#include "cuda_resources.h"
#include "cuda_training_step.h"
#include "examples/examples.h"
#include "gpu_test.h"
#include "layer_compare.h"
#include "lowering/gemm_plan.h"
#include "lowering/lower.h"
#include "training_compare.h"
#include "user_error.h"

using namespace moeforge;
using testing::cuda_forward_and_compare;
using testing::gemm_writing;
using testing::shape;

namespace {

// Every contraction in ping-pong blocks; h in 64-column tiles, which
// SwiGLU's merged gate and up projections (two B operands) need.
Schedule pingpong_schedule(Schedule s) {
  s.tile("*", 128, 128, 64).mma("*", MmaKind::wgmma_ws).tma("*", true).persistent("*", true).pingpong("*", true);
  s.tile("h", 128, 64, 64);
  return s;
}

Schedule pingpong_forward(Permutation perm) {
  Schedule s("pingpong");
  s.permutation(perm).gate(GateFusion::epilogue);
  return pingpong_schedule(s);
}

const std::string kSwiglu = "swiglu_moe";

} // namespace

TEST_CASE("pingpong: the primitive prints, replays and is checked alike by every backend") {
  Example ex = make_example(kSwiglu, shape(256, 128, 256, 8, 2));
  Schedule s = pingpong_forward(Permutation::scattered);
  s.validate(ex.pipeline);
  CHECK(s.to_text().find("pingpong(\"*\", true)") != std::string::npos);
  Schedule back = Schedule::from_text(s.to_text());
  CHECK(back.for_func("h").tiling.pingpong);
  CHECK(back.for_func("h").tiling == s.for_func("h").tiling);

  // Without the loop it needs: the same message from Schedule::validate,
  // which every backend runs before compiling.
  auto rejected = [&](const Schedule &bad, const std::string &why) {
    const std::string msg = testing::user_error_of([&] { bad.validate(ex.pipeline); });
    CHECK(msg.find("definition 'o': pingpong's consumer warpgroups take turns over the tiles of a persistent, "
                   "warp-specialised TMA loop") != std::string::npos);
    CHECK(msg.find(why) != std::string::npos);
    CHECK(msg.find("or drop pingpong") != std::string::npos);
  };
  Schedule not_persistent = s;
  not_persistent.persistent("o", false);
  rejected(not_persistent, "not persistent");
  Schedule clustered = s;
  clustered.cluster("o", 2);
  rejected(clustered, "in clusters");
  Schedule short_tile = s;
  short_tile.tile("o", 64, 128, 64);
  rejected(short_tile, "the tile is 64 rows");
  Schedule no_tma = s;
  no_tma.tma("o", false);
  rejected(no_tma, "no tma");
}

TEST_CASE("pingpong: the plan gives each warpgroup whole tiles, plain stores, and says what it cannot take") {
  ExampleShape sh = shape(512, 256, 512, 8, 2);
  Example ex = make_example(kSwiglu, sh);
  Schedule s = pingpong_forward(Permutation::scattered);
  s.tma_store("o", true);
  KernelProgram p = lower(ex.pipeline, s);
  for (const char *out : {"h", "o_gated", "logits"}) {
    const GemmStep *g = gemm_writing(p, out);
    REQUIRE(g != nullptr);
    GemmPlan plan = plan_gemm(p, *g);
    CHECK(plan.pingpong);
    CHECK_FALSE(plan.out_tma);
    CHECK(plan.threads == 384);
    CHECK(describe(plan, *g).find("two consumer warpgroups taking them in turns (ping-pong)") != std::string::npos);
  }
  std::vector<std::string> notes = not_applied_choices(p);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0] == "definition 'o': tma_store(\"o\", true) is not applied: the ping-pong warpgroups store their "
                    "tiles with plain stores (a TMA store would need a staging buffer for each)");

  // SwiGLU's two B operands in 128-column tiles: 256 accumulators a thread.
  Schedule wide = s;
  wide.tile("h", 128, 128, 64);
  KernelProgram pw = lower(ex.pipeline, wide);
  const GemmStep *gh = gemm_writing(pw, "h");
  REQUIRE(gh != nullptr);
  CHECK(testing::user_error_of([&] { plan_gemm(pw, *gh); }) ==
        "definition 'h': pingpong(\"h\") gives one warpgroup the whole 128-row tile: 2 B operands with tile_n 128 "
        "need 256 accumulator registers per thread, over 128: use tile_n 64 or less, or drop pingpong");

  // The generated kernels: the ping-pong configuration, a warpgroup passing
  // the other's tiles before any setup.
  CudaModuleSource src = generate_cuda(p);
  CHECK(src.source.find("mf::WgmmaPingPongConfig<128, 64, 4, 2>") != std::string::npos);
  CHECK(src.source.find("if (!Cfg::takes(ring, (K + Cfg::BK - 1) / Cfg::BK)) continue;") != std::string::npos);
}

TEST_CASE("pingpong: an expert reduction named for it says why it keeps the plain persistent loop") {
  Example ex = make_example("moe_mlp", shape(256, 128, 256, 8, 2));
  Schedule s = testing::training_preset("scattermoe+padded", false);
  s = pingpong_schedule(s);
  s.persistent("d_w1", true).pingpong("d_w1", true);
  KernelProgram p = lower_training(ex.pipeline, ex.pipeline.func(ex.output), s).program;
  bool said = false;
  for (const std::string &n : not_applied_choices(p))
    said |= n.find("pingpong(\"d_w1\", true) is not applied: an expert reduction's K changes from tile to tile") !=
            std::string::npos;
  CHECK(said);
}

TEST_CASE("pingpong: the Hopper GEMMs compile for sm_90a without spills or serialised wgmmas") {
  // The design shapes' GEMMs (mixtral's d and f at fewer tokens: the
  // kernels are the same), and a small shape with K and N tails.
  for (const ExampleShape &sh :
       {shape(2048, 2048, 1408, 64, 8), shape(1024, 4096, 14336, 8, 2), shape(300, 200, 328, 8, 2)})
    for (const char *example : {"moe_mlp", "swiglu_moe"})
      for (Permutation perm : {Permutation::scattered, Permutation::blocked}) {
        Example ex = make_example(example, sh);
        Schedule s = pingpong_forward(perm);
        testing::check_resources(cuda::compile_layer(ex.pipeline, s),
                                 std::string(example) + " d=" + std::to_string(sh.d) + "\n" + s.to_text(),
                                 /*whole_wgmma=*/sh.d >= 2048);
      }
}

TEST_SUITE("gpu") {
  TEST_CASE("cuda pingpong: the forward matches the reference") {
    MOEFORGE_REQUIRE_GPU();
    // 1500 x k = 2 over 8 experts and 700 x k = 4 over 16; d = 200, f = 328:
    // K and N tails, and experts whose last tile holds under 64 rows.
    for (const ExampleShape &s : {shape(1500, 200, 328, 8, 2), shape(700, 256, 512, 16, 4)})
      for (const char *example : {"moe_mlp", "swiglu_moe"})
        for (Permutation perm : {Permutation::scattered, Permutation::blocked}) {
          Example ex = make_example(example, s);
          TensorMap in = ex.random_inputs(s, 37);
          Schedule sch = pingpong_forward(perm);
          INFO(example << " T=" << s.tokens << " k=" << s.topk << "\n" << sch.to_text());
          testing::Outcome o = cuda_forward_and_compare(ex, in, s.tokens, sch, /*use_graph=*/true);
          CHECK(o.routing_mismatches == 0);
          CHECK(o.y_error <= 1e-2);
        }
    testing::check_edge_cases(128, 256, {"pingpong"},
                              [&](const Example &e, const TensorMap &in, int64_t tokens, const std::string &) {
                                return cuda_forward_and_compare(e, in, tokens, pingpong_forward(Permutation::scattered),
                                                                /*use_graph=*/true);
                              });
  }

  TEST_CASE("cuda pingpong: the training step matches the reference") {
    MOEFORGE_REQUIRE_GPU();
    testing::check_edge_cases(64, 128, {"scattermoe+padded", "megablocks+lean"},
                              [](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &p) {
                                return testing::cuda_train_and_compare(
                                    ex, in, tokens, pingpong_schedule(testing::training_preset(p, false)));
                              });
  }
}
