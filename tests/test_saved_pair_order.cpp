// lowering/training.cpp (save_in_pair_order): a training forward's saved
// pre-activations that only element-wise steps read are kept in the pair
// order (T k rows), not the padded one (T k + E (block - 1) rows).
#include <doctest/doctest.h>

#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/training.h"
#include "runtime/memory_plan.h"
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
