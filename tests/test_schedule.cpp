// Schedules: presets, for_func merging, the traced text form (print, replay,
// save, load) and validate() on the example layers. Error texts are in
// test_schedule_errors.cpp.
#include <doctest/doctest.h>

#include <filesystem>
#include <random>
#include <sstream>

#include "dsl/error.h"
#include "examples/examples.h"
#include "schedules/presets.h"

using namespace moeforge;

namespace {

// Everything a Schedule exposes, for "the replay is the same schedule".
void check_same(const Schedule &a, const Schedule &b) {
  CHECK(a.to_text() == b.to_text());
  CHECK(a.name() == b.name());
  CHECK(a.permutation() == b.permutation());
  CHECK(a.block() == b.block());
  CHECK(a.gate() == b.gate());
  CHECK(a.funcs() == b.funcs());
  CHECK(a.calls() == b.calls());
  CHECK(a.for_func("*") == b.for_func("*"));
  for (const std::string &f : a.funcs())
    CHECK(a.for_func(f) == b.for_func(f));
}

Schedule custom() {
  Schedule s("tuned_h");
  s.permutation(Permutation::scattered)
      .block(256)
      .gate(GateFusion::epilogue)
      .tile("*", 128, 256, 64)
      .stages("*", 3)
      .warps("h", 4, 2)
      .tile("h", 64, 128, 32)
      .stages("h", 6)
      .fuse_epilogue("o", false)
      .tile("o", 256, 64, 32);
  return s;
}

std::filesystem::path temp_path(const std::string &stem) {
  std::random_device rd;
  return std::filesystem::temp_directory_path() / (stem + "_" + std::to_string(rd()) + ".schedule");
}

} // namespace

