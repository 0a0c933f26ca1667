// runtime/parallel.h: host loops split over the cores visit
// every index once, whatever the grain (a matrix of rows over 2^20 elements
// asks for a grain of 1: the CLI's `train` at d = 2048, f = 1408 divided
// by zero there).
#include <doctest/doctest.h>

#include <atomic>
#include <vector>

#include "runtime/parallel.h"

using namespace moeforge;

TEST_CASE("host parallel: every index once, for any count and grain") {
  for (int64_t n : {0, 1, 7, 8, 1000, 100000})
    for (int64_t grain : {int64_t(1), int64_t(2), int64_t(3), int64_t(4), int64_t(64), int64_t(1) << 20}) {
      std::vector<std::atomic<int>> seen(static_cast<size_t>(n));
      parallel_chunks(
          n,
          [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i)
              seen[static_cast<size_t>(i)]++;
          },
          grain);
      int wrong = 0;
      for (const std::atomic<int> &s : seen)
        wrong += s.load() != 1;
      INFO("n = " << n << ", grain " << grain);
      CHECK(wrong == 0);
    }
}
