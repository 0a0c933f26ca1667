#include "backends/cuda/runtime/timeline.h"

#include <algorithm>
#include <cstdio>
#include <map>

namespace moeforge::cuda {

namespace {

struct Block {
  uint64_t entry, call, first, done, end;
};

} // namespace

TimelineSummary summarize_timeline(const std::vector<uint64_t> &stamps, int64_t blocks) {
  TimelineSummary s;
  std::map<uint64_t, std::vector<Block>> by_sm;
  uint64_t first_entry = UINT64_MAX, last_end = 0;
  double setup = 0, first = 0, main = 0, epi = 0, busy = 0, half_main = 0, full_main = 0;
  blocks = std::min<int64_t>(blocks, static_cast<int64_t>(stamps.size()) / kTimelineSlots);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint64_t *t = &stamps[static_cast<size_t>(b) * kTimelineSlots];
    Block k{t[0], t[1], t[2], t[3], t[4]};
    if (k.entry && !k.end) {
      ++s.early_exits;
      continue;
    }
    // A block that finished stamped entry, call, main-loop end and end, in order.
    if (!k.entry || !k.call || !k.done || k.call < k.entry || k.done < k.call || k.end < k.done)
      continue;
    if (k.first && (k.first < k.call || k.first > k.done))
      k.first = 0;
    ++s.blocks;
    const double loop = double(k.done - (k.first ? k.first : k.call)); // ns, from the first stage when stamped
    setup += double(k.call - k.entry);
    first += k.first ? double(k.first - k.call) : 0.0;
    main += loop;
    epi += double(k.end - k.done);
    busy += double(k.end - k.entry);
    s.max_main_loop_us = std::max(s.max_main_loop_us, loop / 1e3);
    s.max_epilogue_us = std::max(s.max_epilogue_us, double(k.end - k.done) / 1e3);
    if (t[6] > 0) { // rows + 1
      const bool half = t[6] - 1 <= 64;
      (half ? s.half_tiles : s.full_tiles) += 1;
      (half ? half_main : full_main) += loop;
    }
    first_entry = std::min(first_entry, k.entry);
    last_end = std::max(last_end, k.end);
    by_sm[t[5]].push_back(k);
  }
  if (s.blocks == 0)
    return s;
  const double n = s.blocks;
  s.sms = static_cast<int>(by_sm.size());
  s.span_us = double(last_end - first_entry) / 1e3;
  s.setup_us = setup / n / 1e3;
  s.first_stage_us = first / n / 1e3;
  s.main_loop_us = main / n / 1e3;
  s.epilogue_us = epi / n / 1e3;
  s.busy = busy / (double(s.sms) * double(last_end - first_entry));
  s.half_main_loop_us = s.half_tiles ? half_main / s.half_tiles / 1e3 : 0.0;
  s.full_main_loop_us = s.full_tiles ? full_main / s.full_tiles / 1e3 : 0.0;
  double gaps = 0;
  int64_t gap_count = 0;
  for (auto &[sm, list] : by_sm) {
    std::sort(list.begin(), list.end(), [](const Block &a, const Block &b) { return a.entry < b.entry; });
    for (size_t i = 1; i < list.size(); ++i)
      if (list[i].entry >= list[i - 1].end) { // one block at a time on this SM
        gaps += double(list[i].entry - list[i - 1].end);
        ++gap_count;
      }
  }
  s.gap_us = gap_count ? gaps / double(gap_count) / 1e3 : 0.0;
  return s;
}

std::string format_timeline(const std::string &kernel, const TimelineSummary &s) {
  char line[512];
  std::snprintf(line, sizeof line,
                "%s: %d blocks (+%d early exits) on %d SMs, span %.1f us; per block (mean us): setup %.2f, "
                "first stage %.2f, main loop %.2f (max %.2f), epilogue %.2f (max %.2f); SMs busy %.1f %%, "
                "gap between blocks %.2f us",
                kernel.c_str(), s.blocks, s.early_exits, s.sms, s.span_us, s.setup_us, s.first_stage_us, s.main_loop_us,
                s.max_main_loop_us, s.epilogue_us, s.max_epilogue_us, 100.0 * s.busy, s.gap_us);
  std::string out = line;
  if (s.half_tiles + s.full_tiles > 0) {
    std::snprintf(line, sizeof line, "; main loop of tiles <= 64 rows %.2f us (%d), of fuller tiles %.2f us (%d)",
                  s.half_main_loop_us, s.half_tiles, s.full_main_loop_us, s.full_tiles);
    out += line;
  }
  return out;
}

} // namespace moeforge::cuda
