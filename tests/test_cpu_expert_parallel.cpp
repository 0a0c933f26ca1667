// Expert parallelism on the CPU backend with a loopback exchange: both sides
// of split_expert_parallel compiled by the LLVM backend, ranks emulated in
// one process (tests/expert_parallel_emulation.h), the step's output and
// every gradient equal to the unsplit layer's reference over all ranks'
// tokens, for one rank and for several.
#include <doctest/doctest.h>

#include <map>
#include <memory>
#include <sstream>

#include "backends/cpu/cpu_layer.h"
#include "examples/examples.h"
#include "expert_parallel_emulation.h"
#include "schedules/presets.h"

using namespace moeforge;
using namespace moeforge::testing;

namespace {

// Runs a pipeline on the CPU backend under `schedule` (each distinct
// pipeline compiled once) and returns every output's values.
Evaluator cpu_evaluator(const Schedule &schedule) {
  auto cache = std::make_shared<std::map<std::string, std::unique_ptr<cpu::CompiledCpuLayer>>>();
  return [cache, schedule](const Pipeline &p, const TensorMap &inputs, const std::string &route) {
    std::ostringstream key;
    key << p;
    auto &compiled = (*cache)[key.str()];
    if (!compiled)
      compiled = std::make_unique<cpu::CompiledCpuLayer>(cpu::compile_cpu_layer(p, schedule));
    int64_t tokens = 0;
    for (const BufferPtr &b : p.buffers())
      if (!b->dims.empty() && b->dims[0].is_dynamic() && !b->dims[0].get()->base) // the token Dim, not the pairs
        tokens = inputs.at(b->name).shape[0];
    REQUIRE(tokens > 0);
    cpu::CpuLayer layer(*compiled, tokens);
    layer.upload(inputs);
    layer.poison();
    layer.run();
    Evaluated out;
    for (const Func &f : p.outputs())
      out.values[f.name()] = layer.download(f.name());
    out.experts = layer.routed_experts(route);
    return out;
  };
}

} // namespace

TEST_CASE("cpu expert parallel: a loopback step on the CPU backend equals the unsplit layer's reference") {
  const ExampleShape s{48, 8, 2, 16, 24};
  for (const char *example : {"moe_mlp", "swiglu_moe"})
    for (const char *schedule : {"megablocks", "scattermoe"})
      for (const std::vector<int64_t> &bounds :
           {std::vector<int64_t>{0, 48}, std::vector<int64_t>{0, 20, 48}, std::vector<int64_t>{0, 9, 21, 30, 48}}) {
        const int ranks = static_cast<int>(bounds.size()) - 1;
        CAPTURE(example);
        CAPTURE(schedule);
        CAPTURE(ranks);
        Example ex = make_example(example, s);
        TensorMap in = ex.random_inputs(s, 31 + ranks);
        std::mt19937_64 rng(5);
        HostTensor dy = random_tensor(in.at("x").shape, rng);
        ExpertParallelSplit split = split_expert_parallel(ex.pipeline, ranks);
        EmulatedStep got = emulate_expert_parallel(split, in, bounds, cpu_evaluator(preset(schedule)), &dy);

        // The reference of the unsplit layer, routed as the CPU backend routed.
        std::vector<int32_t> experts;
        std::vector<HostTensor> ys, dxs;
        HostTensor d_wr = got.token[0].at("d_wr");
        for (int q = 0; q < ranks; ++q) {
          ys.push_back(got.token[q].at("y"));
          dxs.push_back(got.token[q].at("d_x"));
          if (q > 0)
            for (int64_t i = 0; i < d_wr.size(); ++i)
              d_wr.data[i] += got.token[q].at("d_wr").data[i];
        }
        TrainingAlgebra whole = training_algebra(ex.pipeline, ex.pipeline.func("y"));
        TensorMap whole_in = in;
        whole_in["d_y"] = dy;
        EvalResult want = evaluate(whole.pipeline, whole_in);
        CHECK(max_normalized_error(row_concat(ys), want["y"]) < 1e-2);
        CHECK(max_normalized_error(row_concat(dxs), want["d_x"]) < 2e-2);
        CHECK(max_normalized_error(d_wr, want["d_wr"]) < 2e-2);
        for (const std::string &w : split.expert_params) {
          CAPTURE(w);
          std::vector<HostTensor> parts;
          for (int p = 0; p < ranks; ++p)
            parts.push_back(got.experts[p].at("d_" + w));
          CHECK(max_normalized_error(row_concat(parts), want["d_" + w]) < 2e-2);
        }
      }
}
