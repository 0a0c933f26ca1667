// Routing on the device: probabilities in, the blocked routing format of
// routing_host.h out, queued on a stream with no host synchronisation (so a
// whole step can be captured in a CUDA graph).
#pragma once

#include "backends/cuda/device.h"
#include "backends/cuda/module.h"
#include "backends/cuda/nvrtc_compiler.h"
#include "backends/cuda/stream.h"
#include "runtime/routing_host.h"

#include <string>
#include <vector>

namespace moeforge::cuda {

// Threads per block of every routing kernel, and pairs per chunk of the
// counting sort: a chunk is one block's share of the histogram and scatter.
// Larger chunks mean fewer chunks for the single-block scan to walk.
inline constexpr int kRoutingThreads = 256;
inline constexpr int kRoutingChunk = 2048;

// The routing kernels' names in the module, in launch order.
const std::vector<std::string> &routing_kernel_names();
// NVRTC input for the routing kernels (the -D constants above added to `options`).
const char *routing_kernels_source();
CompileOptions routing_compile_options(const std::string &arch);
// Compiles (or loads from the cache) the routing kernels for `arch`; no GPU needed.
CompileResult compile_routing_kernels(const std::string &arch);

// The device buffers of one routing, sized for `shape` (see routing_host.h
// for each array's meaning). Outputs are written by DeviceRouting::run; the
// chunk_* buffers are its scratch.
struct RoutingPlan {
  explicit RoutingPlan(const RoutingShape &shape);

  RoutingShape shape;
  int64_t chunks = 0;                                  // ceil(P / kRoutingChunk)
  DeviceBuffer expert, gate;                           // int32, f32 [P]
  DeviceBuffer counts;                                 // int32 [E]
  DeviceBuffer offsets, offsets_unpadded;              // int32 [E+1]
  DeviceBuffer pair_pos;                               // int32 [P]
  DeviceBuffer sorted_pair;                            // int32 [max_padded_rows]
  DeviceBuffer tile_expert, tile_row_start, tile_rows; // int32 [max_tiles]
  DeviceBuffer num_tiles;                              // int32 [1]
  DeviceBuffer chunk_counts, chunk_base;               // int32 [chunks, E]

  // Writes `pattern` over every output (not `expert` when it is the input,
  // see DeviceRouting::run_from_experts), so tests see unwritten entries.
  void poison(uint32_t pattern, bool including_expert = true);
  // Copies the tables back (synchronous; for tests and debugging).
  RoutingTables download() const;
  std::vector<float> download_gate() const;
};

// The compiled routing kernels, loaded into the current context.
class DeviceRouting {
public:
  // Compiles for `arch` (normally Device::arch()) and loads the module.
  explicit DeviceRouting(const std::string &arch);
  explicit DeviceRouting(const Device &device) : DeviceRouting(device.arch()) {}

  // Routes probs (f32 [T, E] row-major, on the device) into `plan`. Queued on
  // `stream`; returns at once. Probabilities must not be NaN (the order of
  // NaNs is undefined on every backend). With `softmax`, probs holds logits
  // and the routing selects by their row softmax, computed as the generated
  // pointwise softmax computes it. The gates (the chosen probabilities, pair
  // order) go to `gate` (f32 [T*k]) when given, else to plan.gate.
  void run(CUdeviceptr probs, RoutingPlan &plan, const Stream &stream, bool softmax = false,
           CUdeviceptr gate = 0) const;
  // The same from plan.expert, already filled (expert ids 0..E-1; a router
  // computed elsewhere, or a test's chosen distribution). plan.gate is untouched.
  void run_from_experts(RoutingPlan &plan, const Stream &stream) const;

  const CompileResult &compiled() const { return compiled_; }

private:
  CompileResult compiled_;
  Module module_;
  Kernel topk_, histogram_, scan_, scatter_;
};

} // namespace moeforge::cuda
