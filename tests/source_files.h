// Files of the source tree that tests read (schedule files, golden texts):
// the benchmarks' lookup (benchmarks/source_file.h), under the tests' name.
#pragma once

#include <string>

#include "benchmarks/source_file.h"

namespace moeforge::testing {

inline std::string source_file(const std::string &relative) { return bench::source_file(relative); }

} // namespace moeforge::testing
