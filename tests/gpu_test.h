// GPU tests skip, visibly, on machines without a GPU (CI, developer boxes):
//
//   TEST_SUITE("gpu") {
//   TEST_CASE("cuda gpu: ...") {
//     MOEFORGE_REQUIRE_GPU();
//     ...
//
// prints "SKIPPED (no GPU): libcuda.so.1 not found (...)" and returns when
// the driver cannot be loaded or reports no device. The suite name becomes a
// ctest label, so `ctest -L gpu` runs exactly these.
#pragma once

#include <doctest/doctest.h>

#include <string>

#include "backends/cuda/runtime/driver.h"

#define MOEFORGE_REQUIRE_GPU()                                                                                         \
  do {                                                                                                                 \
    std::string moeforge_no_gpu_reason;                                                                                \
    if (!::moeforge::cuda::gpu_available(&moeforge_no_gpu_reason)) {                                                   \
      MESSAGE("SKIPPED (no GPU): " << moeforge_no_gpu_reason);                                                         \
      return;                                                                                                          \
    }                                                                                                                  \
  } while (0)
