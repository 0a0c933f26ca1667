// The autotuner's parts that need no GPU: the search space and its pruning
// (backends/cuda/tune_space.h), the parallel compile of candidates, the
// tuned-schedule cache (tune_cache.h) and
// the CLI's `tune` where there is no GPU. The timed search runs on the device
// (scripts/device_run.sh's tune step).
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "layer_compare.h"

#include "backends/cuda/tune_cache.h"
#include "backends/cuda/tune_space.h"
#include "backends/cuda/tuner.h"
#include "dsl/error.h"
#include "examples/examples.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "schedules/presets.h"

using namespace moeforge;
using namespace moeforge::cuda;

namespace {

ExampleShape small() { return testing::shape(64, 128, 256, 8, 2); }

bool has(const std::string &text, const std::string &part) { return text.find(part) != std::string::npos; }

} // namespace

TEST_CASE("tune space: every Func's choices, pruned by the plans' legality and by equal plans") {
  Example ex = make_example("swiglu_moe", small());
  Schedule base = preset("scattermoe");
  const std::vector<std::string> funcs = tunable_funcs(ex.pipeline, ex.output, base, false);
  CHECK(funcs == std::vector<std::string>{"logits", "h", "o"});
  const size_t all = func_choices().size();
  CHECK(all == 32); // 2 tiles x 2 stage counts x persistent x TMA store x cluster
  // SwiGLU's h has two B operands: 256 columns each need 256 accumulator
  // registers a thread, which the plan rejects.
  FuncCandidates h = candidates_for(ex.pipeline, ex.output, base, "h", false);
  CHECK(h.kept.size() + h.pruned.size() == all);
  int registers = 0;
  for (const PrunedChoice &p : h.pruned) {
    INFO(p.choice.text() << ": " << p.why);
    registers += has(p.why, "need 256 accumulator registers per thread");
  }
  CHECK(registers == 16); // every 256-wide choice
  // The router's logits are f32, which a TMA store does not take: asking for
  // one gives the same plans as not asking, one candidate instead of two;
  // and the base's own settings (128 x 128, 4 stages) are no candidate.
  FuncCandidates logits = candidates_for(ex.pipeline, ex.output, base, "logits", false);
  int same = 0, current = 0;
  for (const PrunedChoice &p : logits.pruned) {
    INFO(p.choice.text() << ": " << p.why);
    CHECK(has(p.why, "the same plans as "));
    same += p.choice.tma_store;
    current += has(p.why, "the same plans as the current settings");
  }
  CHECK(same == 16);
  CHECK(current == 2);             // 128 x 128, 4 stages, with and without the TMA store request
  CHECK(logits.kept.size() == 15); // 32 - 16 asking for a TMA store - the current settings
  for (const FuncChoice &c : h.kept)
    CHECK(c.tile_n == 128);
  // Every kept candidate lowers and plans: what the tuner times compiles.
  for (const FuncChoice &c : h.kept)
    CHECK_NOTHROW(lower(ex.pipeline, with_choice(base, "h", c)));
  // A single-B GEMM keeps its 256-wide tiles.
  FuncCandidates o = candidates_for(ex.pipeline, ex.output, base, "o", false);
  CHECK(std::any_of(o.kept.begin(), o.kept.end(), [](const FuncChoice &c) { return c.tile_n == 256; }));
  // The training step's Funcs: the backward's contractions too.
  const std::vector<std::string> train = tunable_funcs(ex.pipeline, ex.output, base, true);
  CHECK(std::find(train.begin(), train.end(), "d_w1") != train.end());
  CHECK(std::find(train.begin(), train.end(), "d_x") != train.end());
  FuncCandidates dw = candidates_for(ex.pipeline, ex.output, base, "d_w1", true);
  CHECK_FALSE(dw.kept.empty());
  // Clusters: the down-projection's pairs of row tiles sharing B are
  // candidates (persistent ones walk pairs: mbpaper's hand-written best);
  // an expert reduction runs without clusters, so asking gives the same
  // plans and is no candidate.
  CHECK(std::any_of(o.kept.begin(), o.kept.end(), [](const FuncChoice &c) { return c.cluster == 2 && c.persistent; }));
  for (const FuncChoice &c : dw.kept)
    CHECK(c.cluster == 1);
  CHECK(std::any_of(dw.pruned.begin(), dw.pruned.end(),
                    [](const PrunedChoice &p) { return p.choice.cluster == 2 && has(p.why, "the same plans as "); }));
}

TEST_CASE("tune space: the layer-wide choices (permutation, gate fusion) around a base, none without routing") {
  Example ex = make_example("swiglu_moe", small());
  for (bool training : {false, true}) {
    INFO((training ? "training" : "forward"));
    LayoutCandidates lc = layout_candidates(ex.pipeline, ex.output, preset("megablocks"), training);
    CHECK(lc.kept.size() + lc.pruned.size() == 3); // the other three of 2 permutations x 2 gate placements
    std::vector<std::string> whats;
    for (const LayoutCandidate &c : lc.kept) {
      whats.push_back(c.what);
      CHECK_NOTHROW(lower(ex.pipeline, c.schedule)); // what the tuner times compiles
      CHECK((c.schedule.permutation() != Permutation::blocked || c.schedule.gate() != GateFusion::combine));
    }
    for (const auto &[what, why] : lc.pruned)
      whats.push_back(what);
    std::sort(whats.begin(), whats.end());
    CHECK(whats == std::vector<std::string>{"gate(epilogue)", "permutation(scattered)",
                                            "permutation(scattered) gate(epilogue)"});
    // Scattered rows are a different program from the blocked copy.
    CHECK(std::any_of(lc.kept.begin(), lc.kept.end(),
                      [](const LayoutCandidate &c) { return c.what == "permutation(scattered)"; }));
  }
  Example dense = make_example("dense_mlp", small());
  LayoutCandidates none = layout_candidates(dense.pipeline, dense.output, preset("megablocks"), false);
  CHECK(none.kept.empty());
  CHECK(none.pruned.empty());
}

