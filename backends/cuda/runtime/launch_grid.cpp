#include "backends/cuda/runtime/launch_grid.h"

#include <algorithm>

#include "dsl/error.h"

namespace moeforge::cuda {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
} // namespace

Dim3 launch_grid(const GridShape &gs, int threads, const GridInputs &in, const std::string &kernel) {
  if (gs.windowed && in.window_tiles >= 0) {
    // The window's tiles only (the kernel reads their ids): no block is
    // launched just to find its tile outside the window. Persistent blocks
    // walk them, at most one per SM.
    int64_t gx = in.window_tiles * gs.row_tiles_per_block * ceil_div(in.extent(gs.n), gs.tile_n);
    if (gs.persistent)
      gx = std::min<int64_t>(gx, in.sm_count);
    return Dim3{static_cast<unsigned>(gx), 1, 1};
  }
  int64_t gx = 1, gy = 1;
  switch (gs.kind) {
  // GEMMs run a 1-D grid over row x column tiles (rasterised in the kernel).
  case GridShape::Kind::routed_tiles:
    gx = ceil_div(in.routing(gs.route).max_tiles() * gs.row_tiles_per_block, gs.cluster_m) * gs.cluster_m *
         ceil_div(in.extent(gs.n), gs.tile_n);
    break;
  case GridShape::Kind::dense_tiles:
    gx = ceil_div(ceil_div(in.extent(gs.count.at(0)), gs.tile_m), gs.cluster_m) * gs.cluster_m *
         ceil_div(in.extent(gs.n), gs.tile_n);
    break;
  case GridShape::Kind::elements: {
    int64_t n = 1;
    for (const Dim &d : gs.count)
      n *= in.extent(d);
    gx = ceil_div(n / gs.elements_per_thread * gs.threads_per_element, threads);
    break;
  }
  case GridShape::Kind::padded_rows: { // row slots: max(P, max_padded_rows) (emit_pointwise.cpp, padded_slots)
    const RoutingShape &rs = in.routing(gs.route);
    gx = ceil_div(std::max(rs.max_padded_rows(), rs.pairs()) * gs.chunks_per_row, threads);
    break;
  }
  case GridShape::Kind::expert_tiles:
    gx = in.routing(gs.route).experts * ceil_div(in.extent(gs.count.at(0)), gs.tile_m) *
         ceil_div(in.extent(gs.n), gs.tile_n);
    break;
  case GridShape::Kind::transpose: {
    const size_t n = gs.count.size();
    const int64_t rows = gs.route ? in.routing(gs.route).max_padded_rows() : in.extent(gs.count.at(n - 2));
    const int64_t cols = in.extent(gs.count.back());
    int64_t batch = 1;
    for (size_t i = 0; !gs.route && i + 2 < n; ++i)
      batch *= in.extent(gs.count[i]);
    gx = batch * ceil_div(rows, gs.tile_m) * ceil_div(cols, gs.tile_m);
    break;
  }
  }
  if (gs.split_k) {
    // Slices of K that fill the SMs, each at least four k-tiles long.
    const int64_t k_tiles = ceil_div(in.extent(gs.split_k_dim), gs.tile_k);
    gy = std::max<int64_t>(1, std::min<int64_t>(in.sm_count / std::max<int64_t>(gx, 1), k_tiles / 4));
  }
  gy *= gs.y_parts;
  if (gs.persistent) // one block per SM; whole clusters
    gx = std::min<int64_t>(gx, std::max<int64_t>(gs.cluster_m, in.sm_count / gs.cluster_m * gs.cluster_m));
  user_check(gx >= 1 && gx < (1LL << 31) && gy < 65536)
      << "kernel " << kernel << ": grid " << gx << " x " << gy << " is out of range for these shapes";
  return Dim3{static_cast<unsigned>(gx), static_cast<unsigned>(gy), 1};
}

} // namespace moeforge::cuda
