// Programmatic dependent launch (tiles/grid_dependency.cuh): the runtime
// launches every generated kernel and every routing kernel early, so the GPU
// may schedule one while the kernel before it still runs. That is only safe
// for a kernel whose first statement waits for its predecessor; a kernel
// without it would read inputs still being written. Checked on the sources,
// without a GPU: the routing kernels and the kernels of forward and training
// programs of every kind of step (GEMMs of each walk, element-wise steps,
// the padded copy, transposes, the fused attention).
#include <doctest/doctest.h>

#include <regex>
#include <string>
#include <vector>

#include "backends/cuda/codegen/codegen_cuda.h"
#include "backends/cuda/runtime/routing_kernels.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "schedules/presets.h"

using namespace moeforge;

namespace {

// The kernels `source` defines, each with the first statement of its body
// (macro line continuations joined, as the preprocessor sees them; line
// comments skipped).
std::vector<std::pair<std::string, std::string>> kernel_entries(std::string source) {
  source = std::regex_replace(source, std::regex("\\\\\\n"), " ");
  std::vector<std::pair<std::string, std::string>> out;
  const std::string marker = "extern \"C\" __global__";
  for (size_t at = source.find(marker); at != std::string::npos; at = source.find(marker, at + 1)) {
    const size_t open = source.find('{', at);
    REQUIRE(open != std::string::npos);
    // The kernel's name: the identifier before its parameter list.
    const size_t paren = source.find('(', source.find(')', source.find("__launch_bounds__", at)) + 1);
    std::string head = source.substr(at, paren - at);
    const size_t name_at = head.find_last_of(" \n(");
    const std::string name = head.substr(name_at + 1);
    size_t first = source.find_first_not_of(" \n", open + 1);
    while (source.compare(first, 2, "//") == 0) // a comment after the brace (a parameter's)
      first = source.find_first_not_of(" \n", source.find('\n', first));
    out.emplace_back(name, source.substr(first, source.find(';', first) + 1 - first));
  }
  return out;
}

void check_every_kernel_waits(const std::string &source, const std::string &what) {
  const auto entries = kernel_entries(source);
  CHECK_MESSAGE(!entries.empty(), what);
  for (const auto &[name, first] : entries)
    CHECK_MESSAGE(first == "mf::wait_for_previous_grid();",
                  what << ": kernel '" << name << "' starts with '" << first << "'");
}

} // namespace

TEST_CASE("grid dependency: every routing kernel waits for the kernel before it first") {
  const auto entries = kernel_entries(cuda::routing_kernels_source());
  // The top-k kernels are instantiated from one macro; each instance counts.
  CHECK(entries.size() >= 5);
  check_every_kernel_waits(cuda::routing_kernels_source(), "routing kernels");
}

TEST_CASE("grid dependency: every generated kernel waits for the kernel before it first") {
  for (const char *name : {"swiglu_moe", "moe_mlp", "dense_mlp", "deepseek_moe", "moa"}) {
    const Example ex = make_example(name, testing::shape(64, name == std::string("moa") ? 64 : 128, 256, 8, 2));
    const Func out = ex.pipeline.func(ex.output);
    // The forward alone and the training step each by their own default, and the blocked permutation.
    struct Case {
      std::string schedule;
      Schedule forward, training;
    };
    std::vector<Case> cases{{"default", default_schedule(ex.pipeline, {}), default_schedule(ex.pipeline, {out})},
                            {"megablocks", preset("megablocks"), preset("megablocks")}};
    for (const Case &c : cases) {
      const std::string what = std::string(name) + " / " + c.schedule;
      check_every_kernel_waits(generate_cuda(lower(ex.pipeline, c.forward)).source, what + " forward");
      check_every_kernel_waits(generate_cuda(lower_training(ex.pipeline, out, c.training).program).source,
                               what + " training");
    }
    if (name == std::string("moa"))
      check_every_kernel_waits(
          generate_cuda(lower(ex.pipeline, default_schedule(ex.pipeline, {}).fused_attention(true))).source,
          "moa / fused attention forward");
  }
}

TEST_CASE("grid dependency: the check finds a kernel that does not wait") {
  const std::string bad = "extern \"C\" __global__ void __launch_bounds__(256) k(int *x) {\n  x[0] = 1;\n}\n";
  const auto entries = kernel_entries(bad);
  REQUIRE(entries.size() == 1);
  CHECK(entries[0].first == "k");
  CHECK(entries[0].second == "x[0] = 1;");
}
