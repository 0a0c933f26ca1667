// The narrow tail (Schedule::narrow_tail): where a GEMM's last column tile
// holds half the tile's columns or fewer, that tile's wgmmas are the half-
// or quarter-width instruction covering them. In CI: the choice prints,
// saves and replays; the plan takes it where it applies and says why where
// it does not; the training step compiles for sm_90a without spills, and
// at fine64's widths (f = 1408 under 256-wide tiles: half) and gptoss's
// (2880: a quarter) without serialised wgmmas. On a GPU: training steps
// against the float64 reference where every single-B GEMM has a narrow
// tail, of each width.
#include <doctest/doctest.h>

#include <algorithm>
#include <iterator>
#include <vector>

#include "cuda_resources.h"
#include "cuda_training_step.h"
#include "gpu_test.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/gemm_plan.h"
#include "lowering/training.h"

using namespace moeforge;
using testing::check_resources;

namespace {

// The single-B contractions of a SwiGLU layer's training step, each tiled
// 256 wide by the default schedule; h (two B operands) and the router's
// logits (64 wide) are named too, to see the plan refuse them by name.
const char *const kNamed[] = {"o", "d_h", "d_w1", "d_w2", "d_w3", "d_x", "h", "logits"};

Schedule narrow(const Example &ex) {
  Schedule s = default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)});
  for (const char *f : kNamed)
    s.narrow_tail(f, true);
  return s;
}

// d = f = 320: every column extent is 256 + 64, so each 256-wide GEMM's
// last column tile holds 64 columns (m64n64 wgmmas); at 384, 128 (m64n128).
ExampleShape tails(int64_t tokens, int64_t width = 320) { return testing::shape(tokens, width, width, 8, 2); }

} // namespace

TEST_CASE("schedule: narrow_tail prints, saves and replays") {
  Schedule s("tails");
  s.narrow_tail("d_h", true).narrow_tail("o", false);
  CHECK(s.to_text().find("narrow_tail(\"d_h\", true)") != std::string::npos);
  const Schedule again = Schedule::from_text(s.to_text());
  CHECK(again.for_func("d_h").tiling.narrow_tail);
  CHECK_FALSE(again.for_func("o").tiling.narrow_tail);
  CHECK_FALSE(again.for_func("h").tiling.narrow_tail); // off unless named
  CHECK(again.to_text() == s.to_text());
}

TEST_CASE("gemm plan: the narrow tail where the last column tile is half full or less, else a note naming why") {
  const Example ex = make_example("swiglu_moe", tails(64));
  const TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), narrow(ex));
  int narrow_gemms = 0;
  for (const Step &st : t.program.steps) {
    const auto *g = std::get_if<GemmStep>(&st);
    if (!g)
      continue;
    const GemmPlan &p = planned(*g);
    INFO(g->name);
    if (std::find(std::begin(kNamed), std::end(kNamed), g->func) == std::end(kNamed))
      continue; // not named (the router's weight gradient)
    if (g->func == "h" || g->func == "logits") {
      CHECK_FALSE(p.narrow_tail);
      continue;
    }
    CHECK(p.narrow_tail);
    CHECK(describe(p, *g).find("the last column tile (64 columns) by m64n64 wgmmas") != std::string::npos);
    ++narrow_gemms;
  }
  CHECK(narrow_gemms >= 6); // o, d_h, d_w1, d_w2, d_w3 and d_x's products
  const std::vector<std::string> notes = not_applied_choices(t.program);
  auto noted = [&](const std::string &part) {
    for (const std::string &n : notes)
      if (n.find(part) != std::string::npos)
        return true;
    return false;
  };
  CHECK(noted("narrow_tail(\"h\", true) is not applied: it has 2 B operands, whose wgmmas run as one"));
  CHECK(noted("narrow_tail(\"logits\", true) is not applied: its tile is 64 columns wide, the narrowest wgmma tile "
              "moeforge runs"));
  // A full last tile (d = 256 under 256-wide tiles) takes nothing.
  const Example full = make_example("swiglu_moe", testing::shape(64, 256, 320, 8, 2));
  const TrainingProgram f = lower_training(full.pipeline, full.pipeline.func(full.output), narrow(full));
  bool o_noted = false;
  for (const std::string &n : not_applied_choices(f.program))
    o_noted |= n.find("narrow_tail(\"o\", true) is not applied: its last column tile is full or more than half full "
                      "(N = 256, tile_n 256)") != std::string::npos;
  CHECK(o_noted);
}

TEST_CASE("codegen: the narrow tail compiles for sm_90a, and at fine64's widths without serialised wgmmas") {
  {
    const Example ex = make_example("swiglu_moe", tails(64));
    cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), narrow(ex));
    check_resources(c.layer, "swiglu_moe / default + narrow_tail at d = f = 320");
    for (const char *k : {"gemm_o", "gemm_d_h", "gemm_d_w1", "gemm_d_w2", "gemm_d_w3"})
      CHECK_MESSAGE(testing::kernel_source(c.layer, k).find("acc, N - n0") != std::string::npos, k);
  }
  // fine64 (half-width tails) and gptoss (quarter-width): K long enough
  // that ptxas sees the main loops as the benchmark runs them. The per-tile
  // choice between the whole and the narrower groups must not serialise the
  // wgmmas (warning C7520), which would cost far more than the tail saves.
  struct Widths {
    ExampleShape shape;
    std::vector<const char *> kernels;
  };
  for (const Widths &w : {Widths{testing::shape(16384, 2048, 1408, 64, 8), {"gemm_d_h", "gemm_d_w1", "gemm_d_w3"}},
                          Widths{testing::shape(8192, 2880, 2880, 128, 4),
                                 {"gemm_o", "gemm_d_h", "gemm_d_w1", "gemm_d_w2", "gemm_d_w3"}}}) {
    const Example ex = make_example("swiglu_moe", w.shape);
    Schedule s = default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)});
    for (const char *f : {"o", "d_h", "d_w1", "d_w2", "d_w3", "d_x"})
      s.narrow_tail(f, true);
    cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), s);
    for (const char *k : w.kernels) {
      INFO("d = " << w.shape.d << ", f = " << w.shape.f << ": " << k);
      CHECK(testing::kernel_source(c.layer, k).find("acc, N - n0") != std::string::npos);
      const cuda::ResourceReport *r = c.layer.resources_of(k);
      REQUIRE(r != nullptr);
      CHECK_FALSE(r->wgmma_serialized);
      CHECK(r->spill_store_bytes == 0);
      CHECK(r->spill_load_bytes == 0);
    }
  }
}

TEST_SUITE("gpu") {
  TEST_CASE("cuda gpu: a training step with every single-B GEMM's last column tile narrower matches the "
            "reference") {
    MOEFORGE_REQUIRE_GPU();
    for (int64_t width : {320, 384}) // m64n64 and m64n128 tails
      for (int64_t tokens : {1, 37, 300}) {
        const ExampleShape s = tails(tokens, width);
        const Example ex = make_example("swiglu_moe", s);
        INFO("d = f = " << width << ", " << tokens << " tokens");
        const testing::Outcome o = testing::cuda_train_and_compare(ex, ex.random_inputs(s, 31), tokens, narrow(ex));
        CHECK(o.routing_mismatches == 0);
        CHECK(o.worst_error <= 2e-2);
      }
  }
}
