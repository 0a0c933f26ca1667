// Routing on the device: probabilities in, the blocked routing format of
// routing_host.h out, queued on a stream with no host synchronisation (so a
// whole step can be captured in a CUDA graph).
#pragma once

#include "backends/cuda/codegen/nvrtc_compiler.h"
#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/module.h"
#include "backends/cuda/runtime/stream.h"
#include "runtime/routing_host.h"
#include "runtime/size_terms.h"

#include <array>
#include <optional>
#include <string>
#include <vector>

namespace moeforge::cuda {

// Threads per block of every routing kernel but the top-k.
inline constexpr int kRoutingThreads = 256;
// Threads per block of the top-k kernels (moe_topk_e*): a pass of their
// tokens covers a chunk of the design shapes (128 tokens at 4 lanes each),
// so one block per chunk routes it in one pass and also counts it, where
// half the threads took two passes, or a second launch to count.
inline constexpr int kRoutingTopkThreads = 512;
// moe_capacity_keep's block: one per expert (device/routing_kernels.cuh).
inline constexpr int kCapacityThreads = 1024;

// Pairs per chunk of the counting sort: the histogram and the scatter run a
// block per chunk (and the top-k when it counts, see routing_fuses_counts),
// so the chunk is chosen from the shape to make about kRoutingTargetChunks
// blocks, one per SM of an H100 / H200 (132 SMs): fewer leave SMs idle in
// these latency-bound kernels, more make a second wave. Every scatter block
// reads the whole (chunks, E) count table, so with many experts the chunks
// are fewer (chunks * E <= kRoutingMaxChunkCounts). A chunk is a multiple of
// kRoutingChunkQuantum pairs (each warp of a scatter block takes 1/8 of it),
// and at least that many, so a block's fixed costs stay amortised.
inline constexpr int64_t kRoutingTargetChunks = 128;
inline constexpr int64_t kRoutingMaxChunkCounts = 16384;
inline constexpr int64_t kRoutingChunkQuantum = 128;
int64_t routing_chunk_pairs(const RoutingShape &shape);
// The most chunks any token count gives (the target, which a chunk of at
// least P / target pairs never exceeds): chunk_counts is sized by it, so the
// tables' bytes follow the token count in size_terms.h's forms.
int64_t routing_max_chunks(int experts);

// Every kernel of the routing module. One top-k kernel per bound on E (see
// routing_topk_kernel), then moe_chunk_histogram, moe_scan_scatter,
// moe_capacity_keep and one moe_one_block_e* per bound on E.
const std::vector<std::string> &routing_kernel_names();
// The top-k kernel that routes `experts` experts: moe_topk_e32 .. _e256,
// and how many tokens a block of it routes at a time (a pass).
const std::string &routing_topk_kernel(int experts);
int64_t routing_topk_tokens_per_pass(int experts);

// Whether the top-k kernel, a block per chunk, also counts each chunk's
// pairs per expert, saving the histogram's launch: when a chunk is light
// work for a block, one pass over its tokens or at most kRoutingFusedRounds
// argmax rounds (passes times k). Heavier chunks would leave too few blocks
// to hide the latency of their rounds; the top-k then runs a block per pass
// of tokens and moe_chunk_histogram counts.
inline constexpr int64_t kRoutingFusedRounds = 4;
bool routing_fuses_counts(const RoutingShape &shape);

// The most pairs moe_one_block_e* routes (their experts and gates stay in
// its shared memory: 16 KiB), and the most tokens: a warp each.
inline constexpr int64_t kRoutingOneBlockPairs = 2048;
inline constexpr int64_t kRoutingOneBlockTokens = kRoutingTopkThreads / 32;
// Whether a routing of `shape` runs as one block (moe_one_block_e*, the
// top-k and the placing in one launch): at most kRoutingOneBlockTokens
// tokens and kRoutingOneBlockPairs pairs, one expert group and no
// capacity. That is decoding, where each routing kernel is a chain of
// dependent steps for a handful of pairs (at one token on qwen3moe's shape
// the top-k and the scan-and-scatter kernels took 8 us each for 8 pairs):
// one launch instead of two made the forward 2.5-4.5 us faster on every
// decoding row measured (H100). The environment variable
// MOEFORGE_NO_ONE_BLOCK_ROUTING=1 turns it off (for A/B timing).
bool routing_in_one_block(const RoutingShape &shape);

// NVRTC input for the routing kernels, its top-k kernels instantiated (the
// -D constants above added to `options`).
const char *routing_kernels_source();
CompileOptions routing_compile_options(const std::string &arch);
// Compiles (or loads from the cache) the routing kernels for `arch`; no GPU needed.
CompileResult compile_routing_kernels(const std::string &arch);

// The device buffers of one routing, sized for `shape` (see routing_host.h
// for each array's meaning). Outputs are written by DeviceRouting::run;
// chunk_counts is its scratch.
struct RoutingPlan {
  explicit RoutingPlan(const RoutingShape &shape);
  // A plan whose tables live in memory the caller gives (place()), with
  // none of its own: a layer on caller memory keeps them with the
  // activations a forward saves for its backward.
  static RoutingPlan unplaced(const RoutingShape &shape);
  // The bytes place() needs for `shape`'s tables (each array 256-aligned).
  static size_t table_bytes(const RoutingShape &shape);
  // table_bytes over any token count (size_terms.h); none for a dropping route.
  static std::optional<SizeTerms> table_terms(const RoutingShape &shape);

