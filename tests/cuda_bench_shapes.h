// The CUDA tests of a training choice at full size without a GPU: the
// SwiGLU layer's training step compiled for sm_90a at bench_moe_train's
// four SwiGLU shapes, every kernel within an SM's resources (no spills).
#pragma once

#include <doctest/doctest.h>

#include <functional>
#include <string>

#include "backends/cuda/runtime/training_layer.h"
#include "cuda_resources.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"

namespace moeforge::testing {

// fine64, gpt-oss, mixtral and qwen3moe (benchmarks/moe_shapes.h): the
// schedule is `of` the layer's default there; `check` then reads the
// compiled step (its program, its source).
inline void check_bench_shapes(const std::string &what, const std::function<Schedule(const Schedule &)> &of,
                               const std::function<void(const cuda::CompiledTraining &)> &check) {
  for (const ExampleShape &s : {shape(16384, 2048, 1408, 64, 8), shape(8192, 2880, 2880, 128, 4),
                                shape(8192, 4096, 14336, 8, 2), shape(16384, 2048, 768, 128, 8)}) {
    INFO("d " << s.d << " f " << s.f << " E " << s.experts);
    Example ex = make_example("swiglu_moe", s);
    const Func out = ex.pipeline.func(ex.output);
    const cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, out, of(default_schedule(ex.pipeline, {out})));
    check_resources(c.layer, "swiglu_moe / " + what);
    check(c);
  }
}

} // namespace moeforge::testing
