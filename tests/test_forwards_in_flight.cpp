// Which saved memory a training layer on caller memory lets a backward read
// (runtime/forwards_in_flight.h), the bookkeeping both backends share.
#include <doctest/doctest.h>

#include "examples/examples.h"
#include "lowering/default_schedule.h"
#include "lowering/training.h"
#include "runtime/forwards_in_flight.h"
#include "schedules/presets.h"
#include "training_compare.h"
#include "user_error.h"

using namespace moeforge;
using namespace moeforge::testing;

TEST_CASE("forwards in flight: a backward takes the saved memory of a recent forward at its count, once where it "
          "writes over it") {
  Example ex = make_example("swiglu_moe", shape(64, 64, 128, 8, 2));
  // The default schedule's backward writes over what its forward saved.
  const TrainingProgram over = lower_training(ex.pipeline, {ex.pipeline.func(ex.output)},
                                              default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)}));
  const TrainingProgram keep = lower_training(ex.pipeline, {ex.pipeline.func(ex.output)}, preset("scattermoe"));
  REQUIRE(!over.written_over_saved.empty());
  REQUIRE(keep.written_over_saved.empty());
  // Each forward's saved memory in two parts (a tensor, the tables).
  const SavedParts a{0x1000, 0x1800}, b{0x2000, 0x2800};
  ForwardsInFlight f;
  CHECK_THROWS_WITH_AS(f.check_backward(over, a, 8), doctest::Contains("no forward at 8 tokens"), UserError);
  f.forward_wrote(a, 8);
  f.forward_wrote(b, 8);
  CHECK_NOTHROW(f.check_backward(over, a, 8));
  // One forward's tensor with another's tables: no forward wrote that.
  CHECK_THROWS_WITH_AS(f.check_backward(over, {a[0], b[1]}, 8), doctest::Contains("no forward at 8 tokens"), UserError);
  CHECK_THROWS_WITH_AS(f.check_backward(over, a, 9), doctest::Contains("no forward at 9 tokens"), UserError);
  f.backward_ran(keep, a, 8); // the saved memory is still there
  CHECK_NOTHROW(f.check_backward(over, a, 8));
  CHECK_FALSE(f.spent(a, 8));
  f.backward_ran(over, a, 8);
  CHECK(f.spent(a, 8));
  CHECK_THROWS_WITH_AS(f.check_backward(over, a, 8), doctest::Contains(over.one_backward_reason().c_str()), UserError);
  CHECK_NOTHROW(f.check_backward(over, b, 8));
  f.forward_wrote(a, 8); // written again: that forward's now
  CHECK_FALSE(f.spent(a, 8));
  CHECK_NOTHROW(f.check_backward(over, a, 8));
  // Only the most recent forwards are remembered.
  for (uint64_t i = 1; i <= ForwardsInFlight::kRecent; ++i)
    f.forward_wrote({0x10000 + i * 0x100, 0x90000}, 8);
  CHECK_THROWS_WITH_AS(f.check_backward(over, b, 8), doctest::Contains("no forward at 8 tokens"), UserError);
  CHECK_NOTHROW(f.check_backward(over, {0x10000 + ForwardsInFlight::kRecent * 0x100, 0x90000}, 8));
}
