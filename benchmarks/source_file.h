// Files of the source tree that the benchmarks and tests read (schedule
// files, golden texts), found wherever the binary runs: $MOEFORGE_SOURCE_DIR
// when set, else the working directory when it is the tree's root (the
// device runs a copy of the tree), else the tree the binary was built from
// (the MOEFORGE_SOURCE_DIR definition).
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace moeforge::bench {

inline std::string source_file(const std::string &relative) {
  if (const char *dir = std::getenv("MOEFORGE_SOURCE_DIR"); dir && *dir)
    return std::string(dir) + "/" + relative;
  if (std::filesystem::exists(relative))
    return relative;
  return std::string(MOEFORGE_SOURCE_DIR) + "/" + relative;
}

} // namespace moeforge::bench
