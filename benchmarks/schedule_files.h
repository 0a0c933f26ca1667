// Schedule files a benchmark times beside its own schedules, named by the
// caller in MOEFORGE_BENCH_SCHEDULES (comma-separated paths): what
// `moeforge tune` wrote, compared in the same process with the hand-written
// schedules and the presets.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

namespace moeforge::bench {

inline std::vector<std::string> schedule_files() {
  std::vector<std::string> files;
  const char *env = std::getenv("MOEFORGE_BENCH_SCHEDULES");
  const std::string list = env ? env : "";
  std::string item;
  for (size_t i = 0; i <= list.size(); ++i)
    if (i == list.size() || list[i] == ',') {
      if (!item.empty())
        files.push_back(item);
      item.clear();
    } else {
      item += list[i];
    }
  return files;
}

// Whether a benchmark's schedule name is a schedule file (Schedule::save's
// text) rather than a preset or a hand-written schedule's name.
inline bool is_schedule_file(const std::string &name) {
  return name.size() > 6 && name.compare(name.size() - 6, 6, ".sched") == 0;
}

// MOEFORGE_BENCH_ROUNDS (default 1): every case registered that many times,
// round after round (all cases, then all again), so that a comparison of
// schedules reads each one's median over rounds spread across the run rather
// than one block whose place in the run (right after which case, how long
// into it) moves its clock.
inline int bench_rounds() {
  const char *v = std::getenv("MOEFORGE_BENCH_ROUNDS");
  return v && *v ? std::max(1, std::atoi(v)) : 1;
}

} // namespace moeforge::bench
