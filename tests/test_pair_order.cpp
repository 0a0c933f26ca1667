// lowering/pair_order: routed tensors that no GEMM loads are stored in the
// pair order (T k rows), not the padded one (T k + E (block - 1) rows): a
// training forward's saved pre-activations, and the backward's per-pair
// rows of the input gradient.
#include <doctest/doctest.h>

#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/training.h"
#include "runtime/memory_plan.h"
#include "runtime/memory_report.h"
#include "runtime/program_shapes.h"

using namespace moeforge;

namespace {

// The backward keeps what it reads (gradients_over_saved(false)): with it
// on, the gradients take the pre-activations' bytes and so their padded
// order (test_gradients_over_saved.cpp).
TrainingProgram lowered(const std::string &example, const ExampleShape &s) {
  Example ex = make_example(example, s);
  const Func out = ex.pipeline.func(ex.output);
  return lower_training(ex.pipeline, out, default_schedule(ex.pipeline, {out}).gradients_over_saved(false));
}

} // namespace

TEST_CASE("saved pair order: SwiGLU's pre-activations are saved in pair order, the padding not kept") {
  const ExampleShape s = testing::shape(16384, 2048, 768, 128, 8); // qwen3moe
  const TrainingProgram t = lowered("swiglu_moe", s);
  int pair_saved = 0;
  for (const std::string &name : t.saved) {
    const TensorDecl &d = t.program.tensor(name);
    if (!d.route || d.dims.size() != 2)
      continue;
    CHECK_MESSAGE(d.layout == RowLayout::pair, name);
    CHECK_FALSE(d.zero_padding);
    ++pair_saved;
  }
  CHECK(pair_saved == 2); // h_silu_in and h_rhs
  // Their GEMM scatters them to pair rows; h, which the down projection
  // reads by TMA, stays in tile order.
  int writers = 0;
  for (const Step &st : t.program.steps)
    if (auto *g = std::get_if<GemmStep>(&st); g && g->output == "h_silu_in") {
      ++writers;
      CHECK(g->out_rows == RowMap::gather_pair);
      REQUIRE(g->extra.size() == 2);
      CHECK(t.program.tensor("h").layout == RowLayout::padded);
    }
  CHECK(writers == 1);
  ProgramShapes shapes(t.program, s.tokens);
  auto bytes = [&](const TensorDecl &d) { return size_t(shapes.elements(d)) * dtype_bytes(d.dtype); };
  const StepMemoryPlan plan = plan_step_memory(t.program, bytes, t.forward_steps);
  // T k x f bf16, twice, plus the probabilities: 392 MiB where the padded
  // order took 440.
  const size_t pre = size_t(16384) * 8 * 768 * 2;
  CHECK(plan.saved.arena_bytes >= 2 * pre);
  CHECK(plan.saved.arena_bytes < 2 * pre + (size_t(16) << 20));
}

TEST_CASE("saved pair order: a pre-activation stored by TMA stays in tile order") {
  // GeLU's GEMM stores its pre-activation and h by TMA (the default's rule
  // for one B operand with two results): pair rows would cost it that.
  const TrainingProgram t = lowered("moe_mlp", testing::shape(512, 256, 128, 8, 2));
  int stored_by_tma = 0;
  for (const Step &st : t.program.steps)
    if (auto *g = std::get_if<GemmStep>(&st); g && g->tiling.tma_store && !g->extra.empty() && g->route) {
      CHECK(t.program.tensor(g->output).layout == RowLayout::padded);
      ++stored_by_tma;
    }
  CHECK(stored_by_tma == 1);
}

TEST_CASE("pair order: the backward's per-pair input-gradient rows are stored in pair order") {
  // qwen3moe under the default schedule: the GEMM making the experts' share
  // of d_x stores each row at sorted_pair[p] (plain stores), and only the
  // sum over each token's pairs reads them. With x's rows gathered by the
  // weight-gradient GEMMs (gather_in_gemms: no padded copy of x), they are
  // the backward's fullest tensor: T k x d bf16, 512 MiB, where the padded
  // order took 576.
  const ExampleShape s = testing::shape(16384, 2048, 768, 128, 8);
  Example ex = make_example("swiglu_moe", s);
  const Func out = ex.pipeline.func(ex.output);
  for (bool gather : {false, true}) {
    Schedule sched = default_schedule(ex.pipeline, {out});
    sched.gather_in_gemms(gather);
    const TrainingProgram t = lower_training(ex.pipeline, out, sched);
    INFO("gather_in_gemms " << gather);
    const TensorDecl &rows = t.program.tensor("d_x_s2");
    CHECK(rows.layout == RowLayout::pair);
    CHECK_FALSE(rows.zero_padding);
    int writers = 0;
    for (size_t i = t.forward_steps; i < t.program.steps.size(); ++i)
      if (auto *g = std::get_if<GemmStep>(&t.program.steps[i]); g && g->output == "d_x_s2") {
        ++writers;
        CHECK(g->out_rows == RowMap::gather_pair);
        CHECK_FALSE(g->tiling.tma_store);
      }
    CHECK(writers == 1);
    // The GEMMs' operands keep each tile's rows consecutive: grouped by
    // expert, without padding (sorted_saved, on in the default), where the
    // weight gradients read x's padded copy by TMA; padded beside x
    // gathered (lowering/sorted_rows.h).
    CHECK(t.program.tensor("d_x_s_a").layout == (gather ? RowLayout::padded : RowLayout::sorted));
    const std::string report = memory_report(t.program, t.forward_steps, s.tokens);
    const std::string backward = report.substr(report.find("backward workspace"));
    // Beside x gathered, the rows and the logits' gradient (524.1 MiB before
    // the router's other gradients were scratch in d_x's memory); beside x's
    // copy, sorted too (sorted_gathers) and as large as the rows, the rows
    // alone (the logits' gradient scratch in d_w1's).
    CHECK(backward.find(gather ? "backward workspace  516.0 MiB" : "backward workspace  512.0 MiB") == 0);
    CHECK(backward.find("d_x_s2 512.0 MiB") != std::string::npos);
  }
}

TEST_CASE("pair order: per-pair rows added atomically onto d_x are not stored at all") {
  // Under atomic_input_gradient the GEMM adds each pair's row onto its
  // token's row of d_x: no per-pair tensor is left to store in pair order.
  Example ex = make_example("swiglu_moe", testing::shape(512, 256, 128, 8, 2));
  const Func y = ex.pipeline.func(ex.output);
  Schedule sched = default_schedule(ex.pipeline, {y});
  sched.atomic_input_gradient(true);
  const TrainingProgram a = lower_training(ex.pipeline, y, sched);
  int atomic = 0;
  for (const Step &st : a.program.steps)
    if (auto *g = std::get_if<GemmStep>(&st); g && g->out_add) {
      ++atomic;
      CHECK(g->out_rows == RowMap::gather_token);
    }
  CHECK(atomic >= 1);
  CHECK(a.program.find("d_x_s2") == nullptr);
}
