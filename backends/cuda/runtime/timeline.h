// What a GEMM kernel's blocks spent their time on, from the timer stamps a
// timeline build records (MOEFORGE_TIMELINE=1; tile_library.h's MF_STAMP):
// per block the global timer at entry, main-loop call, first stage landed,
// main loop done, epilogue done, and the SM it ran on. A debugging view for
// speed work: which phase of a tile the SM time goes to, and how long SMs
// sit between blocks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moeforge::cuda {

inline constexpr int kTimelineSlots = 8; // per block, as tile_library.h lays them out
inline constexpr int kTimelineBlocks = 65536;

struct TimelineSummary {
  int blocks = 0;      // blocks that ran a tile to the end (all of entry, call, done stamps)
  int early_exits = 0; // blocks that stamped entry only (surplus tiles of an upper-bound grid)
  int sms = 0;         // distinct SMs among the finished blocks
  double span_us = 0;  // first entry to last epilogue end
  // Means over finished blocks, microseconds: entry -> main-loop call (tile
  // table, row lookups), call -> first stage landed (0 when not stamped),
  // first stage -> main loop done, main loop done -> epilogue done.
  double setup_us = 0, first_stage_us = 0, main_loop_us = 0, epilogue_us = 0;
  double max_main_loop_us = 0, max_epilogue_us = 0;
  double busy = 0;   // finished blocks' summed time / (SMs x span)
  double gap_us = 0; // mean time an SM waits between one block's end and its next block's entry
  // Tiles that noted their rows (slot 6): those of at most 64 rows (an
  // expert's last rows, one consumer warpgroup active) against the fuller ones.
  int half_tiles = 0, full_tiles = 0;
  double half_main_loop_us = 0, full_main_loop_us = 0;
};

// Summarises the raw stamps (kTimelineSlots per block, zero where unset)
// of the first `blocks` blocks.
TimelineSummary summarize_timeline(const std::vector<uint64_t> &stamps, int64_t blocks);

// One line for a log: "gemm_h: 2560 blocks on 132 SMs, span 320.1 us; ...".
std::string format_timeline(const std::string &kernel, const TimelineSummary &s);

} // namespace moeforge::cuda
