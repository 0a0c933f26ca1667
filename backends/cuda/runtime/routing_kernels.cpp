#include "backends/cuda/runtime/routing_kernels.h"

#include "backends/cuda/device/routing_kernels_cuh.h"
#include "backends/cuda/device/tiles/grid_dependency_cuh.h"
#include "dsl/error.h"

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdlib>
#include <string>

namespace moeforge::cuda {

namespace {
// The top-k kernels (MF_TOPK_KERNEL in device/routing_kernels.cuh): each routes
// rows of up to 32 * cols experts with `group` lanes per token, so a lane
// holds 32 / group * cols probabilities and a block routes
// kRoutingTopkThreads / group tokens at a time: 16 per lane amortise the group's
// shuffles; above 128 experts, a warp per token (8 per lane) spreads the
// long argmax rounds of large rows over more warps.
struct TopkKernel {
  const char *name;
  int cols, group;
};
constexpr TopkKernel kTopkKernels[] = {
    {"moe_topk_e32", 1, 4}, {"moe_topk_e64", 2, 4}, {"moe_topk_e128", 4, 8}, {"moe_topk_e256", 8, 32}};
constexpr int kTopkKernelCount = sizeof(kTopkKernels) / sizeof(kTopkKernels[0]);

int topk_index(int experts) {
  int i = 0;
  while (i + 1 < kTopkKernelCount && 32 * kTopkKernels[i].cols < experts)
    ++i;
  return i;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// What the placing kernels write, one argument of both (mf::PlacedTables in
// device/routing_kernels.cuh, the same layout: three ints, then the nine
// tables' addresses from byte 16).
struct PlacedTablesArg {
  int block, max_tiles, max_padded_rows;
  CUdeviceptr counts, offsets, offsets_unpadded, num_tiles, tile_expert, tile_row_start, tile_rows, pair_pos,
      sorted_pair;
};
static_assert(sizeof(PlacedTablesArg) == 16 + 9 * 8 && offsetof(PlacedTablesArg, counts) == 16,
              "mf::PlacedTables' layout on the device");

PlacedTablesArg placed_tables(const RoutingPlan &plan) {
  const RoutingShape &s = plan.shape;
  return {s.block,
          static_cast<int>(s.max_tiles()),
          static_cast<int>(s.max_padded_rows()),
          plan.counts.ptr(),
          plan.offsets.ptr(),
          plan.offsets_unpadded.ptr(),
          plan.num_tiles.ptr(),
          plan.tile_expert.ptr(),
          plan.tile_row_start.ptr(),
          plan.tile_rows.ptr(),
          plan.pair_pos.ptr(),
          plan.sorted_pair.ptr()};
}

// The one-block kernel of the same bound on E: moe_one_block_e128 for moe_topk_e128.
std::string one_block_name(const TopkKernel &k) {
  return "moe_one_block_" + std::string(k.name).substr(std::string("moe_topk_").size());
}

bool one_block_routing_off() {
  static const bool off = [] {
    const char *v = std::getenv("MOEFORGE_NO_ONE_BLOCK_ROUTING");
    return v != nullptr && std::string(v) == "1";
  }();
  return off;
}
} // namespace

const std::vector<std::string> &routing_kernel_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const TopkKernel &k : kTopkKernels)
      n.push_back(k.name);
    n.push_back("moe_chunk_histogram");
    n.push_back("moe_scan_scatter");
    n.push_back("moe_capacity_keep");
    for (const TopkKernel &k : kTopkKernels)
      n.push_back(one_block_name(k));
    return n;
  }();
  return names;
}

const std::string &routing_topk_kernel(int experts) { return routing_kernel_names().at(topk_index(experts)); }

int64_t routing_max_chunks(int experts) {
  return std::clamp<int64_t>(kRoutingMaxChunkCounts / experts, 1, kRoutingTargetChunks);
}

int64_t routing_chunk_pairs(const RoutingShape &shape) {
  shape.check();
  const int64_t target = routing_max_chunks(shape.experts);
  return std::max<int64_t>(1, ceil_div(ceil_div(shape.pairs(), target), kRoutingChunkQuantum)) * kRoutingChunkQuantum;
}

