// CUDA C++ from a kernel program: one module holding one kernel per step
// (routing excepted: the device routing has hand-written kernels). The source
// is readable on purpose: `moeforge emit <example> --cuda` prints it. Kernels
// include the tile library (tile_library.h) and stay thin over it.
#pragma once

#include <string>
#include <vector>

#include "lowering/kernel_program.h"
#include "runtime/routing_format.h"

namespace moeforge {

// One argument of a generated kernel, in order; the executor binds each.
struct KernelArg {
  enum class Kind {
    tensor, // a device pointer
    route,  // a routing array
    extent, // a dynamic extent (long long)
    tma, // a TMA tensor map (CUtensorMap) of a bf16 tensor seen as {cols, rows, batches}, 64 x 64 boxes, 128B swizzle
    counter, // two int32 the runtime zeroes once and the kernel leaves zero (persistent blocks' tile counter)
  };
  Kind kind;
  std::string name;                          // tensor name, routing_array_name(array), or Dim name
  const RoutingNode *route = nullptr;        // for Kind::route
  long long cols = 0, rows = 0;              // for Kind::tma: one [rows, cols] matrix (rows 0: all the tensor holds)
  long long matrix_stride = 0;               // for Kind::tma: elements from one matrix to the next (0: rows * cols)
  RoutingArray array = RoutingArray::expert; // for Kind::route
};

// How many thread blocks a kernel runs, from the run's extents.
struct GridShape {
  enum class Kind {
    routed_tiles, // x: max_tiles(route) * row_tiles_per_block; y: ceil(N / tile_n)
    dense_tiles,  // x: ceil(M / tile_m); y: ceil(N / tile_n)
    elements,     // x: ceil(product(count) / threads)
    padded_rows,  // x: ceil(max(P, max_padded_rows(route)) * chunks_per_row / threads): row slots
    expert_tiles, // x: E(route) * ceil(M / tile_m) * ceil(N / tile_n), M = count[0]
    transpose,    // x: prod(count[..-2]) * ceil(R / tile_m) * ceil(C / tile_m) for count [..., R, C];
                  //    routed (route set): R = max_padded_rows(route), C = count[0]
  };
  Kind kind = Kind::elements;
  const RoutingNode *route = nullptr;
  std::vector<Dim> count; // dims multiplied for elements / M for dense tiles
  Dim n;                  // columns, for tiles
  int tile_m = 0, tile_n = 0;
  // Routed tiles: the GEMM's row tiles in one routing block (block / tile_m;
  // the kernel counts its tiles with the same number).
  int row_tiles_per_block = 1;
  long long chunks_per_row = 0;
  int threads_per_element = 1; // elements: 32 when a warp computes each element
  int elements_per_thread = 1; // elements: 8 when a thread computes eight consecutive ones
  // dense_tiles: y slices the reduction (K, of extent split_k_dim) into
  // whole k-tiles of tile_k, as many slices as fill the SMs (split-K).
  bool split_k = false;
  Dim split_k_dim;
  int tile_k = 0;
  bool persistent = false; // tiles: at most one block per SM, each walking tiles
  bool windowed = false;   // routed tiles: x counts a window's tiles, not max_tiles (GemmStep::windowed)
  int cluster_m = 1;       // tiles: blocks per cluster along M (the row tiles are rounded up to a multiple)
  int y_parts = 1;         // y: parts of the work each x block's range has (an attention's d_key and d_value)
};

struct GeneratedKernel {
  std::string name; // the extern "C" symbol
  std::string step; // the kernel program step it runs
  std::vector<KernelArg> args;
  GridShape grid;
  int threads = 256;
  int shared_bytes = 0; // dynamic shared memory
  // A tensor the runtime zeroes before each launch (a split-K GEMM's output,
  // which the slices add into); empty for none.
  std::string zero_first;
  std::string source; // the kernel's definition (after the module's preamble)
};

struct CudaModuleSource {
  std::string preamble;                 // what every kernel's text needs first: the tile library, timeline flag
  std::string source;                   // the whole module: the preamble, then every kernel
  std::vector<GeneratedKernel> kernels; // in step order (routing steps have none)
  // Kernel i alone: the preamble and its definition, a compilation unit.
  std::string unit(size_t i) const { return preamble + kernels.at(i).source; }
  // Its GEMMs stamp their phases (MOEFORGE_TIMELINE was set when it was
  // generated): the module compiles as one unit, whose kernels share the
  // stamps' global.
  bool timeline = false;
};

// Throws UserError for what the CUDA backend cannot do (e.g. a K or N that is
// not a multiple of 8), naming the definition and the fix.
CudaModuleSource generate_cuda(const KernelProgram &program);

// MOEFORGE_TIMELINE is set: GEMM kernels are generated with timer stamps at
// their phases (tile_library.h's MF_STAMP), which CudaLayer::timeline() reads.
bool timeline_requested();

} // namespace moeforge
