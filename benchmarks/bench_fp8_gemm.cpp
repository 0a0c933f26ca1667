// The FP8 building blocks (backends/cuda/runtime/fp8_kernels.h) against
// cuBLAS in bf16 on the same expert-batched GEMMs: an MoE layer's forward
// products with every expert given T k / E rows (no routing), and one dense
// square GEMM. Per shape and product, at the card's steady state
// (time_ms_steady: 1 s of the same work first):
//
//   fp8_gemm/<shape>/<product>   bf16_ms  fp8_ms  fp8_over_bf16  fp8_TFLOPs  bf16_TFLOPs
//                                quant_rows_ms  quant_weight_ms  sm_mhz_fp8  sm_mhz_bf16
//                                routed_ms  routed_over_bf16
//
// routed_ms: an MoE product's routed form (uniform routing; h's rows gathered
// from the tokens', o's in the padded order), against the same bf16 time.
// fp8_ms is the GEMM alone over operands already rounded; quant_rows_ms the
// rounding of its activation operand (the pass issue 55 is to fuse into the
// producer), quant_weight_ms of its weight (both layouts, once a step in
// training). Inputs: random bf16 in [-1, 1). What issue 55 asks of the
// layer (1.4x the bf16 step) needs the GEMM at about 0.6 of bf16's time.
#include <benchmark/benchmark.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/runtime/cublas_gemm.h"
#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/fp8_kernels.h"
#include "benchmarks/dense_roof.h"
#include "benchmarks/moe_shapes.h"
#include "runtime/routing_host.h"
#include "runtime/tensor.h"

using namespace moeforge;