int64_t routing_topk_tokens_per_pass(int experts) {
  return kRoutingTopkThreads / kTopkKernels[topk_index(experts)].group;
}

bool routing_fuses_counts(const RoutingShape &shape) {
  const int64_t chunk = routing_chunk_pairs(shape), k = shape.k;
  // The most tokens a chunk's pairs belong to: two more when k does not
  // divide the chunk, for the tokens straddling its ends.
  const int64_t tokens = chunk / k + (chunk % k ? 2 : 0);
  const int64_t passes = ceil_div(tokens, routing_topk_tokens_per_pass(shape.experts));
  return passes == 1 || passes * k <= kRoutingFusedRounds;
}

namespace {
bool fits_one_block(const RoutingShape &shape) {
  return !shape.drops() && shape.groups <= 1 && shape.tokens <= kRoutingOneBlockTokens &&
         shape.pairs() <= kRoutingOneBlockPairs;
}
} // namespace

bool routing_in_one_block(const RoutingShape &shape) { return fits_one_block(shape) && !one_block_routing_off(); }

const char *routing_kernels_source() {
  static const std::string source = [] {
    // The tile library's grid_dependency part first: every kernel's first
    // statement is its wait (the runtime launches these early, as the
    // generated kernels).
    std::string s = std::string(tile_parts::grid_dependency::kSource) + kRoutingKernelsSource;
    for (const TopkKernel &k : kTopkKernels) {
      const std::string params = ", " + std::to_string(k.group) + ", " + std::to_string(k.cols) + ")\n";
      s += "MF_TOPK_KERNEL(" + std::string(k.name) + params;
      // A warp per token (route_one_block): 32 lanes, E / 32 scores a lane.
      s += "MF_ONE_BLOCK_KERNEL(" + one_block_name(k) + ", 32, " + std::to_string(k.cols) + ")\n";
    }
    return s;
  }();
  return source.c_str();
}

CompileOptions routing_compile_options(const std::string &arch) {
  CompileOptions o;
  o.arch = arch;
  o.extra_options = {"-DMF_THREADS=" + std::to_string(kRoutingThreads),
                     "-DMF_TOPK_THREADS=" + std::to_string(kRoutingTopkThreads),
                     "-DMF_MAX_EXPERTS=" + std::to_string(kMaxRoutingExperts),
                     "-DMF_CAPACITY_THREADS=" + std::to_string(kCapacityThreads),
                     "-DMF_ONE_BLOCK_PAIRS=" + std::to_string(kRoutingOneBlockPairs)};
  return o;
}

CompileResult compile_routing_kernels(const std::string &arch) {
  return compile_cuda(routing_kernels_source(), "routing_kernels.cu", routing_compile_options(arch));
}

namespace {
size_t i32(int64_t n) { return static_cast<size_t>(n) * sizeof(int32_t); }
// Ints per row of chunk_counts: as count_stride() in device/routing_kernels.cuh.
int64_t count_stride(int experts) {
  int64_t stride = 32;
  while (stride < experts)
    stride *= 2;
  return stride;
}
} // namespace

void RoutingPlan::set_shape(const RoutingShape &s) {
  s.check();
  shape = s;
  chunk = routing_chunk_pairs(s);
  chunks = ceil_div(s.pairs(), chunk);
  internal_check(chunks <= routing_max_chunks(s.experts)) << "routing " << s.to_string() << ": " << chunks << " chunks";
  fused = routing_fuses_counts(s) && !s.drops();
  topk_chunk = fused ? chunk : routing_topk_tokens_per_pass(s.experts) * s.k;
  one_block = routing_in_one_block(s);
}

