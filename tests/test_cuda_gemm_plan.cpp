// The CUDA backend's GEMM plans (lowering/gemm_plan.h): every choice of
// a generated GEMM kernel resolved before any code is printed.
#include <doctest/doctest.h>

#include <algorithm>
#include <variant>

#include "cuda_resources.h"
#include "layer_compare.h"
#include "program_steps.h"

#include "backends/cuda/codegen/codegen_cuda.h"
#include "benchmarks/train_schedule.h"
#include "dsl/error.h"
#include "examples/examples.h"
#include "lowering/gemm_plan.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "schedules/presets.h"

using namespace moeforge;
using testing::gemm_named;

namespace {

ExampleShape small() { return testing::shape(64, 128, 256, 8, 2); }

} // namespace

TEST_CASE("gemm plan: the kernels launch with the plan's threads and shared memory") {
  // Every GEMM of the training step under tuned_wide (persistent blocks, TMA
  // stores staged whole or in halves, a chained product, expert reductions
  // by TMA) and under the presets: the generated kernel is the plan's.
  Example ex = make_example("swiglu_moe", small());
  for (int which : {0, 1, 2}) {
    Schedule s = which == 0 ? bench::tuned_wide(true) : preset(which == 1 ? "megablocks" : "scattermoe");
    INFO("schedule " << which);
    KernelProgram p = lower_training(ex.pipeline, ex.pipeline.func(ex.output), s).program;
    CudaModuleSource m = generate_cuda(p);
    int gemms = 0;
    for (const GeneratedKernel &k : m.kernels) {
      const Step *step = nullptr;
      for (const Step &st : p.steps)
        if (const auto *g = std::get_if<GemmStep>(&st); g && g->name == k.step)
          step = &st;
      if (!step)
        continue;
      ++gemms;
      const GemmStep &g = std::get<GemmStep>(*step);
      const GemmPlan plan = plan_gemm(p, g);
      INFO(g.name);
      CHECK(k.shared_bytes == plan.shared_bytes());
      CHECK(k.threads == plan.threads);
      CHECK(k.grid.persistent == plan.persistent());
      CHECK(plan.shared_bytes() <= Schedule::max_shared_bytes);
      // The stages are the schedule's one formula for the tile.
      CHECK(plan.stage_bytes == g.tiling.ring_bytes(plan.nb));
    }
    CHECK(gemms >= 8);
  }
}

TEST_CASE("gemm plan: tuned_wide's choices, as emit --plan prints them") {
  Example ex = make_example("swiglu_moe", small());
  KernelProgram p = lower_training(ex.pipeline, ex.pipeline.func(ex.output), bench::tuned_wide(true)).program;
  const GemmPlan h = plan_gemm(p, gemm_named(p, "gemm_h_silu_in_h_rhs"));
  CHECK(h.nb == 2);
  CHECK(h.ws());
  CHECK(h.tma());
  CHECK_FALSE(h.a_tma()); // x gathered by the producer (scattermoe)
  CHECK_FALSE(h.persistent());
  CHECK_FALSE(h.out_tma());
  const GemmPlan dw = plan_gemm(p, gemm_named(p, "gemm_d_w1_d_w3")); // merge_weight_gradients
  CHECK(dw.nb == 2);
  CHECK(dw.in_place());
  CHECK(dw.b_tma_rows());
  CHECK(dw.a_tma_rows());
  CHECK(dw.persistent());
  CHECK(dw.out_tma());
  CHECK(dw.staged_cols == 128); // 4 stages of 128 x (128 + 128) leave room for one B's tile of staging
  const GemmPlan dx = plan_gemm(p, gemm_named(p, "gemm_d_x_s2_d_x_s"));
  CHECK(dx.chained);
  CHECK(dx.a_tma());
  const std::string text = describe_gemm_plans(p);
  CHECK(text.find("gemm gemm_d_x_s2_d_x_s (d_x_s2, schedule of d_x)") != std::string::npos);
  CHECK(text.find("then A2 d_x_s_a x B2 w1") != std::string::npos);
  CHECK(text.find("persistent blocks drawing tiles from a counter") != std::string::npos);
  CHECK(text.find("staged in shared memory, stored by TMA (128 columns at a time)") != std::string::npos);
  CHECK(text.find("A x: rows gathered through sorted_pair by cp.async; B w1, w3: by TMA") != std::string::npos);
}

TEST_CASE("gemm plan: what the backend cannot run is a user error before any code") {
  // A combination no GEMM can run is the schedule's own error, for every
  // backend (clusters without TMA); one that depends on the step (two B
  // operands of 256 columns each) is the plan's, before any code.
  Example ex = make_example("swiglu_moe", small());
  Schedule s = preset("scattermoe");
  s.cluster("o", 2).tma("o", false);
  CHECK_THROWS_WITH_AS(lower(ex.pipeline, s),
                       doctest::Contains("clusters of two row tiles multicast TMA loads from the warp-specialised "
                                         "loop: add mma(\"o\", wgmma_ws) and tma(\"o\", true), or drop cluster"),
                       UserError);
  Schedule wide = preset("scattermoe");
  wide.tile("h", 128, 256, 64);
  KernelProgram q = lower(ex.pipeline, wide);
  CHECK_THROWS_WITH_AS(plan_gemm(q, gemm_named(q, "gemm_h")),
                       doctest::Contains("2 B operands with tile_n 256 need 256 accumulator registers per thread"),
                       UserError);
}