namespace {

// batch products of rows x K times K x N.
struct Product {
  std::string name;
  int64_t batch, rows, K, N;
  int64_t tokens = 0, k = 0; // an MoE product's routing (0: a dense product)
  double flops() const { return 2.0 * double(batch) * double(rows) * double(K) * double(N); }
};

std::vector<Product> products() {
  std::vector<Product> out;
  for (const bench::MoeShape &s : bench::kMoeShapes) {
    const int64_t rows = s.tokens * s.k / s.experts;
    out.push_back({std::string(s.name) + "/h", s.experts, rows, s.d, (s.swiglu ? 2 : 1) * s.f, s.tokens, s.k});
    out.push_back({std::string(s.name) + "/o", s.experts, rows, s.f, s.d, s.tokens, s.k});
  }
  for (const bench::MoeShape &s : bench::kExtraTrainShapes) {
    const int64_t rows = s.tokens * s.k / s.experts;
    out.push_back({std::string(s.name) + "/h", s.experts, rows, s.d, (s.swiglu ? 2 : 1) * s.f, s.tokens, s.k});
    out.push_back({std::string(s.name) + "/o", s.experts, rows, s.f, s.d, s.tokens, s.k});
  }
  out.push_back({"dense/8192", 1, 8192, 8192, 8192});
  return out;
}

cuda::DeviceBuffer random_bf16(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  // A repeated pattern (bench::pattern_values) keeps the host's work small.
  const int64_t distinct = std::min(n, bench::pattern_values());
  std::vector<uint16_t> pattern(static_cast<size_t>(distinct));
  for (uint16_t &v : pattern)
    v = bf16_bits(u(rng));
  std::vector<uint16_t> host(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    host[static_cast<size_t>(i)] = pattern[static_cast<size_t>(i % distinct)];
  return cuda::DeviceBuffer::from(host);
}

struct Context {
  std::unique_ptr<cuda::Device> device;
  std::unique_ptr<cuda::Stream> stream;
  std::unique_ptr<cuda::CublasHandle> cublas;
  std::unique_ptr<cuda::Fp8Kernels> fp8;
  std::unique_ptr<cuda::ClockSampler> clocks;
};
Context &context() {
  static Context c = [] {
    Context c;
    c.device = std::make_unique<cuda::Device>();
    c.stream = std::make_unique<cuda::Stream>();
    c.cublas = std::make_unique<cuda::CublasHandle>();
    c.fp8 = std::make_unique<cuda::Fp8Kernels>(c.device->arch_specific());
    std::string why;
    c.clocks = cuda::ClockSampler::open(c.device->pci_bus_id(), &why);
    return c;
  }();
  return c;
}

void BM_fp8_gemm(benchmark::State &state, Product p) {
  if (!cuda::gpu_available()) {
    state.SkipWithError("no GPU");
    return;
  }
  Context &c = context();
  const int64_t M = p.batch * p.rows;
  cuda::DeviceBuffer x = random_bf16(M * p.K, 1), w = random_bf16(p.batch * p.K * p.N, 2);
  cuda::DeviceBuffer y(static_cast<size_t>(M * p.N) * 2);
  cuda::DeviceBuffer qx(static_cast<size_t>(cuda::fp8_operand_bytes(M, p.K))),
      sx(static_cast<size_t>(M * cuda::fp8_blocks(p.K)) * 4);
  cuda::DeviceBuffer qw_t(static_cast<size_t>(p.batch * cuda::fp8_operand_bytes(p.N, p.K))),
      sw(static_cast<size_t>(p.batch * cuda::fp8_blocks(p.K) * cuda::fp8_blocks(p.N)) * 4);
  const cuda::Stream &s = *c.stream;
  auto bf16 = [&] { cuda::gemm_nn_batched(*c.cublas, s, p.batch, p.rows, p.N, p.K, x.ptr(), w.ptr(), y.ptr()); };
  auto quant_rows = [&] { c.fp8->quantize_rows(x.ptr(), p.K, 0, M, p.K, qx.ptr(), sx.ptr(), s); };
  auto quant_weight = [&] { c.fp8->quantize_weight(w.ptr(), p.batch, p.K, p.N, 0, qw_t.ptr(), sw.ptr(), s); };
  const cuda::Fp8Operand a{qx.ptr(), sx.ptr(), cuda::fp8_operand_bytes(p.rows, p.K)},
      b{qw_t.ptr(), sw.ptr(), cuda::fp8_operand_bytes(p.N, p.K)};
  auto fp8 = [&] {
    c.fp8->gemm(a, b, true, y.ptr(), cuda::Fp8Kernels::Out::bf16, p.rows * p.N, p.N, p.rows, p.N, p.K, p.batch, s);
  };
  quant_rows();
  quant_weight();
  // The routed form of an MoE product (uniform routing, each token's k
  // experts distinct at random): h's rows gathered from the T tokens' rows,
  // o's in the padded order; the same weights.
  std::unique_ptr<cuda::DeviceBuffer> ra, rqa, rsa, ry, t_expert, t_start, t_rows, t_num, t_pair;
  cuda::Fp8Kernels::RouteTables route;
  if (p.tokens > 0) {
    const RoutingShape rs{p.tokens, static_cast<int>(p.batch), static_cast<int>(p.k), 128};
    std::mt19937 rng(3);
    std::vector<int32_t> order(static_cast<size_t>(p.batch)), expert;
    for (size_t e = 0; e < order.size(); ++e)
      order[e] = static_cast<int32_t>(e);
    for (int64_t t = 0; t < p.tokens; ++t)
      for (int64_t j = 0; j < p.k; ++j) {
        std::uniform_int_distribution<int64_t> pick(j, p.batch - 1);
        std::swap(order[static_cast<size_t>(j)], order[static_cast<size_t>(pick(rng))]);
        expert.push_back(order[static_cast<size_t>(j)]);
      }
    const RoutingTables tables = route_on_host(rs, expert);
    const bool gathered = p.name.size() > 2 && p.name.compare(p.name.size() - 2, 2, "/h") == 0;
    const int64_t a_rows = gathered ? p.tokens : rs.max_padded_rows();
    ra = std::make_unique<cuda::DeviceBuffer>(random_bf16(a_rows * p.K, 4));
    rqa = std::make_unique<cuda::DeviceBuffer>(static_cast<size_t>(cuda::fp8_operand_bytes(a_rows, p.K)));
    rsa = std::make_unique<cuda::DeviceBuffer>(static_cast<size_t>(a_rows * cuda::fp8_blocks(p.K)) * 4);
    ry = std::make_unique<cuda::DeviceBuffer>(static_cast<size_t>(rs.max_padded_rows() * p.N) * 2);
    c.fp8->quantize_rows(ra->ptr(), p.K, 0, a_rows, p.K, rqa->ptr(), rsa->ptr(), s);
    t_expert = std::make_unique<cuda::DeviceBuffer>(cuda::DeviceBuffer::from(tables.tile_expert));
    t_start = std::make_unique<cuda::DeviceBuffer>(cuda::DeviceBuffer::from(tables.tile_row_start));
    t_rows = std::make_unique<cuda::DeviceBuffer>(cuda::DeviceBuffer::from(tables.tile_rows));
    t_num = std::make_unique<cuda::DeviceBuffer>(cuda::DeviceBuffer::from(std::vector<int32_t>{tables.num_tiles}));
    t_pair = std::make_unique<cuda::DeviceBuffer>(cuda::DeviceBuffer::from(tables.sorted_pair));
    route.tile_expert = t_expert->ptr();
    route.tile_row_start = t_start->ptr();
    route.tile_rows = t_rows->ptr();
    route.num_tiles = t_num->ptr();
    route.a_rows = gathered ? t_pair->ptr() : 0;
    route.a_row_div = static_cast<int>(p.k);
    route.max_tiles = rs.max_tiles();
  }
  auto routed = [&] {
    c.fp8->gemm_routed({rqa->ptr(), rsa->ptr(), 0}, b, true, route, ry->ptr(), cuda::Fp8Kernels::Out::bf16, p.N, p.N,
                       p.K, s);
  };
  for (auto _ : state) {
    cuda::ClockReading r_bf16, r_fp8;
    const double bf16_ms =
        bench::time_ms_steady(s, bench::time_ms(s, 3, bf16), 1000, 300, bf16, c.clocks.get(), &r_bf16);
    const double fp8_ms = bench::time_ms_steady(s, bench::time_ms(s, 3, fp8), 1000, 300, fp8, c.clocks.get(), &r_fp8);
    const double rows_ms = bench::time_ms(s, 20, quant_rows), weight_ms = bench::time_ms(s, 20, quant_weight);
    state.SetIterationTime(fp8_ms * 1e-3);
    state.counters["bf16_ms"] = bf16_ms;
    state.counters["fp8_ms"] = fp8_ms;
    state.counters["fp8_over_bf16"] = fp8_ms / bf16_ms;
    state.counters["fp8_TFLOPs"] = p.flops() / (fp8_ms * 1e-3) / 1e12;
    state.counters["bf16_TFLOPs"] = p.flops() / (bf16_ms * 1e-3) / 1e12;
    state.counters["quant_rows_ms"] = rows_ms;
    state.counters["quant_weight_ms"] = weight_ms;
    state.counters["sm_mhz_fp8"] = r_fp8.sm_mhz;
    state.counters["sm_mhz_bf16"] = r_bf16.sm_mhz;
    if (p.tokens > 0) {
      const double routed_ms =
          bench::time_ms_steady(s, bench::time_ms(s, 3, routed), 1000, 300, routed, nullptr, nullptr);
      state.counters["routed_ms"] = routed_ms;
      state.counters["routed_over_bf16"] = routed_ms / bf16_ms;
    }
  }
}

} // namespace

int main(int argc, char **argv) {
  for (const Product &p : products())
    benchmark::RegisterBenchmark(("fp8_gemm/" + p.name).c_str(), BM_fp8_gemm, p)
        ->UseManualTime()
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
}
