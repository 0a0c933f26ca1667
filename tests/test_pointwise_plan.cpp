// The CUDA target's plan of each element-wise step (lowering/pointwise_plan.h),
// checked without a GPU: who computes an element, how many consecutive ones
// a thread takes, and the padded order's row slots, over the training steps
// of layers that have each kind.
#include <doctest/doctest.h>

#include <map>
#include <set>
#include <variant>

#include "benchmarks/train_schedule.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/pointwise_plan.h"
#include "lowering/training.h"
#include "schedules/presets.h"

using namespace moeforge;

TEST_CASE("pointwise plan: every walk where its steps call for it, vectors only where each output takes them") {
  std::set<ElementWalk> seen;
  bool padded = false, vectorised = false;
  for (const char *name : {"moe_mlp", "swiglu_moe", "expert_bias_moe", "rmsnorm_moe"}) {
    const Example ex = make_example(name, testing::shape(96, 64, 128, 8, 2));
    for (const Schedule &s : {preset("scattermoe"), bench::tuned_wide(std::string(name) == "swiglu_moe")}) {
      const KernelProgram p = lower_training(ex.pipeline, ex.pipeline.func(ex.output), s).program;
      for (const Step &st : p.steps) {
        const auto *pw = std::get_if<PointwiseStep>(&st);
        if (!pw)
          continue;
        INFO(name << " / " << s.name() << " / " << pw->name);
        const PointwisePlan plan = plan_pointwise(p, *pw);
        seen.insert(plan.walk);
        CHECK((plan.per_thread == 1 || plan.per_thread == 8));
        const bool row_sums =
            std::any_of(pw->extra.begin(), pw->extra.end(), [](const ExtraOutput &e) { return e.row_sum; });
        CHECK((plan.walk == ElementWalk::warp_per_row) == row_sums);
        const bool long_sum = has_long_reduction(pw->body);
        if (plan.walk == ElementWalk::thread)
          CHECK_FALSE(long_sum);
        if (plan.walk == ElementWalk::block)
          CHECK(long_sum);
        // Eight at a time only along a static innermost index of a multiple of 8.
        if (plan.per_thread == 8) {
          vectorised = true;
          CHECK(!pw->vars.back().dim().is_dynamic());
          CHECK(pw->vars.back().dim().extent() % 8 == 0);
        }
        if (plan.padded_rows) {
          padded = true;
          // (Or sorted, beside a padded output whose padding the walk zeroes.)
          CHECK((p.tensor(pw->output).layout == RowLayout::padded || p.tensor(pw->output).layout == RowLayout::sorted));
          CHECK((plan.walk == ElementWalk::thread || plan.walk == ElementWalk::warp_per_row));
        }
      }
    }
  }
  CHECK(seen.count(ElementWalk::thread));
  CHECK(seen.count(ElementWalk::warp));         // the router's softmax: a warp per row
  CHECK(seen.count(ElementWalk::block));        // the norm weight's gradient: 64 elements, each a sum over tokens
  CHECK(seen.count(ElementWalk::warp_per_row)); // tuned_wide's row sums beside the gate gradient
  CHECK(padded);                                // tuned_wide's padded_elementwise
  CHECK(vectorised);
}