std::vector<std::pair<DeviceBuffer *, size_t>> RoutingPlan::arrays() {
  const RoutingShape &s = shape;
  return {{&expert, i32(s.pairs())},
          {&gate, i32(s.pairs())},
          {&counts, i32(s.experts)},
          {&offsets, i32(s.experts + 1)},
          {&offsets_unpadded, i32(s.experts + 1)},
          {&pair_pos, i32(s.pairs())},
          {&sorted_pair, i32(s.max_padded_rows())},
          {&tile_expert, i32(s.max_tiles())},
          {&tile_row_start, i32(s.max_tiles())},
          {&tile_rows, i32(s.max_tiles())},
          {&num_tiles, i32(1)},
          {&chunk_counts, i32(routing_max_chunks(s.experts) * count_stride(s.experts))},
          {&placed, i32(s.drops() ? s.pairs() : 0)}};
}

RoutingPlan::RoutingPlan(const RoutingShape &s) {
  set_shape(s);
  for (auto [buffer, bytes] : arrays())
    *buffer = DeviceBuffer(bytes);
}

RoutingPlan RoutingPlan::unplaced(const RoutingShape &s) {
  RoutingPlan plan;
  plan.resize(s);
  return plan;
}

namespace {
constexpr size_t kTableAlignment = 256;
size_t align_up(size_t n) { return (n + kTableAlignment - 1) / kTableAlignment * kTableAlignment; }
} // namespace

size_t RoutingPlan::table_bytes(const RoutingShape &s) {
  RoutingPlan sizes;
  sizes.set_shape(s);
  size_t total = 0;
  for (auto [buffer, bytes] : sizes.arrays())
    total += align_up(bytes);
  return total;
}

std::optional<SizeTerms> RoutingPlan::table_terms(const RoutingShape &s) {
  if (s.drops())
    return std::nullopt;
  // arrays()' order and counts, each array aligned as place() puts them.
  const SizeFactor pairs = SizeFactor::tokens(s.k), padded = SizeFactor::padded_rows(s.k, s.block, s.experts);
  const SizeFactor tiles = SizeFactor::tiles(s.k, s.block, s.experts);
  const std::vector<SizeFactor> counts = {pairs,
                                          pairs,
                                          SizeFactor::constant(s.experts),
                                          SizeFactor::constant(s.experts + 1),
                                          SizeFactor::constant(s.experts + 1),
                                          pairs,
                                          padded,
                                          tiles,
                                          tiles,
                                          tiles,
                                          SizeFactor::constant(1),
                                          SizeFactor::constant(routing_max_chunks(s.experts) * count_stride(s.experts)),
                                          SizeFactor::constant(0)};
  SizeTerms terms;
  for (const SizeFactor &n : counts)
    terms.push_back({{{static_cast<int64_t>(sizeof(int32_t)), {n}}}, static_cast<int64_t>(kTableAlignment)});
  return terms;
}

void RoutingPlan::resize(const RoutingShape &s) {
  set_shape(s);
  place(0);
}

void RoutingPlan::place(CUdeviceptr tables) {
  size_t at = 0;
  for (auto [buffer, bytes] : arrays()) {
    internal_check(buffer->ptr() == 0 || !buffer->owned()) << "a routing plan with tables of its own placed elsewhere";
    *buffer = DeviceBuffer::view(tables ? tables + at : 0, bytes);
    at += align_up(bytes);
  }
}

void RoutingPlan::reshape(const RoutingShape &s) {
  internal_check(s.experts == shape.experts && s.k == shape.k && !s.drops() && !shape.drops())
      << "a routing plan reshaped to other experts, k or capacity";
  auto fits = [](const DeviceBuffer &b, int64_t n) { return static_cast<int64_t>(b.bytes() / 4) >= n; };
  internal_check(fits(expert, s.pairs()) && fits(sorted_pair, s.max_padded_rows()) && fits(tile_expert, s.max_tiles()))
      << "a routing plan reshaped to more pairs than it holds";
  set_shape(s);
  if (!fits(chunk_counts, routing_max_chunks(s.experts) * count_stride(s.experts)))
    chunk_counts = DeviceBuffer(i32(routing_max_chunks(s.experts) * count_stride(s.experts)));
}

void RoutingPlan::poison(uint32_t pattern, bool including_expert) {
  for (DeviceBuffer *b : {&gate, &counts, &offsets, &offsets_unpadded, &pair_pos, &sorted_pair, &tile_expert,
                          &tile_row_start, &tile_rows, &num_tiles, &chunk_counts})
    b->fill32(pattern);
  if (including_expert)
    expert.fill32(pattern);
}