TEST_CASE("gemm plan: a choice named for a Func that its GEMM cannot take is said, not dropped") {
  Example ex = make_example("moe_mlp", small());
  Schedule base("t");
  base.tile("*", 128, 128, 64).mma("*", MmaKind::wgmma_ws);
  // A TMA store without the TMA loads it comes with.
  Schedule store = base;
  store.tma_store("h", true);
  std::vector<std::string> notes = not_applied_choices(lower(ex.pipeline, store));
  REQUIRE(notes.size() == 1);
  CHECK(notes[0] == "definition 'h': tma_store(\"h\", true) is not applied: TMA stores come with TMA loads "
                    "(tma(\"h\", true) on the wgmma loop)");
  // An expert reduction's TMA loads and clusters, where neither operand is
  // the zero-padded bf16 rows TMA boxes read; its persistent walk is taken
  // with both operands by cp.async.
  Schedule reduce = base;
  reduce.tma("d_w1", true).cluster("d_w1", 2).persistent("d_w1", true);
  notes = not_applied_choices(lower_training(ex.pipeline, ex.pipeline.func("y"), reduce).program);
  REQUIRE(notes.size() == 2);
  CHECK(notes[0] == "definition 'd_w1': tma(\"d_w1\", true) is not applied: an expert reduction reads an operand by "
                    "TMA where it is zero-padded bf16 rows in the padded order (A's segments whole 64-row boxes too), "
                    "which neither 'x' nor 'd_x_s_a' is (padded_elementwise(true) and bf16_activations(true) make "
                    "them so)");
  CHECK(notes[1] == "definition 'd_w1': cluster(\"d_w1\", 2) is not applied: an expert reduction (K over one "
                    "expert's rows) runs without clusters");
  // The plan prints them with the GEMM.
  const std::string plans = describe_gemm_plans(lower_training(ex.pipeline, ex.pipeline.func("y"), reduce).program);
  CHECK(plans.find("  note: cluster(\"d_w1\", 2) is not applied") != std::string::npos);
  // The same choices as the default ("*") apply where they can and say
  // nothing elsewhere; where they apply, nothing is said either.
  Schedule everywhere = base;
  everywhere.tma("*", true).persistent("*", true).tma_store("*", true);
  CHECK(not_applied_choices(lower_training(ex.pipeline, ex.pipeline.func("y"), everywhere).program).empty());
  Example swiglu = make_example("swiglu_moe", small());
  CHECK(not_applied_choices(lower_training(swiglu.pipeline, swiglu.pipeline.func("y"), bench::tuned_wide(true)).program)
            .empty());
  // A warp layout named for a wgmma GEMM, which lays its warps out itself.
  Schedule warps = base;
  warps.warps("h", 4, 2);
  CHECK(not_applied_choices(lower(ex.pipeline, warps)) ==
        std::vector<std::string>{"definition 'h': warps(\"h\", 4, 2) is not applied: the wgmma_ws loop lays its warps "
                                 "out itself (a warpgroup per 64 rows of the tile); warps() shapes mma_sync tiles"});
  // Where a choice came from does not make two tilings differ.
  CHECK(reduce.for_func("d_w1").tiling.named.tma);
  CHECK(!everywhere.for_func("d_w1").tiling.named.tma);
  GemmTiling a = reduce.for_func("d_w1").tiling, b = a;
  b.named = {};
  CHECK(a == b);
}

TEST_CASE("gemm plan: persistent clusters store their tiles by TMA, each block past its own ring") {
  // Mixtral's width with the blocked permutation: h and o in tile order.
  Example ex = make_example("swiglu_moe", testing::shape(1024, 4096, 14336, 8, 2));
  Schedule s("pairs");
  s.permutation(Permutation::blocked).tile("*", 128, 128, 64).mma("*", MmaKind::wgmma_ws).tma("*", true);
  s.cluster("*", 2).persistent("*", true).tma_store("*", true).tile("o", 128, 256, 64);
  KernelProgram p = lower(ex.pipeline, s);
  for (const char *name : {"gemm_h", "gemm_o"}) {
    GemmPlan plan = plan_gemm(p, gemm_named(p, name));
    INFO(name);
    CHECK(plan.pair_items());
    CHECK(plan.out_tma());
    // 4 stages of 48 KiB and half of a 128-row tile's columns staged.
    CHECK(plan.staging_bytes == 128 * 128 * 2);
    CHECK(plan.shared_bytes() <= Schedule::max_shared_bytes);
  }
  const CudaModuleSource src = generate_cuda(p);
  CHECK(src.source.find("auto ring = Cfg::pair_ring(smem, Cfg::BM * 128 * 2);") != std::string::npos);
  CHECK(src.source.find("Cfg::pair_done(tile_counter);\n  Cfg::out_done();") != std::string::npos);
  testing::check_resources(cuda::compile_layer(ex.pipeline, s), s.to_text());
  // A cluster per pair of row tiles (not persistent) keeps plain stores,
  // and says so.
  Schedule plain = s;
  plain.persistent("h", false).tma_store("h", true);
  KernelProgram q = lower(ex.pipeline, plain);
  CHECK_FALSE(plan_gemm(q, gemm_named(q, "gemm_h")).out_tma());
  const std::vector<std::string> notes = not_applied_choices(q);
  REQUIRE(notes.size() == 1);
  CHECK(notes[0] == "definition 'h': tma_store(\"h\", true) is not applied: in clusters, TMA stores come with "
                    "persistent blocks (persistent(\"h\", true)); a cluster per pair of row tiles keeps plain stores");
}