TEST_SUITE("schedule") {

  TEST_CASE("schedule: megablocks preset values") {
    Schedule s = megablocks();
    CHECK(s.name() == "megablocks");
    CHECK(s.permutation() == Permutation::blocked);
    CHECK(s.block() == 128);
    CHECK(s.gate() == GateFusion::combine);
    FuncSchedule f = s.for_func("h");
    GemmTiling expected{128, 128, 64, 4, 8, 1, MmaKind::wgmma_ws};
    expected.tma = true;
    CHECK(f.tiling == expected);
    CHECK(f.fuse_epilogue);
    CHECK(f.tiling.threads() == 256);
    CHECK(f.tiling.shared_bytes() == 4 * (128 * 64 + 64 * 128) * 2);
    CHECK(s.funcs().empty());
  }

  TEST_CASE("schedule: scattermoe preset values") {
    Schedule s = scattermoe();
    CHECK(s.name() == "scattermoe");
    CHECK(s.permutation() == Permutation::scattered);
    CHECK(s.block() == 128);
    CHECK(s.gate() == GateFusion::epilogue);
    GemmTiling expected{128, 128, 64, 4, 8, 1, MmaKind::wgmma_ws};
    expected.tma = true;
    CHECK(s.for_func("*").tiling == expected);
    CHECK(s.for_func("*").fuse_epilogue);
  }

  TEST_CASE("schedule: preset() and schedule_from_arg() find presets by name") {
    CHECK(preset_names() == std::vector<std::string>{"megablocks", "scattermoe"});
    for (const std::string &n : preset_names()) {
      check_same(preset(n), n == "megablocks" ? megablocks() : scattermoe());
      check_same(schedule_from_arg(n), preset(n));
    }
  }

  TEST_CASE("schedule: an empty Schedule holds the defaults") {
    Schedule s;
    CHECK(s.name() == "custom");
    CHECK(s.permutation() == Permutation::blocked);
    CHECK(s.block() == 128);
    CHECK(s.gate() == GateFusion::combine);
    CHECK(s.for_func("anything") == FuncSchedule{});
    CHECK(s.calls().empty());
    CHECK(s.to_text() == "schedule(\"custom\")\n");
    GemmTiling t{256, 64, 64, 3, 4, 2};
    CHECK(t.threads() == 8 * 32);
    CHECK(t.shared_bytes() == 3 * (256 * 64 + 64 * 64) * 2);
  }

  TEST_CASE("schedule: to_text prints the calls in order one per line") {
    CHECK(megablocks().to_text() == "schedule(\"megablocks\")\n"
                                    "permutation(blocked)\n"
                                    "block(128)\n"
                                    "gate(combine)\n"
                                    "tile(\"*\", 128, 128, 64)\n"
                                    "stages(\"*\", 4)\n"
                                    "warps(\"*\", 8, 1)\n"
                                    "mma(\"*\", wgmma_ws)\n"
                                    "tma(\"*\", true)\n"
                                    "fuse_epilogue(\"*\", true)\n");
    Schedule s;
    s.tile("h", 64, 128, 32).block(64).fuse_epilogue("o", false);
    CHECK(s.calls() ==
          std::vector<std::string>{"tile(\"h\", 64, 128, 32)", "block(64)", "fuse_epilogue(\"o\", false)"});
    std::ostringstream os;
    os << s;
    CHECK(os.str() == s.to_text());
  }

  TEST_CASE("schedule: presets replay from their text unchanged") {
    for (const std::string &n : preset_names()) {
      Schedule s = preset(n);
      Schedule back = Schedule::from_text(s.to_text(), n);
      check_same(s, back);
      check_same(back, Schedule::from_text(back.to_text()));
    }
  }

  TEST_CASE("schedule: a custom schedule with overrides replays from its text unchanged") {
    Schedule s = custom();
    Schedule back = Schedule::from_text(s.to_text(), "custom.schedule");
    check_same(s, back);
    CHECK(back.name() == "tuned_h");
    CHECK(back.funcs() == std::vector<std::string>{"h", "o"});
    CHECK(back.for_func("h").tiling == GemmTiling{64, 128, 32, 6, 4, 2});
    CHECK(back.for_func("o").tiling == GemmTiling{256, 64, 32, 3, 2, 4});
    CHECK_FALSE(back.for_func("o").fuse_epilogue);
  }

  TEST_CASE("schedule: the training and persistent primitives replay from their text") {
    Schedule s = scattermoe();
    s.recompute(true).persistent("o", true).tma("h", false).cluster("o", 2);
    Schedule replayed = Schedule::from_text(s.to_text(), "t.schedule");
    CHECK_FALSE(replayed.for_func("h").tiling.tma);
    CHECK(replayed.for_func("o").tiling.tma);
    CHECK(replayed.for_func("o").tiling.cluster_m == 2);
    CHECK(replayed.for_func("h").tiling.cluster_m == 1);
    CHECK(s.to_text().find("recompute(true)") != std::string::npos);
    CHECK(s.to_text().find("persistent(\"o\", true)") != std::string::npos);
    Schedule back = Schedule::from_text(s.to_text(), "t.schedule");
    CHECK(back.recompute());
    CHECK(back.for_func("o").tiling.persistent);
    CHECK_FALSE(back.for_func("h").tiling.persistent);
    CHECK_FALSE(scattermoe().recompute());
  }

  TEST_CASE("schedule: from_text skips blanks and comments and takes C++-style lines without a header") {
    Schedule s = Schedule::from_text("# tuned on H200\n"
                                     "\n"
                                     "  block( 64 )   # small experts\n"
                                     "tile(\"h\",64,64,32);\n"
                                     "gate(epilogue)\n",
                                     "inline");
    CHECK(s.name() == "custom");
    CHECK(s.block() == 64);
    CHECK(s.gate() == GateFusion::epilogue);
    CHECK(s.for_func("h").tiling.tile_n == 64);
    CHECK(s.to_text() == "schedule(\"custom\")\nblock(64)\ntile(\"h\", 64, 64, 32)\ngate(epilogue)\n");
    CHECK(Schedule::from_text("").calls().empty());
  }

  TEST_CASE("schedule: save and load through a file") {
    Schedule s = custom();
    std::filesystem::path path = temp_path("moeforge_test_schedule");
    s.save(path.string());
    Schedule back = Schedule::load(path.string());
    check_same(s, back);
    check_same(schedule_from_arg(path.string()), s);
    std::filesystem::remove(path);
  }

  TEST_CASE("schedule: for_func merges the default with a Func's own overrides field by field") {
    Schedule s;
    s.tile("*", 256, 128, 64).stages("*", 3).warps("h", 4, 2).stages("h", 2).fuse_epilogue("o", false);
    // 'h' overrides warps and stages; its tile comes from "*".
    CHECK(s.for_func("h").tiling == GemmTiling{256, 128, 64, 2, 4, 2});
    CHECK(s.for_func("h").fuse_epilogue);
    CHECK(s.for_func("o").tiling == GemmTiling{256, 128, 64, 3, 2, 4});
    CHECK_FALSE(s.for_func("o").fuse_epilogue);
    // Later changes to "*" reach every field a Func does not override.
    s.tile("*", 128, 64, 32).stages("*", 5);
    CHECK(s.for_func("h").tiling == GemmTiling{128, 64, 32, 2, 4, 2});
    CHECK(s.for_func("o").tiling == GemmTiling{128, 64, 32, 5, 2, 4});
    CHECK(s.for_func("logits").tiling == GemmTiling{128, 64, 32, 5, 2, 4});
    // A later per-Func call keeps the Func's earlier overrides.
    s.tile("h", 64, 64, 32);
    CHECK(s.for_func("h").tiling == GemmTiling{64, 64, 32, 2, 4, 2});
    CHECK(s.funcs() == std::vector<std::string>{"h", "o"});
  }

  TEST_CASE("schedule: a primitive that fails its checks records nothing") {
    Schedule s = megablocks();
    s.mma("*", MmaKind::mma_sync); // warps 1x8 below are an mma.sync layout
    std::string before = s.to_text();
    CHECK_THROWS_AS(s.block(96), UserError);
    CHECK_THROWS_AS(s.tile("h", 64, 64, 16), UserError);
    CHECK_THROWS_AS(s.warps("*", 1, 8).tile("*", 128, 64, 32), UserError); // the warps call succeeds
    CHECK(s.for_func("*").tiling.warps_n == 8);
    CHECK(s.for_func("*").tiling.tile_n == 128);
    CHECK(s.to_text() == before + "warps(\"*\", 1, 8)\n");
    CHECK(s.funcs().empty());
  }

  TEST_CASE("schedule: presets validate against the MoE examples") {
    for (const char *example : {"moe_mlp", "swiglu_moe"}) {
      Example ex = make_example(example, ExampleShape{});
      for (const std::string &n : preset_names())
        CHECK_NOTHROW(preset(n).validate(ex.pipeline));
    }
    // Extents that tiles do not divide are masked, only multiples of 8 matter.
    ExampleShape odd;
    odd.d = 72;
    odd.f = 200;
    odd.tokens = 100;
    CHECK_NOTHROW(megablocks().validate(make_example("swiglu_moe", odd).pipeline));
  }

  TEST_CASE("schedule: per-Func schedules validate against the MoE examples") {
    Schedule s = scattermoe();
    s.mma("*", MmaKind::mma_sync).warps("*", 2, 4);
    s.block(256).tile("h", 256, 128, 64).stages("h", 3).tile("o", 64, 256, 32).fuse_epilogue("o", false);
    s.tile("logits", 64, 64, 32).warps("logits", 2, 2);
    for (const char *example : {"moe_mlp", "swiglu_moe"})
      CHECK_NOTHROW(s.validate(make_example(example, ExampleShape{}).pipeline));
    // The router GEMM is not over routed rows: its tile_m may exceed the block.
    Schedule r;
    r.block(64).tile("logits", 256, 64, 32).tile("h", 64, 128, 32).tile("o", 64, 128, 32);
    CHECK_NOTHROW(r.validate(make_example("moe_mlp", ExampleShape{}).pipeline));
  }

  TEST_CASE("schedule: validate accepts layers without routing") {
    CHECK_NOTHROW(megablocks().validate(make_example("dense_mlp", ExampleShape{}).pipeline));
    Schedule s;
    s.tile("h", 256, 64, 32).block(64); // no routed rows, so the block does not bound tile_m
    CHECK_NOTHROW(s.validate(make_example("dense_mlp", ExampleShape{}).pipeline));
  }

} // TEST_SUITE
