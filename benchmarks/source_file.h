// Files of the source tree the benchmarks read (their schedule files): from
// the working directory when it is the tree's root (the device runs a copy
// of the tree), else in the tree they were built from (MOEFORGE_SOURCE_DIR).
#pragma once

#include <filesystem>
#include <string>

namespace moeforge::bench {

inline std::string source_file(const std::string &relative) {
  return std::filesystem::exists(relative) ? relative : std::string(MOEFORGE_SOURCE_DIR) + "/" + relative;
}

} // namespace moeforge::bench
