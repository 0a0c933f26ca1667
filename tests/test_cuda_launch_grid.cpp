// The grid every generated kernel launches with (launch_grid.h), from the
// code generator's GridShape and a token count's extents, checked without
// a GPU: each routed GEMM covers every row tile the routing can have, the
// kernel counts its tiles with the grid's own row tiles per block, a
// persistent grid fits the SMs in whole clusters, and a grid CUDA cannot
// launch is a UserError naming the kernel.
#include <doctest/doctest.h>

#include <string>
#include <variant>

#include "backends/cuda/codegen/codegen_cuda.h"
#include "backends/cuda/runtime/launch_grid.h"
#include "benchmarks/train_schedule.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "runtime/program_shapes.h"
#include "schedules/presets.h"
#include "user_error.h"

using namespace moeforge;
using namespace moeforge::cuda;

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

GridInputs inputs_of(const ProgramShapes &shapes, int sms) {
  GridInputs in;
  in.extent = [&shapes](const Dim &d) { return shapes.extent(d); };
  in.routing = [&shapes](const RoutingNode *r) -> const RoutingShape & { return shapes.routing(r); };
  in.sm_count = sms;
  return in;
}

} // namespace

TEST_CASE("launch grid: every routed GEMM covers the routing's row tiles, counted as its kernel counts them") {
  const Example ex = make_example("swiglu_moe", testing::shape(300, 128, 256, 16, 2));
  for (int which : {0, 1, 2}) {
    const Schedule s = which == 0 ? bench::tuned_wide(true) : preset(which == 1 ? "megablocks" : "scattermoe");
    const KernelProgram p = lower_training(ex.pipeline, ex.pipeline.func(ex.output), s).program;
    const CudaModuleSource m = generate_cuda(p);
    for (int64_t tokens : {1, 300, 4096}) {
      const ProgramShapes shapes(p, tokens);
      const int sms = 132;
      int routed = 0, persistent = 0;
      for (const GeneratedKernel &k : m.kernels) {
        INFO("schedule " << which << ", kernel " << k.name << ", T = " << tokens);
        const GridShape &gs = k.grid;
        const Dim3 grid = launch_grid(gs, k.threads, inputs_of(shapes, sms), k.name);
        CHECK(grid.x >= 1);
        CHECK(grid.y >= 1);
        if (gs.kind != GridShape::Kind::routed_tiles)
          continue;
        ++routed;
        const RoutingShape &rs = shapes.routing(gs.route);
        const int64_t tiles = rs.max_tiles() * gs.row_tiles_per_block * ceil_div(shapes.extent(gs.n), gs.tile_n);
        if (gs.persistent) {
          CHECK(grid.x <= static_cast<unsigned>(std::max(sms, gs.cluster_m)));
          CHECK(grid.x % gs.cluster_m == 0);
        } else {
          CHECK(grid.x >= tiles); // a block for every tile the routing can have
          CHECK(grid.x % gs.cluster_m == 0);
        }
        // Persistent blocks walk the row tiles the kernel counts itself: the
        // routing's tiles in use times the same row tiles per block.
        if (gs.persistent) {
          ++persistent;
          CHECK(k.source.find("_num_tiles * " + std::to_string(gs.row_tiles_per_block)) != std::string::npos);
        }
      }
      CHECK(routed >= 3); // the forward's two expert GEMMs and the backward's
      if (which == 0)
        CHECK(persistent >= 1); // tuned_wide's
    }
  }
}

TEST_CASE("launch grid: a windowed GEMM launches its window's tiles, none for an empty window") {
  const Example ex = make_example("moe_mlp", testing::shape(256, 128, 256, 8, 2));
  const KernelProgram p = lower(ex.pipeline, preset("megablocks"));
  const ProgramShapes shapes(p, 256);
  GridShape gs;
  gs.kind = GridShape::Kind::routed_tiles;
  gs.route = p.routes.at(0);
  gs.n = ex.pipeline.func("h").args()[1].dim();
  gs.tile_m = 64;
  gs.tile_n = 128;
  gs.row_tiles_per_block = 2;
  gs.windowed = true;
  GridInputs in = inputs_of(shapes, 132);
  // Before a window is chosen: the bound over every tile.
  CHECK(launch_grid(gs, 256, in, "k").x == shapes.routing(gs.route).max_tiles() * 2 * 2);
  in.window_tiles = 3;
  CHECK(launch_grid(gs, 256, in, "k").x == 3u * 2 * 2);
  in.window_tiles = 0;
  CHECK(launch_grid(gs, 256, in, "k").x == 0u);
  gs.persistent = true;
  in.window_tiles = 1000;
  CHECK(launch_grid(gs, 256, in, "k").x == 132u);
}

TEST_CASE("launch grid: split-K slices fill the SMs; a grid CUDA cannot launch names its kernel") {
  const Example ex = make_example("moe_mlp", testing::shape(256, 128, 256, 8, 2));
  const KernelProgram p = lower(ex.pipeline, preset("megablocks"));
  const ProgramShapes shapes(p, 256);
  const GridInputs in = inputs_of(shapes, 132);
  GridShape gs;
  gs.kind = GridShape::Kind::dense_tiles;
  gs.count = {ex.pipeline.func("h").args()[1].dim()}; // M = F = 256
  gs.n = gs.count[0];
  gs.tile_m = gs.tile_n = 128;
  gs.split_k = true;
  gs.split_k_dim = gs.count[0]; // K = 256: four 64-wide k-tiles, one slice
  gs.tile_k = 64;
  Dim3 g = launch_grid(gs, 256, in, "k");
  CHECK(g.x == 4u);
  CHECK(g.y == 1u);

  GridShape huge;
  huge.kind = GridShape::Kind::elements;
  huge.count = {gs.count[0], gs.count[0], gs.count[0], gs.count[0], gs.count[0]}; // 256^5 = 2^40 elements
  CHECK(testing::user_error_of([&] {
          launch_grid(huge, 256, in, "gemm_h");
        }).find("kernel gemm_h: grid 4294967296 x 1 is out of range for these shapes") != std::string::npos);
}
