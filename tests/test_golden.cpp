// Golden texts of the passes' printed output: the lowered kernel program
// (`emit --ir`, forward and training step) and each GEMM's plan on the CUDA
// backend (`emit --plan`), for the examples and schedules that exercise the
// passes' branches. A change to what a pass decides shows up as a diff here
// rather than as a kernel that is slower or wrong on a GPU. After an
// intended change, rewrite the files and review the diff:
//   MOEFORGE_UPDATE_GOLDEN=1 ./build/tests/moeforge_tests -tc="golden*"
#include <doctest/doctest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "source_files.h"
#include "tools/cli.h"

using namespace moeforge;

namespace {

struct Golden {
  const char *file; // under tests/golden/
  std::vector<std::string> args;
};

std::string read_file(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The first line where the two texts differ, both versions, for the message.
std::string first_difference(const std::string &want, const std::string &got) {
  std::istringstream a(want), b(got);
  std::string la, lb;
  for (int line = 1;; ++line) {
    const bool more_a = static_cast<bool>(std::getline(a, la)), more_b = static_cast<bool>(std::getline(b, lb));
    if (!more_a && !more_b)
      return "no difference";
    if (!more_a || !more_b || la != lb)
      return "line " + std::to_string(line) + ":\n  golden: " + (more_a ? la : "(end)") +
             "\n  now:    " + (more_b ? lb : "(end)");
  }
}

void check_golden(const Golden &g) {
  std::ostringstream out, err;
  REQUIRE_MESSAGE(run_cli(g.args, out, err) == 0, err.str());
  const std::string path = testing::source_file(std::string("tests/golden/") + g.file);
  if (const char *update = std::getenv("MOEFORGE_UPDATE_GOLDEN"); update && std::string(update) == "1") {
    std::ofstream(path, std::ios::binary) << out.str();
    MESSAGE("rewrote " << path);
    return;
  }
  const std::string want = read_file(path);
  REQUIRE_MESSAGE(!want.empty(), path << " is missing or empty: write it with MOEFORGE_UPDATE_GOLDEN=1");
  CHECK_MESSAGE(want == out.str(), std::string(g.file)
                                       << " differs at " << first_difference(want, out.str())
                                       << "\n(an intended change: MOEFORGE_UPDATE_GOLDEN=1, then review the diff)");
}

} // namespace

TEST_CASE("golden: the lowered programs (emit --ir) of the forward and the training step") {
  for (const Golden &g : std::vector<Golden>{
           {"moe_mlp_megablocks.ir", {"emit", "moe_mlp", "--ir"}},
           {"moe_mlp_scattermoe.ir", {"emit", "moe_mlp", "--schedule", "scattermoe", "--ir"}},
           {"swiglu_moe_scattermoe_train.ir", {"emit", "swiglu_moe", "--schedule", "scattermoe", "--ir", "--train"}},
           {"moe_mlp_megablocks_train.ir", {"emit", "moe_mlp", "--ir", "--train"}},
           {"deepseek_moe_megablocks.ir", {"emit", "deepseek_moe", "--experts", "16", "--topk", "4", "--ir"}},
           {"dense_mlp_megablocks_train.ir", {"emit", "dense_mlp", "--ir", "--train"}},
       }) {
    INFO(std::string(g.file));
    check_golden(g);
  }
}

#ifdef MOEFORGE_HAVE_CUDA
TEST_CASE("golden: the GEMM plans (emit --plan) under the presets and the benchmarks' schedule files") {
  const std::string pair_persist = testing::source_file("benchmarks/schedules/forward/tuned_tma_pair_o_gelu.sched");
  const std::string cluster = testing::source_file("tests/golden/b256_cluster_ho.sched");
  for (const Golden &g : std::vector<Golden>{
           {"moe_mlp_megablocks.plan", {"emit", "moe_mlp", "--plan"}},
           {"swiglu_moe_scattermoe_train.plan",
            {"emit", "swiglu_moe", "--schedule", "scattermoe", "--plan", "--train"}},
           {"moe_mlp_pair_persist_o.plan",
            {"emit", "moe_mlp", "--d", "1024", "--f", "4096", "--experts", "64", "--topk", "1", "--schedule",
             pair_persist, "--plan"}},
           {"moe_mlp_b256_cluster_ho.plan",
            {"emit", "moe_mlp", "--d", "1024", "--f", "4096", "--experts", "64", "--topk", "1", "--schedule", cluster,
             "--plan"}},
       }) {
    INFO(std::string(g.file));
    check_golden(g);
  }
}
#endif