TEST_CASE("tune cache: hit, miss, another key's entry, a stale compiler and a corrupt file") {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "moeforge_tune_cache_test";
  std::filesystem::remove_all(dir);
  TuneCache cache(dir);
  TuneKey key{"h(t, i) = ...\ny(t, i) = ...", token_bucket(3000), "NVIDIA H200", "moeforge 0.11.0, NVRTC 13.0", true};
  CHECK(key.token_bucket == 4096);
  CHECK(token_bucket(4096) == 4096);
  CHECK(token_bucket(1) == 1);
  std::string why;
  CHECK_FALSE(cache.load(key, &why).has_value());
  CHECK(has(why, "no tuned schedule cached"));
  Schedule s = preset("scattermoe");
  s.tile("o", 128, 256, 64).persistent("o", true);
  REQUIRE(cache.store(key, s));
  std::optional<Schedule> back = cache.load(key);
  REQUIRE(back.has_value());
  CHECK(back->to_text() == s.to_text());
  // Another device or compiler: another entry, a miss.
  TuneKey other = key;
  other.compiler = "moeforge 0.12.0, NVRTC 13.1";
  CHECK(other.file_name() != key.file_name());
  CHECK_FALSE(cache.load(other).has_value());
  // An entry whose recorded key differs (as a hash collision would): ignored.
  std::filesystem::copy_file(cache.entry_path(key), cache.entry_path(other));
  CHECK_FALSE(cache.load(other, &why).has_value());
  CHECK(has(why, "was tuned for something else"));
  // A corrupt entry: a miss that says so, never an error.
  {
    std::ifstream in(cache.entry_path(key));
    std::string first;
    std::getline(in, first);
    std::ofstream out(cache.entry_path(key));
    out << first << "\ntile(o, 128, 256\n\x01\x02";
  }
  CHECK_FALSE(cache.load(key, &why).has_value());
  CHECK(has(why, "does not parse"));
  // An unwritable directory: store says false.
  CHECK_FALSE(TuneCache("/proc/moeforge_no_such_dir").store(key, s));
  std::filesystem::remove_all(dir);
}

TEST_CASE("tune: candidates compiled side by side are the ones compiled one at a time") {
  // The search compiles a Func's candidates on every core; NVRTC, lowering
  // and the compile cache must give each thread what one thread gets.
  Example ex = make_example("swiglu_moe", small());
  TuneRequest r;
  r.pipeline = &ex.pipeline;
  r.output = ex.output;
  r.tokens = 64;
  std::vector<Schedule> schedules;
  for (const char *p : {"megablocks", "scattermoe"})
    for (int stages : {3, 4}) {
      Schedule s = preset(p);
      s.stages("*", stages);
      schedules.push_back(s);
    }
  Schedule bad = preset("scattermoe");
  bad.tile("nosuch", 128, 128, 64); // a Func the layer lacks: refused when lowered
  schedules.push_back(bad);
  // A fresh compile cache: the threads compile (and store) for real, then
  // one thread reads what they stored.
  const std::filesystem::path cache = std::filesystem::temp_directory_path() / "moeforge_tune_threads_cache";
  std::filesystem::remove_all(cache);
  const char *before = std::getenv("MOEFORGE_CACHE_DIR");
  const std::string saved = before ? before : "";
  ::setenv("MOEFORGE_CACHE_DIR", cache.c_str(), 1);
  for (bool training : {false, true}) {
    INFO("training " << training);
    r.training = training;
    std::vector<CompiledCandidate> many = compile_candidates(r, schedules, "sm_90a", 4);
    std::vector<CompiledCandidate> one = compile_candidates(r, schedules, "sm_90a", 1);
    REQUIRE(one.size() == schedules.size());
    REQUIRE(many.size() == schedules.size());
    for (size_t i = 0; i + 1 < schedules.size(); ++i) {
      INFO(schedules[i].to_text());
      CHECK(one[i].error.empty());
      CHECK(many[i].error.empty());
      const CompiledLayer &a = training ? one[i].training->layer : *one[i].layer;
      const CompiledLayer &b = training ? many[i].training->layer : *many[i].layer;
      CHECK(a.source.source == b.source.source);
      REQUIRE(a.units.size() == b.units.size());
      for (size_t u = 0; u < a.units.size(); ++u) {
        CHECK_FALSE(b.units[u].cubin.empty());
        CHECK(a.units[u].cubin == b.units[u].cubin);
      }
    }
    CHECK(has(many.back().error, "nosuch"));
    CHECK_FALSE(many.back().layer.has_value());
    CHECK_FALSE(many.back().training.has_value());
  }
  if (before)
    ::setenv("MOEFORGE_CACHE_DIR", saved.c_str(), 1);
  else
    ::unsetenv("MOEFORGE_CACHE_DIR");
  std::filesystem::remove_all(cache);
}
