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

// The text's part that `emit --passes` printed after `pass` ("" if none).
std::string pass_section(const std::string &text, const std::string &pass) {
  const std::string header = "=== after " + pass + " ===\n";
  const size_t begin = text.find(header);
  if (begin == std::string::npos)
    return "";
  const size_t end = text.find("=== after ", begin + header.size());
  return text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

// The passes lower() runs, in order (lowering/lower.cpp).
const std::vector<std::string> kPasses = {"build_steps",
                                          "fuse_gate_into_epilogue",
                                          "split_unfused_epilogues",
                                          "insert_permutation",
                                          "assign_row_layouts",
                                          "resolve_row_maps",
                                          "materialize_transposes",
                                          "merge_sibling_gemms",
                                          "fuse_elementwise_consumers",
                                          "fuse_atomic_combines",
                                          "gate_from_routing",
                                          "softmax_into_routing",
                                          "fuse_attention"};

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
  // A pass-by-pass text: each pass's program on its own, so that a change
  // names the first pass whose output moved.
  if (want.rfind("=== after ", 0) == 0)
    for (const std::string &pass : kPasses) {
      const std::string a = pass_section(want, pass), b = pass_section(out.str(), pass);
      CHECK_MESSAGE(!b.empty(), "emit --passes printed nothing after " << pass);
      CHECK_MESSAGE(a == b, std::string(g.file)
                                << ": the program after " << pass << " differs at " << first_difference(a, b));
    }
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

TEST_CASE("golden: the program after each lowering pass (emit --passes)") {
  // Scattered rows with the gate in the last GEMM's epilogue (moe_mlp), a
  // blocked copy with the gate in the combine and SwiGLU's two B operands
  // merged (swiglu_moe), and a shared expert beside the routed ones
  // (deepseek_moe): together they take every pass's branches that change
  // the program.
  for (const Golden &g : std::vector<Golden>{
           {"moe_mlp_scattermoe.passes", {"emit", "moe_mlp", "--schedule", "scattermoe", "--passes"}},
           {"swiglu_moe_megablocks.passes", {"emit", "swiglu_moe", "--passes"}},
           {"deepseek_moe_scattermoe.passes",
            {"emit", "deepseek_moe", "--experts", "16", "--topk", "4", "--schedule", "scattermoe", "--passes"}},
       }) {
    INFO(std::string(g.file));
    check_golden(g);
  }
  // The passes' text is the forward's: the training step's is emit --ir --train.
  std::ostringstream out, err;
  CHECK(run_cli({"emit", "moe_mlp", "--passes", "--train"}, out, err) == 2);
  CHECK(err.str().find("--passes shows the forward's passes") != std::string::npos);
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