RoutingTables RoutingPlan::download() const {
  RoutingTables t;
  t.expert = expert.download<int32_t>();
  t.counts = counts.download<int32_t>();
  t.offsets = offsets.download<int32_t>();
  t.offsets_unpadded = offsets_unpadded.download<int32_t>();
  t.pair_pos = pair_pos.download<int32_t>();
  t.sorted_pair = sorted_pair.download<int32_t>();
  t.tile_expert = tile_expert.download<int32_t>();
  t.tile_row_start = tile_row_start.download<int32_t>();
  t.tile_rows = tile_rows.download<int32_t>();
  t.num_tiles = num_tiles.download<int32_t>()[0];
  return t;
}

std::vector<float> RoutingPlan::download_gate() const { return gate.download<float>(); }

DeviceRouting::DeviceRouting(const std::string &arch) : compiled_(compile_routing_kernels(arch)) {
  module_ = Module(compiled_.cubin, "routing_kernels");
  // Every routing kernel starts with its wait (device/routing_kernels.cuh).
  for (int i = 0; i < kTopkKernelCount; ++i) {
    topk_[i] = module_.kernel(kTopkKernels[i].name).launch_early();
    one_block_[i] = module_.kernel(one_block_name(kTopkKernels[i])).launch_early();
  }
  histogram_ = module_.kernel("moe_chunk_histogram").launch_early();
  grouped_ = module_.kernel("moe_topk_grouped").launch_early();
  scan_scatter_ = module_.kernel("moe_scan_scatter").launch_early();
  capacity_keep_ = module_.kernel("moe_capacity_keep").launch_early();
}

// Each args[] lists the kernel's parameters in the order of its signature in
// device/routing_kernels.cuh; all launches share `stream`, which orders them.
void DeviceRouting::run(CUdeviceptr probs, RoutingPlan &plan, const Stream &stream, bool softmax, CUdeviceptr gate,
                        bool renormalize, NonFiniteSink sink) const {
  unsigned long long route_tag = sink.route_tag;
  const RoutingShape &s = plan.shape;
  internal_check(!renormalize || (gate && !s.drops()))
      << "renormalised gates go to a gate tensor, and only without a capacity (lower.h, gate_from_routing)";
  if (s.groups > 1) {
    // Group-limited: its own top-k kernel, then the counts from the experts.
    internal_check(!softmax) << "group-limited routing takes scores; lowering leaves the softmax as a step";
    internal_check(!renormalize) << "group-limited routing does not renormalise; lowering leaves it as steps";
    if (s.pairs() > 0) {
      int tokens = static_cast<int>(s.tokens), experts = s.experts, k = s.k, groups = s.groups,
          top_groups = s.top_groups;
      void *gate_arg = gate ? static_cast<void *>(&gate) : plan.gate.arg();
      void *args[] = {&probs,   &tokens,         &experts,   &k,        &groups, &top_groups, plan.expert.arg(),
                      gate_arg, &sink.first_bad, &sink.seen, &route_tag};
      grouped_.launch({static_cast<unsigned>(ceil_div(s.tokens, kRoutingThreads))}, {kRoutingThreads}, 0, stream, args);
    }
    place(plan, stream, gate);
    return;
  }
  if (plan.one_block) {
    one_block(probs, plan, stream, softmax, gate, renormalize, sink);
    return;
  }
  if (s.pairs() > 0) {
    int tokens = static_cast<int>(s.tokens), experts = s.experts, k = s.k, apply_softmax = softmax ? 1 : 0;
    int divide = renormalize ? 1 : 0, chunk = static_cast<int>(plan.topk_chunk);
    CUdeviceptr no_counts = 0;
    void *gate_arg = gate ? static_cast<void *>(&gate) : plan.gate.arg();
    void *counts_arg = plan.fused ? plan.chunk_counts.arg() : static_cast<void *>(&no_counts);
    void *args[] = {&probs,          &tokens,    &experts,          &k,       &apply_softmax,
                    &divide,         &chunk,     plan.expert.arg(), gate_arg, counts_arg,
                    &sink.first_bad, &sink.seen, &route_tag};
    const unsigned blocks = static_cast<unsigned>(ceil_div(s.pairs(), plan.topk_chunk));
    topk_[topk_index(s.experts)].launch({blocks}, {kRoutingTopkThreads}, 0, stream, args);
  }
  if (plan.fused) {
    scan_scatter(plan, stream);
    return;
  }
  place(plan, stream, gate);
}

