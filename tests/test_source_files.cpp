// tests/source_files.h: tests find the tree's files from any directory.
#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>

#include "source_files.h"

using moeforge::testing::source_file;

TEST_CASE("source files: found through MOEFORGE_SOURCE_DIR, the working directory, or the build's tree") {
  const std::string rel = "benchmarks/schedules/forward/tuned_tma_persist_pair_o_gelu.sched";
  const std::filesystem::path here = std::filesystem::current_path();
  // From a directory that is not the tree (the build directory, as ctest
  // runs it), the tree the binary was built from.
  std::filesystem::path elsewhere = std::filesystem::temp_directory_path() / "moeforge_source_files_test";
  std::filesystem::create_directories(elsewhere);
  std::filesystem::current_path(elsewhere);
  ::unsetenv("MOEFORGE_SOURCE_DIR");
  CHECK(source_file(rel) == std::string(MOEFORGE_SOURCE_DIR) + "/" + rel);
  CHECK(std::filesystem::exists(source_file(rel)));
  // From the root of a copy of the tree, the copy's file.
  std::filesystem::create_directories((elsewhere / rel).parent_path());
  std::filesystem::copy_file(std::string(MOEFORGE_SOURCE_DIR) + "/" + rel, elsewhere / rel,
                             std::filesystem::copy_options::overwrite_existing);
  CHECK(source_file(rel) == rel);
  // The environment variable first.
  ::setenv("MOEFORGE_SOURCE_DIR", "/some/tree", 1);
  CHECK(source_file(rel) == "/some/tree/" + rel);
  ::unsetenv("MOEFORGE_SOURCE_DIR");
  std::filesystem::current_path(here);
  std::filesystem::remove_all(elsewhere);
}
