// Every UserError of schedules/: each test checks the message names the bad
// value, the Func (or file and line) and the fix.
#include <doctest/doctest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "dsl/error.h"
#include "examples/examples.h"
#include "schedules/presets.h"
#include "user_error.h"

using namespace moeforge;

namespace {

std::string error_of(const std::function<void()> &f) { return testing::user_error_of(f); }

bool has(const std::string &msg, const std::string &part) { return msg.find(part) != std::string::npos; }

#define CHECK_HAS(msg, part)                                                                                           \
  do {                                                                                                                 \
    INFO("message: ", msg);                                                                                            \
    CHECK(has(msg, part));                                                                                             \
  } while (0)

Pipeline layer(const std::string &name, const ExampleShape &shape = {}) { return make_example(name, shape).pipeline; }

} // namespace

TEST_SUITE("schedule") {

  TEST_CASE("schedule errors: block size") {
    std::string m = error_of([] { Schedule().block(96); });
    CHECK_HAS(m, "block(96)");
    CHECK_HAS(m, "block size 96 is not supported: use 64, 128 or 256");
  }

  TEST_CASE("schedule errors: tile sizes") {
    std::string m = error_of([] { Schedule().tile("h", 96, 128, 32); });
    CHECK_HAS(m, "tile(\"h\", 96, 128, 32)");
    CHECK_HAS(m, "tile_m 96 of 'h' is not supported: use 64, 128 or 256");
    m = error_of([] { Schedule().tile("o", 128, 512, 32); });
    CHECK_HAS(m, "tile_n 512 of 'o' is not supported: use 64, 128 or 256");
    m = error_of([] { Schedule().tile("*", 128, 128, 16); });
    CHECK_HAS(m, "tile_k 16 of the default ('*') is not supported: use 32 or 64");
  }

  TEST_CASE("schedule errors: stages") {
    std::string m = error_of([] { Schedule().stages("h", 1); });
    CHECK_HAS(m, "stages(\"h\", 1)");
    CHECK_HAS(m, "1 stages for 'h' is not supported: use 2 to 8");
    m = error_of([] { Schedule().stages("*", 9); });
    CHECK_HAS(m, "9 stages for the default ('*') is not supported: use 2 to 8");
  }

  TEST_CASE("schedule errors: warp count") {
    std::string m = error_of([] { Schedule().warps("h", 2, 3); });
    CHECK_HAS(m, "warps(\"h\", 2, 3)");
    CHECK_HAS(m, "warps 2x3 for 'h' is not supported: use 4 or 8 warps in all");
    m = error_of([] { Schedule().warps("h", 0, 4); });
    CHECK_HAS(m, "warps 0x4 for 'h'");
    m = error_of([] { Schedule().warps("h", 16, 1); });
    CHECK_HAS(m, "warps 16x1 for 'h'");
  }

  TEST_CASE("schedule errors: warps that do not fit the tile are rechecked on every change") {
    // warps changed after the tile
    std::string m = error_of([] { Schedule().tile("h", 64, 128, 32).warps("h", 8, 1); });
    CHECK_HAS(m, "warps(\"h\", 8, 1): warps 8x1 do not fit tile 64x128x32 of 'h'");
    CHECK_HAS(m, "tile_m / warps_m = 64 / 8 = 8 rows per warp, not a multiple of 16");
    CHECK_HAS(m, "use warps_m <= 4 or tile_m >= 128");
    // tile changed after the warps
    m = error_of([] { Schedule().warps("*", 1, 8).tile("*", 128, 64, 32); });
    CHECK_HAS(m, "tile(\"*\", 128, 64, 32): warps 1x8 do not fit tile 128x64x32 of the default ('*')");
    CHECK_HAS(m, "tile_n / warps_n = 64 / 8 = 8 columns per warp");
    CHECK_HAS(m, "use warps_n <= 4 or tile_n >= 128");
    // a change to "*" reaches a Func that overrides only the tile
    m = error_of([] { Schedule().tile("h", 64, 64, 32).warps("*", 1, 8); });
    CHECK_HAS(m, "warps(\"*\", 1, 8): warps 1x8 do not fit tile 64x64x32 of 'h' (it overrides part of the default)");
  }

  TEST_CASE("schedule errors: shared memory beyond 227 KiB") {
    std::string m = error_of([] { Schedule().tile("h", 256, 256, 64); });
    CHECK_HAS(m, "tile 256x256x64 with 4 stages of 'h' needs 262144 bytes of shared memory");
    CHECK_HAS(m, "4 x (256x64 + 64x256) x 2 bytes");
    CHECK_HAS(m, "232448 bytes (227 KiB)");
    CHECK_HAS(m, "use stages <= 3 or a smaller tile");
    // raising the stages of the default rechecks it
    m = error_of([] { Schedule().tile("*", 128, 128, 64).stages("*", 8); });
    CHECK_HAS(m, "stages(\"*\", 8): tile 128x128x64 with 8 stages of the default ('*') needs 262144 bytes");
    CHECK_HAS(m, "use stages <= 7");
    // what fits is fine, once the stages come down first
    CHECK_NOTHROW(Schedule().stages("h", 3).tile("h", 256, 256, 64));
  }

  TEST_CASE("schedule errors: unusable names") {
    std::string m = error_of([] { Schedule().tile("", 128, 128, 32); });
    CHECK_HAS(m, "'' is not a usable Func name: pass a Func's name, or \"*\" for every contraction");
    m = error_of([] { Schedule().stages("a\"b", 3); });
    CHECK_HAS(m, "'a\"b' is not a usable Func name");
    m = error_of([] { Schedule("my\nschedule"); });
    CHECK_HAS(m, "schedule name 'my\nschedule' is not usable");
  }

  TEST_CASE("schedule errors: unknown preset and schedule argument") {
    std::string m = error_of([] { preset("gshard"); });
    CHECK_HAS(m, "unknown schedule preset 'gshard': choose one of megablocks, scattermoe");
    m = error_of([] { schedule_from_arg("megablock"); });
    CHECK_HAS(m, "schedule 'megablock' is neither a preset (megablocks, scattermoe) nor an existing schedule file");
  }

  TEST_CASE("schedule errors: from_text names the source and line and what was expected") {
    auto parse = [](const std::string &text) { return error_of([&] { Schedule::from_text(text, "s.txt"); }); };
    std::string m = parse("block(128)\ntiles(\"h\", 64, 64, 32)\n");
    CHECK_HAS(
        m,
        "s.txt:2: unknown primitive 'tiles': expected one of schedule, permutation, block, capacity, expert_parallel, "
        "exchange_chunks, "
        "gate, recompute, tile");
    m = parse("block 128\n");
    CHECK_HAS(m, "s.txt:1: expected '(' after 'block', found '128'");
    m = parse("\n(128)\n");
    CHECK_HAS(m, "s.txt:2: expected a primitive name");
    m = parse("tile(\"h\", 64, 64)\n");
    CHECK_HAS(m, "s.txt:1: 'tile' takes 4 arguments tile(func, m, n, k), found 3");
    m = parse("stages(\"h\", four)\n");
    CHECK_HAS(m, "s.txt:1: argument 'stages' of stages(func, stages): expected an integer, found 'four'");
    m = parse("block(99999999999)\n");
    CHECK_HAS(m, "expected an integer, found '99999999999'");
    m = parse("tile(h, 64, 64, 32)\n");
    CHECK_HAS(m, "argument 'func' of tile(func, m, n, k): expected a quoted name, found 'h'");
    m = parse("permutation(sorted)\n");
    CHECK_HAS(m,
              "s.txt:1: argument 'strategy' of permutation(strategy): expected blocked or scattered, found 'sorted'");
    m = parse("gate(\"epilogue\")\n");
    CHECK_HAS(m, "expected combine or epilogue, found \"epilogue\"");
    m = parse("fuse_epilogue(\"h\", yes)\n");
    CHECK_HAS(m, "expected true or false, found 'yes'");
    m = parse("tile(\"h, 64, 64, 32)\n");
    CHECK_HAS(m, "s.txt:1: unterminated string in the arguments of 'tile': expected a closing '\"'");
    m = parse("block(64 128)\n");
    CHECK_HAS(m, "s.txt:1: expected ',' or ')' in the arguments of 'block', found '128)'");
    m = parse("block(64) block(128)\n");
    CHECK_HAS(m, "s.txt:1: expected the end of the line after 'block(...)', found 'block(128)'");
    m = parse("block(64)\nschedule(\"late\")\n");
    CHECK_HAS(m, "s.txt:2: schedule(\"late\") names the schedule, so it must come before every primitive");
    // Control bytes are named by their code, the message whole after them.
    m = parse(std::string("block(128)\ntile(\"*\", 128,\0 128, 64)\n", 35));
    CHECK_HAS(m, "s.txt:2: column 15: byte 0x00 is not text; a schedule file holds one call per line");
    CHECK(m.find('\0') == std::string::npos);
    m = parse("block(128)\x1b[2J\n");
    CHECK_HAS(m, "s.txt:1: column 11: byte 0x1b is not text");
    CHECK_NOTHROW(Schedule::from_text("block(128)\r\n\ttile(\"*\", 128, 128, 64)\r\n", "crlf.txt"));
  }

  TEST_CASE("schedule errors: from_text replays the primitives' own checks with the line") {
    std::string m = error_of([] { Schedule::from_text("schedule(\"x\")\n\nblock(96)\n", "tuned.schedule"); });
    CHECK_HAS(m, "tuned.schedule:3: block(96): block size 96 is not supported: use 64, 128 or 256");
    m = error_of([] { Schedule::from_text("tile(\"h\", 64, 128, 32)\nwarps(\"h\", 8, 1)\n", "t"); });
    CHECK_HAS(m, "t:2: warps(\"h\", 8, 1): warps 8x1 do not fit tile 64x128x32 of 'h'");
  }

  TEST_CASE("schedule errors: load and save name the path") {
    std::filesystem::path missing = std::filesystem::temp_directory_path() / "moeforge_no_such_dir" / "x.schedule";
    std::string m = error_of([&] { Schedule::load(missing.string()); });
    CHECK_HAS(m, "cannot read schedule file '" + missing.string() + "'");
    CHECK_HAS(m, "No such file or directory");
    m = error_of([&] { megablocks().save(missing.string()); });
    CHECK_HAS(m, "cannot write schedule 'megablocks' to '" + missing.string() + "'");
    std::string dir = std::filesystem::temp_directory_path().string();
    m = error_of([&] { Schedule::load(dir); });
    CHECK_HAS(m, "cannot read schedule file '" + dir + "': it is a directory");
  }

  TEST_CASE("schedule errors: a file that is not text, or is too large, is refused before it fills memory") {
    // /dev/zero never ends: its first byte is a NUL, and the read stops there.
    std::string m = error_of([] { Schedule::load("/dev/zero"); });
    CHECK_HAS(m, "schedule file '/dev/zero': byte 0 is a NUL (0x00), so this is not a text file");
    // Text past the bound: refused once the bound's bytes are read.
    std::filesystem::path p = std::filesystem::temp_directory_path() / "moeforge_huge.sched";
    {
      std::ofstream f(p, std::ios::binary);
      const std::string line = "stages(\"o\", 4)\n";
      for (size_t at = 0; at <= Schedule::kMaxScheduleFileBytes; at += line.size())
        f << line;
    }
    m = error_of([&] { Schedule::load(p.string()); });
    CHECK_HAS(m, "schedule file '" + p.string() + "' is larger than 16 MiB");
    std::filesystem::remove(p);
  }

  TEST_CASE("schedule errors: replaying a schedule takes time linear in its calls") {
    // 200,000 calls (3 MB, the sweep's case that did not finish in 60 s when
    // each call copied every call before it). Not a speed measurement: a
    // bound 25 times the time it takes, which only a replay that is not
    // linear misses.
    std::string text = "schedule(\"long\")\n";
    for (int i = 0; i < 200000; ++i)
      text += "stages(\"o\", 4)\n";
    const auto start = std::chrono::steady_clock::now();
    Schedule s = Schedule::from_text(text, "long.sched");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(s.calls().size() == 200000);
    CHECK(seconds < 5.0); // a generous bound for a sanitised build on a loaded machine; ~0.2 s here
  }

  TEST_CASE("schedule errors: an empty schedule file is an error, not the defaults") {
    std::filesystem::path p = std::filesystem::temp_directory_path() / "moeforge_empty.schedule";
    {
      std::ofstream f(p);
      f << "# only a comment\n\n";
    }
    std::string m = error_of([&] { Schedule::load(p.string()); });
    CHECK_HAS(m, "schedule file '" + p.string() + "' has no primitives (only blank lines or comments)");
    CHECK_HAS(m, "or pass a preset (megablocks, scattermoe)");
    {
      std::ofstream f(p);
      f << "schedule(\"named\")\n"; // a named schedule of defaults is a choice
    }
    CHECK(Schedule::load(p.string()).name() == "named");
    std::filesystem::remove(p);
  }

  TEST_CASE("schedule errors: validate refuses primitives without the loop they need, for every backend") {
    Schedule s = megablocks();
    s.mma("*", MmaKind::mma_sync).persistent("o", true);
    std::string m = error_of([&] { s.validate(layer("moe_mlp")); });
    CHECK_HAS(m, "schedule 'megablocks': definition 'o': persistent blocks need the warp-specialised loop");
    CHECK_HAS(m, "add mma(\"o\", wgmma_ws) or drop persistent");
    Schedule c = scattermoe();
    c.tma("h", false).cluster("h", 2);
    m = error_of([&] { c.validate(layer("moe_mlp")); });
    CHECK_HAS(m, "definition 'h': clusters of two row tiles multicast TMA loads from the warp-specialised loop");
    CHECK_HAS(m, "add mma(\"h\", wgmma_ws) and tma(\"h\", true), or drop cluster");
    c.tma("h", true);
    c.validate(layer("moe_mlp")); // with its loop, fine
  }

  TEST_CASE("schedule errors: validate names an unknown Func and lists the pipeline's Funcs") {
    Schedule s = megablocks();
    s.tile("w1", 128, 128, 64);
    std::string m = error_of([&] { s.validate(layer("moe_mlp")); });
    CHECK_HAS(m, "schedule 'megablocks': tile() names 'w1', which is not a Func of this pipeline");
    CHECK_HAS(m, "its Funcs are logits, probs, route_gate, h, o, y");
    CHECK_HAS(m, "its contractions (what a schedule can tile) are logits, h, o");
  }

  TEST_CASE("schedule errors: validate refuses a Func without a contraction") {
    Schedule s;
    s.tile("probs", 64, 64, 32);
    std::string m = error_of([&] { s.validate(layer("moe_mlp")); });
    CHECK_HAS(m, "'probs' has no contraction: tile() applies only to Funcs with a sum(...)");
    CHECK_HAS(m, "this pipeline's contractions are logits, h, o");
    Schedule g;
    g.fuse_epilogue("route_gate", false);
    m = error_of([&] { g.validate(layer("swiglu_moe")); });
    CHECK_HAS(m, "'route_gate' has no contraction: fuse_epilogue() applies only to Funcs with a sum(...)");
  }

  TEST_CASE("schedule errors: validate refuses tile_m beyond the block for routed rows") {
    Schedule s = megablocks();
    s.mma("h", MmaKind::mma_sync).tile("h", 256, 128, 32);
    std::string m = error_of([&] { s.validate(layer("moe_mlp")); });
    CHECK_HAS(m, "'h' runs over the routed pairs r of route 'route'");
    CHECK_HAS(m, "tile_m 256 does not divide block 128: use tile_m <= 128 or block 256");
    // through the default: the first routed contraction is named
    Schedule d;
    d.block(64).tile("*", 128, 128, 32);
    m = error_of([&] { d.validate(layer("swiglu_moe")); });
    CHECK_HAS(m, "'h' runs over the routed pairs r");
    CHECK_HAS(m, "tile_m 128 does not divide block 64: use tile_m <= 64 or block 128");
    // raising the block is the fix
    d.block(128);
    CHECK_NOTHROW(d.validate(layer("swiglu_moe")));
  }

  // The CUDA backend's requirement, checked where it compiles (the CPU
  // backend and the reference run such layers; validate accepts them).
  TEST_CASE("schedule errors: the CUDA backend's 16-byte vectors need dimensions that are multiples of 8") {
    ExampleShape shape;
    shape.d = 100;
    megablocks().validate(layer("moe_mlp", shape));
    std::string m = error_of([&] { check_vector_alignment(layer("moe_mlp", shape)); });
    CHECK_HAS(m,
              "dimension D = 100 of 'x' is not a multiple of 8: the CUDA backend moves 16-byte vectors; pad D to 104");
    CHECK_HAS(m, "read by the contraction in 'logits'");
    ExampleShape f;
    f.f = 100;
    m = error_of([&] { check_vector_alignment(layer("swiglu_moe", f)); });
    CHECK_HAS(m,
              "dimension F = 100 of 'w1' is not a multiple of 8: the CUDA backend moves 16-byte vectors; pad F to 104");
    CHECK_HAS(m, "read by the contraction in 'h'), or run on the CPU backend");
  }

  TEST_CASE("schedule errors: wgmma needs a 64-deep tile of 64 or 128 rows and three stages") {
    Schedule s;
    CHECK_THROWS_WITH_AS(s.mma("h", MmaKind::wgmma), doctest::Contains("wgmma for 'h' needs tile_k 64"), UserError);
    s.tile("h", 128, 128, 64).mma("h", MmaKind::wgmma);
    // wgmma lays out its own warps: a layout mma.sync could not use is accepted.
    s.warps("h", 1, 4);
    CHECK_THROWS_WITH_AS(s.tile("h", 256, 128, 64), doctest::Contains("needs tile_k 64 and tile_m 64 or 128"),
                         UserError);
    CHECK(s.for_func("h").tiling.mma == MmaKind::wgmma);
    CHECK_THROWS_WITH_AS(s.stages("h", 2), doctest::Contains("use stages >= 3"), UserError);
    CHECK_THROWS_WITH_AS(Schedule::from_text("mma(\"h\", tensorcore)\n", "s.txt"),
                         doctest::Contains("expected mma_sync, wgmma or wgmma_ws"), UserError);
    Schedule back = Schedule::from_text(s.to_text());
    CHECK(back.for_func("h") == s.for_func("h"));
  }

  TEST_CASE("schedule errors: raster takes 1 to 64 row tiles per band") {
    Schedule s;
    CHECK_THROWS_WITH_AS(s.raster("h", 0), doctest::Contains("raster(\"h\", 0): 0 row tiles per band for 'h'"),
                         UserError);
    CHECK_THROWS_WITH_AS(s.raster("*", 65), doctest::Contains("use 1 to 64"), UserError);
    s.raster("h", 16);
    CHECK(s.for_func("h").tiling.raster == 16);
    CHECK(s.for_func("o").tiling.raster == 8);
    CHECK(Schedule::from_text(s.to_text()).for_func("h") == s.for_func("h"));
  }
} // TEST_SUITE
