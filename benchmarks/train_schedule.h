// The training benchmark's widest schedule, shared with the GPU test that
// checks it, so that what is timed is what is tested.
#pragma once

#include <string>

#include "benchmarks/source_file.h"
#include "schedules/presets.h"

namespace moeforge::bench {

// The training benchmark's widest schedule for a SwiGLU or a GeLU layer:
// benchmarks/schedules/train/tuned_wide_{swiglu,gelu}.sched, which says
// what each primitive is for.
inline Schedule tuned_wide(bool swiglu) {
  return Schedule::load(
      source_file(std::string("benchmarks/schedules/train/tuned_wide_") + (swiglu ? "swiglu" : "gelu") + ".sched"));
}

} // namespace moeforge::bench
