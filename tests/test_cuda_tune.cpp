// The autotuner's parts that need no GPU: the search space and its pruning
// (backends/cuda/tune/tune_space.h), the parallel compile of candidates, the
// tuned-schedule cache (tune_cache.h) and
// the CLI's `tune` where there is no GPU. The timed search runs on the device
// (scripts/device_run.sh's tune step).
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "layer_compare.h"

#include "backends/cuda/tune/tune_cache.h"
#include "backends/cuda/tune/tune_space.h"
#include "backends/cuda/tune/tuner.h"
#include "dsl/error.h"
#include "examples/examples.h"
#include "lowering/gemm_plan.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "schedules/presets.h"

using namespace moeforge;
using namespace moeforge::cuda;

namespace {

ExampleShape small() { return testing::shape(64, 256, 256, 8, 2); }

bool has(const std::string &text, const std::string &part) { return text.find(part) != std::string::npos; }

} // namespace

TEST_CASE("tune space: every Func's choices, pruned by the plans' legality and by equal plans") {
  Example ex = make_example("swiglu_moe", small());
  Schedule base = preset("scattermoe");
  const std::vector<std::string> funcs = tunable_funcs(ex.pipeline, ex.output, base, false);
  CHECK(funcs == std::vector<std::string>{"logits", "h", "o"});
  const size_t all = func_choices().size();
  // (3 tiles x 2 stage counts + the 64-column tile's 2 deeper rings) x persistent x TMA store x cluster
  CHECK(all == 64);
  // SwiGLU's h has two B operands: 256 columns each need 256 accumulator
  // registers a thread, which the plan rejects; its 256 columns (f) are too
  // many for 64-column tiles, which the cheap model drops.
  FuncCandidates h = candidates_for(ex.pipeline, ex.output, base, "h", false);
  CHECK(h.kept.size() + h.pruned.size() == all);
  int registers = 0, traffic = 0, deep = 0;
  for (const PrunedChoice &p : h.pruned) {
    INFO(p.choice.text() << ": " << p.why);
    registers += has(p.why, "need 256 accumulator registers per thread");
    traffic += has(p.why, "a 64-column tile over 256 columns reads each A tile once per 64 columns, twice the A "
                          "traffic of a 128-column tile");
    deep += has(p.why, "stages: a ring deeper than 4 is for streaming weights");
  }
  CHECK(registers == 16); // every 256-wide choice
  CHECK(traffic == 16);   // every 64-wide choice of 3 or 4 stages
  CHECK(deep == 16);      // the 6- and 8-stage ones: full tiles here
  // Decoding keeps the 6-stage ones; the 8-stage ring of two B operands
  // (8 x 32 KiB) does not fit the SM.
  int ring = 0;
  for (const PrunedChoice &p : candidates_for(ex.pipeline, ex.output, base, "h", false, 1).pruned)
    ring += p.choice.stages == 8 && has(p.why, "bytes of shared memory");
  CHECK(ring == 8);
  // The router's logits have E = 8 columns: the model keeps the 64-column
  // tiles only. They are f32, which a TMA store does not take: asking for
  // one gives the same plans as not asking, one candidate instead of two.
  FuncCandidates logits = candidates_for(ex.pipeline, ex.output, base, "logits", false);
  int padding = 0, same = 0;
  for (const PrunedChoice &p : logits.pruned) {
    INFO(p.choice.text() << ": " << p.why);
    if (p.choice.tile_n == 128)
      padding += has(p.why, "a 128-column tile over 8 columns: the 64-column tile covers them with half the padded "
                            "columns");
    else if (p.choice.tile_n == 256)
      padding += has(p.why, "a 256-column tile over 8 columns: the 128-column tile covers them");
    else
      same += p.choice.tma_store && has(p.why, "the same plans as ");
  }
  CHECK(padding == 32);
  CHECK(same == 8);
  CHECK(logits.kept.size() == 8); // the 64-column choices not asking for a TMA store
  for (const FuncChoice &c : logits.kept)
    CHECK(c.tile_n == 64);
  // The model judges a choice by the GEMM's columns alone.
  const KernelProgram forward = lower(ex.pipeline, base);
  CHECK(model_prune(forward, "o", FuncChoice{128, 64}) ==
        "a 64-column tile over 256 columns reads each A tile once per 64 columns, twice the A traffic of a "
        "128-column tile");
  CHECK(model_prune(forward, "o", FuncChoice{128, 128}).empty());
  CHECK(model_prune(forward, "no_such_func", FuncChoice{128, 256}).empty());
  // Decoding: a few rows an expert (T k / E = 2 k / 8 here: 32 rows at 128
  // tokens, 33 past it) read A's few bytes once per 64 columns, and the
  // narrow tile doubles the blocks streaming the weights.
  CHECK(model_prune(forward, "o", FuncChoice{128, 64}, 1).empty());
  CHECK(model_prune(forward, "o", FuncChoice{128, 64}, 128).empty());
  CHECK(has(model_prune(forward, "o", FuncChoice{128, 64}, 132), "twice the A traffic"));
  CHECK(has(model_prune(forward, "o", FuncChoice{128, 64}, 0), "twice the A traffic")); // 0: every tile full
  FuncCandidates decode = candidates_for(ex.pipeline, ex.output, base, "o", false, 1);
  CHECK(std::any_of(decode.kept.begin(), decode.kept.end(), [](const FuncChoice &c) { return c.tile_n == 64; }));
  // Deeper rings too, there and only there.
  CHECK(std::any_of(decode.kept.begin(), decode.kept.end(),
                    [](const FuncChoice &c) { return c.tile_n == 64 && c.stages == 8; }));
  CHECK(model_prune(forward, "o", FuncChoice{128, 64, 8}, 1).empty());
  CHECK(has(model_prune(forward, "o", FuncChoice{128, 64, 6}, 0), "6 stages: a ring deeper than 4 is for streaming"));
  CHECK(has(model_prune(forward, "logits", FuncChoice{128, 64, 8}, 0), "a ring deeper than 4"));
  for (const FuncChoice &c : candidates_for(ex.pipeline, ex.output, base, "o", false).kept)
    CHECK(c.stages <= 4);
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

TEST_CASE("tune space: a Func's raster band, tried with its other settings as they are") {
  Example ex = make_example("moe_mlp", small());
  Schedule base = preset("scattermoe");
  base.tile("h", 128, 256, 64).persistent("h", true);
  // The base's settings read back as a choice plan as the base does.
  const FuncChoice current = choice_in(base, "h");
  CHECK(current.tile_n == 256);
  CHECK(current.persistent);
  CHECK(current.raster == 8);
  CHECK(current.text() == "128x256, 4 stages, persistent, raster 8");
  CHECK(describe_gemm_plans(lower(ex.pipeline, with_choice(base, "h", current)), false) ==
        describe_gemm_plans(lower(ex.pipeline, base), false));
  // Every band but the base's own, nothing else changed.
  FuncCandidates h = raster_candidates_for(ex.pipeline, ex.output, base, "h", false);
  CHECK(h.pruned.empty());
  std::vector<int> bands;
  for (const FuncChoice &c : h.kept) {
    INFO(c.text());
    bands.push_back(c.raster);
    CHECK(c.tile_n == 256);
    CHECK(c.persistent);
    const Schedule s = with_choice(base, "h", c);
    CHECK(s.for_func("h").tiling.raster == c.raster);
    CHECK(s.for_func("o").tiling.raster == 8);
    CHECK(has(describe_gemm_plans(lower(ex.pipeline, s), false), "raster " + std::to_string(c.raster)));
  }
  CHECK(bands == std::vector<int>{1, 2, 4});
  // A choice without a band leaves the base's.
  base.raster("h", 2);
  CHECK(with_choice(base, "h", FuncChoice{128, 128}).for_func("h").tiling.raster == 2);
  FuncCandidates again = raster_candidates_for(ex.pipeline, ex.output, base, "h", false);
  bands.clear();
  for (const FuncChoice &c : again.kept)
    bands.push_back(c.raster);
  CHECK(bands == std::vector<int>{1, 4, 8});
}

TEST_CASE("tune space: the narrow tail, one candidate where the last column tile is half full or less") {
  // f = 320 under 256-wide tiles: d_h's last column tile holds 64 columns.
  Example ex = make_example("swiglu_moe", testing::shape(64, 256, 320, 8, 2));
  Schedule base = preset("scattermoe");
  base.tile("*", 128, 256, 64).mma("*", MmaKind::wgmma_ws).tma("*", true);
  FuncCandidates dh = narrow_tail_candidates_for(ex.pipeline, ex.output, base, "d_h", true);
  REQUIRE(dh.kept.size() == 1);
  CHECK(dh.kept[0].narrow_tail == 1);
  CHECK(dh.kept[0].text().find("narrow tail") != std::string::npos);
  const Schedule on = with_choice(base, "d_h", dh.kept[0]);
  CHECK(on.for_func("d_h").tiling.narrow_tail);
  CHECK(choice_in(on, "d_h").narrow_tail == 1);
  // Switched back off, and left unnamed where it never was.
  FuncCandidates off = narrow_tail_candidates_for(ex.pipeline, ex.output, on, "d_h", true);
  REQUIRE(off.kept.size() == 1);
  CHECK(off.kept[0].narrow_tail == 0);
  CHECK(with_choice(base, "d_h", choice_in(base, "d_h")).to_text().find("narrow_tail") == std::string::npos);
  // d = 256: o's columns fill every tile, so its plans would not change.
  FuncCandidates o = narrow_tail_candidates_for(ex.pipeline, ex.output, base, "o", true);
  CHECK(o.kept.empty());
  REQUIRE(o.pruned.size() == 1);
  CHECK(has(o.pruned[0].why, "the same plans as the current settings"));
}

TEST_CASE("tune space: the layer-wide choices, their product around a base, none without routing") {
  Example ex = make_example("swiglu_moe", small());
  // 2 permutations x 2 gate placements x 2 blocks x padded_elementwise x
  // chain_summed_gemms, but the base's own combination.
  constexpr size_t kAll = 31;
  for (bool training : {false, true}) {
    INFO(std::string(training ? "training" : "forward"));
    const Schedule base = preset("megablocks");
    LayoutCandidates lc = layout_candidates(ex.pipeline, ex.output, base, training);
    CHECK(lc.kept.size() + lc.pruned.size() == kAll);
    std::vector<std::string> kept;
    for (const LayoutCandidate &c : lc.kept) {
      kept.push_back(c.what);
      CHECK_NOTHROW(training ? (void)lower_training(ex.pipeline, ex.pipeline.func(ex.output), c.schedule)
                             : (void)lower(ex.pipeline, c.schedule)); // what the tuner times compiles
      // Precision and memory stay the base's.
      CHECK(c.schedule.bf16_activations() == base.bf16_activations());
      CHECK(c.schedule.reuse_memory() == base.reuse_memory());
    }
    auto kept_has = [&](const std::string &what) { return std::find(kept.begin(), kept.end(), what) != kept.end(); };
    CHECK(kept_has("permutation(scattered)"));
    CHECK(kept_has("block(256)"));
    CHECK(kept_has("permutation(scattered) block(256)"));
    auto pruned_why = [&](const std::string &what) {
      for (const auto &[w, why] : lc.pruned)
        if (w == what)
          return why;
      return std::string("(not pruned)");
    };
    // The training step multiplies by the gate where it keeps what the
    // gate's gradient reads: one program whichever place is asked for.
    if (training)
      CHECK(pruned_why("gate(epilogue)") == "the same program as the current settings");
    else
      CHECK(kept_has("permutation(scattered) block(256) gate(epilogue)"));
    // The forward has no two GEMMs summed: asking to chain them changes nothing.
    if (!training)
      CHECK(pruned_why("chain_summed_gemms(true)") == "the same program as the current settings");
    // The training step's dX = dH1 W1^T + dH3 W3^T chains only where its
    // A operands arrive in tile order (padded_elementwise here): the
    // legality error, as the user gets it, prunes the others.
    if (training) {
      CHECK(has(pruned_why("chain_summed_gemms(true)"), "definition 'd_x': chain_summed_gemms"));
      CHECK(kept_has("padded_elementwise(true) chain_summed_gemms(true)"));
      CHECK(has(pruned_why("permutation(scattered) chain_summed_gemms(true)"), "definition 'd_x': chain_summed_gemms"));
      CHECK(kept_has("permutation(scattered) padded_elementwise(true) chain_summed_gemms(true)"));
    }
  }
  Example dense = make_example("dense_mlp", small());
  LayoutCandidates none = layout_candidates(dense.pipeline, dense.output, preset("megablocks"), false);
  CHECK(none.kept.empty());
  CHECK(none.pruned.empty());
}

TEST_CASE("tune: the run-off keeps the lowest median, the best so far on a tie") {
  // Contender 1 has the lowest mean (one fast outlier) but not the lowest
  // median; contender 2 does.
  CHECK(runoff_winner({{10.0, 10.1, 10.2}, {9.0, 10.3, 10.4}, {10.0, 10.05, 10.1}}) == 2);
  CHECK(runoff_winner({{5.0, 5.0}, {5.0, 5.0}}) == 0);
  CHECK(runoff_winner({{5.0}}) == 0);
  // An even count: the mean of the middle two (5.75 against 5.6).
  CHECK(runoff_winner({{6.0, 5.0, 7.0, 5.5}, {5.6, 5.6, 5.6, 5.6}}) == 1);
  CHECK_THROWS_WITH_AS(runoff_winner({}), doctest::Contains("a run-off needs a contender"), UserError);
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
