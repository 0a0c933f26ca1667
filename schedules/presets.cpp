#include "schedules/presets.h"

#include <filesystem>

#include "dsl/error.h"

namespace moeforge {

namespace {

// Every setting is spelled out, defaults included, so a preset's text is a
// complete description that does not depend on what an empty Schedule holds.
Schedule anchor(const std::string &name, Permutation permutation, GateFusion gate) {
  Schedule s(name);
  s.permutation(permutation)
      .block(128)
      .gate(gate)
      .tile(Schedule::all_funcs, 128, 128, 64)
      .stages(Schedule::all_funcs, 4)
      .warps(Schedule::all_funcs, 8, 1)
      .mma(Schedule::all_funcs, MmaKind::wgmma_ws)
      .tma(Schedule::all_funcs, true)
      .fuse_epilogue(Schedule::all_funcs, true);
  return s;
}

std::string preset_list() {
  std::string out;
  for (const std::string &n : preset_names())
    out += (out.empty() ? "" : ", ") + n;
  return out;
}

} // namespace

Schedule megablocks() { return anchor("megablocks", Permutation::blocked, GateFusion::combine); }

Schedule scattermoe() { return anchor("scattermoe", Permutation::scattered, GateFusion::epilogue); }

std::vector<std::string> preset_names() { return {"megablocks", "scattermoe"}; }

Schedule preset(const std::string &name) {
  if (name == "megablocks")
    return megablocks();
  if (name == "scattermoe")
    return scattermoe();
  user_error << "unknown schedule preset '" << name << "': choose one of " << preset_list();
}

Schedule schedule_from_arg(const std::string &arg) {
  for (const std::string &n : preset_names())
    if (arg == n)
      return preset(n);
  std::error_code ec;
  user_check(std::filesystem::exists(arg, ec))
      << "schedule '" << arg << "' is neither a preset (" << preset_list()
      << ") nor an existing schedule file: name a preset or the path of a schedule file (a schedule's text, "
      << "as its save() writes it)";
  return Schedule::load(arg);
}

} // namespace moeforge