void DeviceRouting::one_block(CUdeviceptr probs, RoutingPlan &plan, const Stream &stream, bool softmax,
                              CUdeviceptr gate, bool renormalize, NonFiniteSink sink) const {
  const RoutingShape &s = plan.shape;
  internal_check(fits_one_block(s)) << "routing " << s.to_string() << " does not fit one block";
  int tokens = static_cast<int>(s.tokens), experts = s.experts, k = s.k, apply_softmax = softmax ? 1 : 0;
  int divide = renormalize ? 1 : 0;
  unsigned long long route_tag = sink.route_tag;
  void *gate_arg = gate ? static_cast<void *>(&gate) : plan.gate.arg();
  PlacedTablesArg out = placed_tables(plan);
  void *args[] = {&probs,   &tokens, &experts,        &k,         &apply_softmax, &divide, plan.expert.arg(),
                  gate_arg, &out,    &sink.first_bad, &sink.seen, &route_tag};
  one_block_[topk_index(s.experts)].launch({1}, {kRoutingTopkThreads}, 0, stream, args);
}

void DeviceRouting::run_from_experts(RoutingPlan &plan, const Stream &stream) const { place(plan, stream, 0); }

void DeviceRouting::place(RoutingPlan &plan, const Stream &stream, CUdeviceptr gate) const {
  const RoutingShape &s = plan.shape;
  if (s.drops() && s.pairs() > 0) {
    internal_check(s.capacity <= INT_MAX) << "capacity " << s.capacity << " past int32";
    int tokens = static_cast<int>(s.tokens), k = s.k, capacity = static_cast<int>(s.capacity);
    int by_score = s.priority == KeepPriority::score ? 1 : 0;
    CUdeviceptr score = gate ? gate : plan.gate.ptr();
    void *args[] = {plan.expert.arg(), &score, &tokens, &k, &capacity, &by_score, plan.placed.arg()};
    capacity_keep_.launch({static_cast<unsigned>(s.experts)}, {kCapacityThreads}, 0, stream, args);
  }
  histogram(plan, stream);
  scan_scatter(plan, stream);
}

void DeviceRouting::histogram(RoutingPlan &plan, const Stream &stream) const {
  if (plan.chunks == 0)
    return;
  int pairs = static_cast<int>(plan.shape.pairs()), experts = plan.shape.experts;
  int chunk = static_cast<int>(plan.chunk);
  void *ids = plan.shape.drops() ? plan.placed.arg() : plan.expert.arg();
  void *args[] = {ids, &pairs, &experts, &chunk, plan.chunk_counts.arg()};
  histogram_.launch({static_cast<unsigned>(plan.chunks)}, {kRoutingThreads}, 0, stream, args);
}

void DeviceRouting::scan_scatter(RoutingPlan &plan, const Stream &stream) const {
  const RoutingShape &s = plan.shape;
  int pairs = static_cast<int>(s.pairs()), experts = s.experts;
  int chunk = static_cast<int>(plan.chunk), chunks = static_cast<int>(plan.chunks);
  PlacedTablesArg out = placed_tables(plan);
  void *args[] = {plan.shape.drops() ? plan.placed.arg() : plan.expert.arg(),
                  plan.chunk_counts.arg(),
                  &pairs,
                  &experts,
                  &chunk,
                  &chunks,
                  &out};
  // At least one block: with no pairs it still writes the offsets, the
  // empty tile table and the padding rows.
  const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, plan.chunks));
  scan_scatter_.launch({blocks}, {kRoutingThreads}, 0, stream, args);
}

} // namespace moeforge::cuda