  RoutingShape shape;
  int64_t chunk = 0;                      // routing_chunk_pairs(shape)
  int64_t chunks = 0;                     // ceil(P / chunk)
  bool fused = false;                     // routing_fuses_counts(shape)
  bool one_block = false;                 // routing_in_one_block(shape); run() takes it (tests may clear it)
  int64_t topk_chunk = 0;                 // pairs per top-k block: chunk when fused, else one pass of tokens
  DeviceBuffer expert, gate;              // int32, f32 [P]
  DeviceBuffer counts;                    // int32 [E]
  DeviceBuffer offsets, offsets_unpadded; // int32 [E+1]
  DeviceBuffer pair_pos;                  // int32 [P]
  DeviceBuffer sorted_pair;               // int32 [max_padded_rows]
  DeviceBuffer tile_expert, tile_row_start, tile_rows; // int32 [max_tiles]
  DeviceBuffer num_tiles;                              // int32 [1]
  DeviceBuffer chunk_counts;                           // int32 [routing_max_chunks(E) >= chunks, 32 * 2^n >= E]
  // With a capacity (shape.drops()): expert[r], or -1 where dropped
  // (moe_capacity_keep); what the counting and placing read. Else empty.
  DeviceBuffer placed; // int32 [P]

  // Takes a shape of the same experts, k and (no) capacity with at most the
  // pairs this plan was made for: its tables fit the buffers already held
  // (the scratch grows if the smaller shape's chunking needs more). For a
  // layer whose row count changes from step to step (an expert-parallel
  // rank's received rows) without allocating each step.
  void reshape(const RoutingShape &smaller);
  // An unplaced plan: points every array at its part of `tables`
  // (table_bytes(shape) bytes; 0 for none yet). The arrays' DeviceBuffer
  // objects stay where they are, so kernel arguments taken from them
  // (arg()) follow the move.
  void place(CUdeviceptr tables);
  // An unplaced plan for any other shape (of the same experts, k and
  // capacity rule); unplaced until the next place().
  void resize(const RoutingShape &shape);
  // Writes `pattern` over every output (not `expert` when it is the input,
  // see DeviceRouting::run_from_experts), so tests see unwritten entries.
  void poison(uint32_t pattern, bool including_expert = true);
  // Copies the tables back (synchronous; for tests and debugging).
  RoutingTables download() const;
  std::vector<float> download_gate() const;

private:
  RoutingPlan() = default;
  // shape and the chunking that follows from it.
  void set_shape(const RoutingShape &shape);
  // Every array and its bytes for the current shape, in placement order.
  std::vector<std::pair<DeviceBuffer *, size_t>> arrays();
};

// Where the top-k kernels report a score that is NaN or infinite
// (routing_score_check.h): the device key and the mapped flag, with the
// route's tag (routing_route_tag); all zero for no report (the token's
// gates are made NaN either way).
struct NonFiniteSink {
  CUdeviceptr first_bad = 0, seen = 0;
  uint64_t route_tag = 0;
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
  // order) go to `gate` (f32 [T*k]) when given, else to plan.gate. With
  // `renormalize` (a gate tensor given, no capacity, one expert group) each
  // gate is divided by the sum of its token's k chosen probabilities, added
  // in slot order from 0. A token with a score (or, with `softmax`, a
  // probability) that is NaN or infinite gets experts in range and NaN
  // gates, and is reported to `sink`.
  void run(CUdeviceptr probs, RoutingPlan &plan, const Stream &stream, bool softmax = false, CUdeviceptr gate = 0,
           bool renormalize = false, NonFiniteSink sink = {}) const;
  // The same from plan.expert, already filled (expert ids 0..E-1; a router
  // computed elsewhere, or a test's chosen distribution). plan.gate is
  // untouched; a capacity that keeps the best scores reads it.
  void run_from_experts(RoutingPlan &plan, const Stream &stream) const;

  const CompileResult &compiled() const { return compiled_; }

private:
  // run() of a routing in one block (plan.one_block): moe_one_block_e*.
  void one_block(CUdeviceptr probs, RoutingPlan &plan, const Stream &stream, bool softmax, CUdeviceptr gate,
                 bool renormalize, NonFiniteSink sink) const;
  // From plan.expert (and the gates, `gate` or plan.gate): the capacity's
  // choice if any, then the counts and the placement.
  void place(RoutingPlan &plan, const Stream &stream, CUdeviceptr gate) const;
  // The offsets, tiles and placement of every pair from plan.expert (or
  // plan.placed) and plan.chunk_counts, both filled.
  void scan_scatter(RoutingPlan &plan, const Stream &stream) const;
  // plan.chunk_counts from plan.expert.
  void histogram(RoutingPlan &plan, const Stream &stream) const;

  CompileResult compiled_;
  Module module_;
  std::array<Kernel, 4> topk_;      // by bound on E: 32, 64, 128, 256
  std::array<Kernel, 4> one_block_; // likewise: moe_one_block_e32 .. _e256
  Kernel histogram_, scan_scatter_, grouped_, capacity_keep_;
};

} // namespace moeforge::cuda
