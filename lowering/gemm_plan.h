// How one GEMM step runs on the CUDA target (sm_90a): every choice the
// generated kernel makes, resolved once from the step and its schedule
// before any code is printed. The codegen reads the plan and holds only
// internal checks; the schedule's combinations the target cannot run are
// user errors here, naming the primitive and the fix. A lowering pass that
// needs no CUDA, so that a command on any backend can say which of the
// choices a schedule named the plan could not take (not_applied_choices).
// `moeforge emit <example> --plan` prints the plans (describe()).
#pragma once

#include <string>
#include <vector>

#include "lowering/kernel_program.h"

namespace moeforge {

// How an operand reaches shared memory.
enum class OperandLoad {
  cp_async,      // by cp.async: A's rows (direct, or through sorted_pair as the step's a_rows says), B's matrix
  tma,           // by TMA: A's rows in tile order; B's [K, N] matrix per expert (or one), or B^T [N, K] in place
  rows_cp_async, // an expert reduction's operand read where it is: its rows, by cp.async
  rows_tma,      // ... zero-padded rows in the padded order, by TMA
};
// How the blocks walk the output tiles.
enum class TileWalk {
  per_tile,         // a block per output tile
  cluster_pairs,    // a 2-block cluster per pair of row tiles (2m, 2m + 1), B multicast
  persistent,       // a block per SM drawing tiles from a counter
  persistent_pairs, // persistent 2-block clusters drawing (row-tile pair, column tile) items
};
// How the output tile leaves.
enum class TileStore {
  plain, // a store per element (pair)
  wide,  // 8- or 16-byte stores of a quad's columns
  tma,   // staged in shared memory, stored by TMA
};

struct GemmPlan {
  std::string step;
  // The tile the plan was made for (the schedule's GemmTiling of the step):
  // its shape, stages, warps and raster band, what the code is printed with.
  GemmTiling tiling;
  // ---- the main loop
  MmaKind mma = MmaKind::wgmma_ws;
  bool wgmma() const { return mma != MmaKind::mma_sync; }
  // Warp-specialised: a producer warpgroup loads, the consumers compute.
  bool ws() const { return mma == MmaKind::wgmma_ws; }
  int nb = 1; // B operands (accumulator sets)
  OperandLoad a_load = OperandLoad::cp_async, b_load = OperandLoad::cp_async;
  // An expert reduction reading both operands where they are (rows of the
  // routed tensors) rather than from a transposed copy.
  bool in_place() const { return b_load == OperandLoad::rows_cp_async || b_load == OperandLoad::rows_tma; }
  bool tma() const { return b_load == OperandLoad::tma; }
  bool a_tma() const { return a_load == OperandLoad::tma; }
  bool b_tma_rows() const { return b_load == OperandLoad::rows_tma; }
  bool a_tma_rows() const { return a_load == OperandLoad::rows_tma; }
  bool chained = false; // a second product into the same accumulator (GemmStep::chained)
  // A (the first product's) or B stored sorted (lowering/sorted_rows.h):
  // loaded from the tile's, or the expert's, unpadded first row.
  bool a_sorted = false, b_sorted = false;
  // An expert reduction over A and B both stored sorted
  // (store_gathers_sorted): K runs over each expert's pairs from its
  // unpadded first row, and the last k-tile's A rows past them (the next
  // expert's) are zeroed in shared memory before the tensor cores read it.
  bool k_unpadded = false;
  // The narrow tail (GemmTiling::narrow_tail): the last column tile holds
  // N % tile_n <= tile_n / 2 columns, and its wgmmas are narrower
  // (narrow_width).
  bool narrow_tail = false;
  // Split-K over the grid's y: a dense GEMM over a dynamic K with few tiles.
  bool split_k = false;
  // ---- the walk over output tiles
  TileWalk walk = TileWalk::per_tile;
  bool persistent() const { return walk == TileWalk::persistent || walk == TileWalk::persistent_pairs; }
  bool cluster() const { return walk == TileWalk::cluster_pairs || walk == TileWalk::persistent_pairs; }
  bool pair_items() const { return walk == TileWalk::persistent_pairs; }
  bool windowed = false; // over a window of the route's tiles (GemmStep::windowed)
  // ---- the epilogue
  bool reads_row = false;     // an epilogue reads the row's pair index
  bool pair_rows = false;     // the tile's rows are looked up through sorted_pair
  bool roomy = false;         // accumulators leave registers for latency trims
  bool prefetch_rows = false; // those lookups made before the main loop
  TileStore store = TileStore::plain;
  bool out_tma() const { return store == TileStore::tma; }
  bool wide_stores() const { return store == TileStore::wide; }
  bool zero_rows = false; // a zero-padded output: padding rows stored as zeros
  int staged_cols = 0;    // columns staged at a time (out_tma, persistent)
  // ---- resources
  int stage_bytes = 0;   // the ring of stages
  int ring_bytes = 0;    // + alignment slack, barriers, a persistent block's tile ids
  int staging_bytes = 0; // a persistent block's output staging, past the ring
  int threads = 0;
  int min_blocks = 1; // blocks per SM the launch bounds ask for
  int shared_bytes() const { return ring_bytes + staging_bytes; }
  // ---- what the schedule named for this GEMM's Func and the plan could not
  // apply (GemmTiling::named), each with why: the GEMM runs without it.
  std::vector<std::string> not_applied;
};

// The wgmma width a narrow tail of `cols` columns runs (the tile's last
// column tile, tile_n / 2 columns or fewer): tile_n / 4 where that covers
// them and is 64 or more, else tile_n / 2, as the tile library's
// stage_mma chooses.
inline int narrow_width(int tile_n, int cols) {
  return cols <= tile_n / 4 && tile_n / 4 >= 64 ? tile_n / 4 : tile_n / 2;
}

// Resolves g's plan; a user error where the schedule asks for what this
// backend cannot run for g (a dimension not a multiple of 8, a dynamic
// column extent, too many accumulators, clusters or a chained product
// without the loop they need, shared memory past the SM's).
GemmPlan plan_gemm(const KernelProgram &prog, const GemmStep &g);

// The pass: every GEMM step's plan_gemm stored on it (GemmStep::plan), or
// the UserError's text where the CUDA target cannot run it
// (GemmStep::plan_refusal). Again after any change to the program.
void plan_gemms(KernelProgram &prog);
// g's stored plan; its refusal as a UserError; an internal error where no
// plan_gemms ran.
const GemmPlan &planned(const GemmStep &g);

// The plan as text, one GEMM per paragraph (the header line first, then
// indented lines); with `notes`, the named
// choices it could not take too (without: only what the kernel does, which
// the tuner compares to skip candidates that change nothing).
std::string describe(const GemmPlan &p, const GemmStep &g, bool notes = true);

// Every GEMM step's stored plan, in program order (a UserError for the
// first the CUDA target refuses).
std::string describe_gemm_plans(const KernelProgram &prog, bool notes = true);

// The choices named for a Func that its GEMMs could not take, one line each
// ("definition 'h': tma_store(\"h\", true) is not applied: ..."), in
// program order, then the layer-wide ones lowering could not take
// (KernelProgram::not_applied): what a command prints before it runs,
// whatever the backend, so that no named choice is dropped unseen.
std::vector<std::string> not_applied_choices(const KernelProgram &prog);

} // namespace moeforge
