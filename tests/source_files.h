// Files of the source tree that tests read (schedule files, say), found
// wherever the test binary runs: $MOEFORGE_SOURCE_DIR when set, else the
// working directory when it is the tree's root (the device runs the suite
// from a copy of the tree), else the tree the binary was built from.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace moeforge::testing {

inline std::string source_file(const std::string &relative) {
  if (const char *dir = std::getenv("MOEFORGE_SOURCE_DIR"); dir && *dir)
    return std::string(dir) + "/" + relative;
  if (std::filesystem::exists(relative))
    return relative;
  return std::string(MOEFORGE_SOURCE_DIR) + "/" + relative;
}

} // namespace moeforge::testing
