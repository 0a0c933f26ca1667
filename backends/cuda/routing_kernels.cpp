#include "backends/cuda/routing_kernels.h"

#include "backends/cuda/routing_kernels_source.h"
#include "dsl/error.h"

namespace moeforge::cuda {

const std::vector<std::string> &routing_kernel_names() {
  static const std::vector<std::string> names = {"moe_topk", "moe_chunk_histogram", "moe_scan_offsets",
                                                 "moe_stable_scatter"};
  return names;
}

const char *routing_kernels_source() { return kRoutingKernelsSource; }

CompileOptions routing_compile_options(const std::string &arch) {
  CompileOptions o;
  o.arch = arch;
  o.extra_options = {"-DMF_THREADS=" + std::to_string(kRoutingThreads), "-DMF_CHUNK=" + std::to_string(kRoutingChunk),
                     "-DMF_MAX_EXPERTS=" + std::to_string(kMaxRoutingExperts)};
  return o;
}

CompileResult compile_routing_kernels(const std::string &arch) {
  return compile_cuda(routing_kernels_source(), "routing_kernels.cu", routing_compile_options(arch));
}

namespace {
size_t i32(int64_t n) { return static_cast<size_t>(n) * sizeof(int32_t); }
unsigned blocks_for(int64_t items, int64_t per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}
} // namespace

RoutingPlan::RoutingPlan(const RoutingShape &s)
    : shape((s.check(), s)), chunks((s.pairs() + kRoutingChunk - 1) / kRoutingChunk), expert(i32(s.pairs())),
      gate(i32(s.pairs())), counts(i32(s.experts)), offsets(i32(s.experts + 1)), offsets_unpadded(i32(s.experts + 1)),
      pair_pos(i32(s.pairs())), sorted_pair(i32(s.max_padded_rows())), tile_expert(i32(s.max_tiles())),
      tile_row_start(i32(s.max_tiles())), tile_rows(i32(s.max_tiles())), num_tiles(i32(1)),
      chunk_counts(i32(chunks * s.experts)), chunk_base(i32(chunks * s.experts)) {}

void RoutingPlan::poison(uint32_t pattern, bool including_expert) {
  for (DeviceBuffer *b : {&gate, &counts, &offsets, &offsets_unpadded, &pair_pos, &sorted_pair, &tile_expert,
                          &tile_row_start, &tile_rows, &num_tiles, &chunk_counts, &chunk_base})
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
  topk_ = module_.kernel("moe_topk");
  histogram_ = module_.kernel("moe_chunk_histogram");
  scan_ = module_.kernel("moe_scan_offsets");
  scatter_ = module_.kernel("moe_stable_scatter");
}

void DeviceRouting::run(CUdeviceptr probs, RoutingPlan &plan, const Stream &stream, bool softmax,
                        CUdeviceptr gate) const {
  const RoutingShape &s = plan.shape;
  if (s.tokens > 0) {
    int tokens = static_cast<int>(s.tokens), experts = s.experts, k = s.k, apply_softmax = softmax ? 1 : 0;
    void *gate_arg = gate ? static_cast<void *>(&gate) : plan.gate.arg();
    void *args[] = {&probs, &tokens, &experts, &k, &apply_softmax, plan.expert.arg(), gate_arg};
    topk_.launch({blocks_for(s.tokens, kRoutingThreads / 32)}, {kRoutingThreads}, 0, stream, args);
  }
  run_from_experts(plan, stream);
}

// Each args[] lists the kernel's parameters in the order of its signature in
// routing_kernels_source.h; all launches share `stream`, which orders them.
void DeviceRouting::run_from_experts(RoutingPlan &plan, const Stream &stream) const {
  const RoutingShape &s = plan.shape;
  int pairs = static_cast<int>(s.pairs()), experts = s.experts, block = s.block;
  int chunks = static_cast<int>(plan.chunks), max_tiles = static_cast<int>(s.max_tiles());
  int max_padded_rows = static_cast<int>(s.max_padded_rows());
  if (chunks > 0) {
    void *args[] = {plan.expert.arg(), &pairs, &experts, plan.chunk_counts.arg()};
    histogram_.launch({static_cast<unsigned>(chunks)}, {kRoutingThreads}, 0, stream, args);
  }
  {
    // Also the tile table and sorted_pair's padding rows (-1); the scatter
    // then writes every real row.
    void *args[] = {plan.chunk_counts.arg(),
                    &chunks,
                    &experts,
                    &block,
                    &max_tiles,
                    &max_padded_rows,
                    plan.chunk_base.arg(),
                    plan.counts.arg(),
                    plan.offsets.arg(),
                    plan.offsets_unpadded.arg(),
                    plan.num_tiles.arg(),
                    plan.tile_expert.arg(),
                    plan.tile_row_start.arg(),
                    plan.tile_rows.arg(),
                    plan.sorted_pair.arg()};
    scan_.launch({1}, {kRoutingThreads}, 0, stream, args);
  }
  if (chunks > 0) {
    void *args[] = {
        plan.expert.arg(),     &pairs, &experts, plan.chunk_base.arg(), plan.offsets.arg(), plan.pair_pos.arg(),
        plan.sorted_pair.arg()};
    scatter_.launch({static_cast<unsigned>(chunks)}, {kRoutingThreads}, 0, stream, args);
  }
}

} // namespace moeforge::cuda
