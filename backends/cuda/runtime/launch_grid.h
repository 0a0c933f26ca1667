// The grid a generated kernel launches with, from its GridShape (what the
// code generator decided) and the run's extents. One function for every
// launch, so the host's count of blocks and the kernel's own count of tiles
// (which the generator prints from the same GridShape fields) cannot drift
// apart; and a pure one, so it is tested without a GPU.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "backends/cuda/codegen/codegen_cuda.h"
#include "backends/cuda/runtime/module.h"
#include "runtime/routing_format.h"

namespace moeforge::cuda {

// What a grid's size depends on at launch.
struct GridInputs {
  std::function<int64_t(const Dim &)> extent;                       // a Dim's extent at this token count
  std::function<const RoutingShape &(const RoutingNode *)> routing; // a route's shape at this count
  int sm_count = 1;
  // A windowed GEMM's launch (GridShape::windowed): the tiles of the window
  // it runs over; -1 for the launch that is built before any window is set
  // (its x is the non-windowed bound).
  int64_t window_tiles = -1;
};

// blockDim.x = threads; x (and y for split-K) as GridShape's kinds say. A
// UserError naming `kernel` for a grid CUDA cannot launch (x of 2^31 or
// more, y of 65536 or more). A window of no tiles gives x = 0: nothing to
// launch.
Dim3 launch_grid(const GridShape &gs, int threads, const GridInputs &in, const std::string &kernel);

} // namespace moeforge::cuda
