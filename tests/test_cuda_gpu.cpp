// GPU tests: the driver wrappers, the device routing against its host oracle
// (with outputs poisoned first, and replayed from a CUDA graph), and cuBLAS
// against a CPU loop. Without a GPU every case skips, saying why.
#include <doctest/doctest.h>

#include "runtime/tensor.h"

#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/codegen/nvrtc_compiler.h"
#include "backends/cuda/runtime/cublas_gemm.h"
#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/module.h"
#include "backends/cuda/runtime/routing_kernels.h"
#include "backends/cuda/runtime/stream.h"
#include "tests/gpu_test.h"

using namespace moeforge;
using namespace moeforge::cuda;
using moeforge::bf16_bits;
using moeforge::bf16_value;
using moeforge::UserError;

namespace {

// Softmax rows of random logits; `skew` adds a ramp over experts so low
// experts get more pairs (and high ones may get none).
std::vector<float> random_probs(const RoutingShape &s, std::mt19937 &rng, float skew) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> p(static_cast<size_t>(s.tokens * s.experts));
  for (int64_t t = 0; t < s.tokens; ++t) {
    float *row = &p[t * s.experts];
    float mx = -INFINITY, sum = 0.0f;
    for (int e = 0; e < s.experts; ++e)
      mx = std::max(mx, row[e] = n(rng) - skew * e);
    for (int e = 0; e < s.experts; ++e)
      sum += row[e] = std::exp(row[e] - mx);
    for (int e = 0; e < s.experts; ++e)
      row[e] /= sum;
  }
  return p;
}

// Element by element, naming the first mismatch.
template <typename T>
void check_equal(const std::vector<T> &got, const std::vector<T> &want, const char *name, const RoutingShape &s) {
  CAPTURE(s.to_string());
  REQUIRE_MESSAGE(got.size() == want.size(), name << ": " << got.size() << " entries, expected " << want.size());
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      FAIL_CHECK(name << "[" << i << "] = " << got[i] << ", expected " << want[i]);
      return;
    }
}

void check_tables_equal(const RoutingTables &got, const RoutingTables &want, const RoutingShape &s) {
  check_equal(got.expert, want.expert, "expert", s);
  check_equal(got.counts, want.counts, "counts", s);
  check_equal(got.offsets, want.offsets, "offsets", s);
  check_equal(got.offsets_unpadded, want.offsets_unpadded, "offsets_unpadded", s);
  check_equal(got.pair_pos, want.pair_pos, "pair_pos", s);
  check_equal(got.sorted_pair, want.sorted_pair, "sorted_pair", s);
  check_equal(got.tile_expert, want.tile_expert, "tile_expert", s);
  check_equal(got.tile_row_start, want.tile_row_start, "tile_row_start", s);
  check_equal(got.tile_rows, want.tile_rows, "tile_rows", s);
  CHECK(got.num_tiles == want.num_tiles);
}

// Routes probs on the device into tables poisoned two ways, and checks the
// tables and the gates against the host oracle (top_k_on_host, route_on_host).
void check_device_routing(const DeviceRouting &routing, const Stream &stream, const RoutingShape &s,
                          const std::vector<float> &probs) {
  HostTopK top = top_k_on_host(s, probs);
  RoutingTables want = route_on_host(s, top.expert);
  REQUIRE(verify_routing_tables(s, want).empty());
  DeviceBuffer d_probs = DeviceBuffer::from(probs);
  RoutingPlan plan(s);
  // A few tokens route in one block; the top-k and scatter kernels must
  // give them the same tables.
  const std::vector<bool> one_block = plan.one_block ? std::vector<bool>{true, false} : std::vector<bool>{false};
  for (bool one : one_block)
    for (uint32_t poison : {kPoisonOnes, kPoisonNaN}) {
      CAPTURE(one);
      plan.one_block = one;
      plan.poison(poison);
      routing.run(d_probs.ptr(), plan, stream);
      stream.synchronize();
      check_tables_equal(plan.download(), want, s);
      check_equal(plan.download_gate(), top.gate, "gate", s);
    }
}

} // namespace

TEST_SUITE("gpu") {

  TEST_CASE("cuda gpu: driver smoke - device alloc memset copies kernel and events") {
    MOEFORGE_REQUIRE_GPU();
    Device device;
    MESSAGE(device.name() << " (" << device.arch() << "), " << device.sm_count() << " SMs, "
                          << device.max_shared_memory_optin() << " B opt-in smem, " << device.l2_bytes() << " B L2");
    CHECK(device.sm_count() > 0);
    CHECK(device.cc_major() >= 7);

    std::vector<int32_t> host(1000);
    std::iota(host.begin(), host.end(), 0);
    DeviceBuffer a = DeviceBuffer::from(host);
    CHECK(a.download<int32_t>() == host);
    DeviceBuffer b(a.bytes());
    b.copy_from(a);
    CHECK(b.download<int32_t>() == host);
    b.memset(0);
    CHECK(b.download<int32_t>() == std::vector<int32_t>(1000, 0));
    b.fill32(kPoisonOnes);
    CHECK(b.download<int32_t>() == std::vector<int32_t>(1000, -1));
    DeviceBuffer empty(0);
    CHECK(empty.ptr() == 0);

    CompileOptions options;
    options.arch = device.arch(); // what this GPU runs
    CompileResult compiled = compile_cuda(R"(
extern "C" __global__ void add_one(int *x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1;
})",
                                          "add_one.cu", options);
    Module module(compiled.cubin, "add_one");
    Kernel k = module.kernel("add_one");
    KernelAttributes attrs = k.attributes();
    REQUIRE(compiled.resources_of("add_one") != nullptr);
    CHECK(attrs.registers == compiled.resources_of("add_one")->registers);
    CHECK(attrs.local_bytes == 0);
    Stream stream;
    Event start, stop;
    int n = 1000;
    void *args[] = {a.arg(), &n};
    start.record(stream);
    k.launch({(1000 + 255) / 256}, {256}, 0, stream, args);
    stop.record(stream);
    stream.synchronize();
    CHECK(elapsed_ms(start, stop) >= 0.0f);
    std::vector<int32_t> want = host;
    for (int32_t &x : want)
      ++x;
    CHECK(a.download<int32_t>() == want);

    // A missing kernel names itself and the module.
    CHECK_THROWS_WITH_AS(module.kernel("nope"), doctest::Contains("cuModuleGetFunction failed: CUDA_ERROR_NOT_FOUND"),
                         CudaError);
    // Garbage is not a cubin.
    // (NUL-terminated: the driver reads input that is not ELF as PTX text.)
    const std::string text = "this is not a cubin";
    std::vector<char> junk(text.c_str(), text.c_str() + text.size() + 1);
    CHECK_THROWS_WITH_AS(Module(junk, "junk"), doctest::Contains("cuModuleLoadData failed: CUDA_ERROR_"), CudaError);
  }

  TEST_CASE("cuda gpu: device routing matches the host oracle") {
    MOEFORGE_REQUIRE_GPU();
    Device device;
    DeviceRouting routing(device);
    Stream stream;
    std::mt19937 rng(5);
    struct Case {
      RoutingShape shape;
      float skew;
    };
    std::vector<Case> cases = {
        {{1, 8, 2, 64}, 0.0f},        // one token
        {{100, 8, 2, 64}, 0.0f},      // T not a multiple of bs
        {{1000, 64, 8, 128}, 0.0f},   // fine-grained
        {{4096, 64, 1, 128}, 3.0f},   // skewed: high experts empty
        {{3000, 16, 16, 256}, 0.0f},  // k = E
        {{5000, 256, 8, 64}, 0.5f},   // the most experts, several chunks
        {{2049, 3, 1, 64}, 50.0f},    // every token on expert 0
        {{16384, 64, 8, 128}, 0.1f},  // fine64-sized routing: 128 chunks of 1024 pairs
        {{777, 33, 5, 256}, 0.0f},    // E not a multiple of 32; tokens straddle chunks
        {{16384, 64, 1, 128}, 0.0f},  // mbpaper-sized: 128 chunks of 128 pairs
        {{8192, 8, 2, 128}, 0.0f},    // mixtral-sized
        {{999, 128, 3, 64}, 0.2f},    // moe_topk_e128; the chunk does not divide P
        {{700, 256, 256, 64}, 0.0f},  // k = E = 256
        {{2000, 32, 32, 128}, 0.0f},  // k = E = 32, the largest E of moe_topk_e32
        {{3000, 1, 1, 128}, 0.0f},    // one expert, many chunks
        {{1, 1, 1, 64}, 0.0f},        // one pair
        {{100000, 16, 4, 128}, 0.0f}, // chunks of 3200 pairs: many steps per warp
        {{0, 8, 2, 64}, 0.0f},        // no tokens: offsets, empty tiles and padding still written
    };
    for (const Case &c : cases) {
      const RoutingShape &s = c.shape;
      CAPTURE(s.to_string());
      std::vector<float> probs = random_probs(s, rng, c.skew);
      check_device_routing(routing, stream, s, probs);
    }
  }

  // Small on purpose: the sanitizers' racecheck and synccheck run it
  // (scripts/device_check.sh), for the shared memory and the named barrier
  // the one-block kernels share between their top-k and their placing.
  TEST_CASE("cuda gpu: a few tokens routed in one block match the host oracle and the two-kernel routing") {
    MOEFORGE_REQUIRE_GPU();
    Device device;
    DeviceRouting routing(device);
    Stream stream;
    std::mt19937 rng(9);
    struct Case {
      RoutingShape shape;
      float skew;
    };
    for (const Case &c : std::vector<Case>{
             {{1, 128, 8, 128}, 0.0f},    // qwen3moe, one token
             {{16, 128, 8, 128}, 2.0f},   // a warp for each of 16 tokens, skewed
             {{7, 64, 8, 128}, 0.0f},     // fine64's experts
             {{16, 8, 2, 128}, 0.0f},     // mixtral
             {{16, 256, 16, 64}, 0.0f},   // the most experts
             {{5, 33, 33, 128}, 0.0f},    // k = E, E not a multiple of 32
             {{16, 128, 128, 64}, 50.0f}, // 2048 pairs, most on one expert
             {{3, 8, 2, 100}, 0.0f},      // a block that is no multiple of 4: the padding one row a store
             {{1, 1, 1, 64}, 0.0f},       // one pair
             {{0, 8, 2, 64}, 0.0f},       // no tokens
         }) {
      CAPTURE(c.shape.to_string());
      REQUIRE(routing_in_one_block(c.shape));
      check_device_routing(routing, stream, c.shape, random_probs(c.shape, rng, c.skew));
    }
  }

  TEST_CASE("cuda gpu: group-limited device routing matches the host oracle, ties included") {
    MOEFORGE_REQUIRE_GPU();
    Device device;
    DeviceRouting routing(device);
    Stream stream;
    std::mt19937 rng(6);
    struct Case {
      RoutingShape shape;
      bool ties;
    };
    auto grouped = [](RoutingShape s, int groups, int top_groups) {
      s.groups = groups;
      s.top_groups = top_groups;
      return s;
    };
    std::vector<Case> cases = {
        {grouped({1000, 8, 2, 64}, 4, 2), false},    // deepseek_moe's default grouping
        {grouped({3000, 256, 8, 128}, 8, 4), false}, // DeepSeek-V3's: 256 experts, 8 groups, 4 kept
        {grouped({777, 64, 6, 128}, 16, 3), true},   // few distinct scores: ties between experts and groups
        {grouped({500, 6, 2, 64}, 6, 2), true},      // groups of one expert
        {grouped({1, 16, 4, 64}, 8, 2), false},      // one token
        {grouped({0, 16, 4, 64}, 8, 2), false},      // no tokens
        {grouped({20000, 32, 8, 128}, 4, 1), false}, // one group kept, many chunks
    };
    for (const Case &c : cases) {
      const RoutingShape &s = c.shape;
      CAPTURE(s.to_string());
      CAPTURE(s.groups);
      std::vector<float> probs = random_probs(s, rng, 0.0f);
      if (c.ties)
        for (float &p : probs)
          p = std::round(p * 8.0f) / 8.0f;
      check_device_routing(routing, stream, s, probs);
    }
  }

  TEST_CASE("cuda gpu: device routing from given experts - edge cases") {
    MOEFORGE_REQUIRE_GPU();
    Device device;
    DeviceRouting routing(device);
    Stream stream;
    auto run = [&](const RoutingShape &s, const std::vector<int32_t> &expert) {
      CAPTURE(s.to_string());
      RoutingPlan plan(s);
      for (uint32_t poison : {kPoisonOnes, kPoisonNaN}) {
        plan.poison(poison);
        plan.expert.upload(expert);
        routing.run_from_experts(plan, stream);
        stream.synchronize();
        check_tables_equal(plan.download(), route_on_host(s, expert), s);
      }
    };
    run({5000, 8, 1, 128}, std::vector<int32_t>(5000, 7)); // all on the last expert
    run({5000, 8, 1, 64}, std::vector<int32_t>(5000, 0));  // all on the first
    std::vector<int32_t> alternating(4099);
    for (size_t i = 0; i < alternating.size(); ++i)
      alternating[i] = i % 2 ? 5 : 1; // experts 0, 2-4, 6, 7 empty
    run({4099, 8, 1, 64}, alternating);
    run({0, 8, 2, 64}, {});                               // no tokens
    run({3000, 1, 1, 64}, std::vector<int32_t>(3000, 0)); // one expert
    std::mt19937 rng(13);
    std::vector<int32_t> clustered(200000); // runs of one expert, so chunks and warps see few experts
    for (size_t i = 0; i < clustered.size(); ++i)
      clustered[i] = static_cast<int32_t>((i / 1000 + rng() % 2) % 256);
    run({100000, 256, 2, 128}, clustered);
  }

  TEST_CASE("cuda gpu: routing replayed from a CUDA graph gives the same tables") {
    MOEFORGE_REQUIRE_GPU();
    Device device;
    DeviceRouting routing(device);
    Stream stream;
    std::mt19937 rng(9);
    // Top-k, histogram and scatter (three passes of tokens a chunk); top-k
    // counting the chunks itself (one pass: k = 1, and k = 8 as fine64's).
    for (RoutingShape s :
         {RoutingShape{3000, 256, 8, 128}, RoutingShape{16384, 64, 1, 128}, RoutingShape{16384, 64, 8, 128}}) {
      CAPTURE(s.to_string());
      CHECK(routing_fuses_counts(s) == (s.experts == 64));
      DeviceBuffer d_probs = DeviceBuffer::from(random_probs(s, rng, 0.0f));
      RoutingPlan plan(s);
      CudaGraph graph = CudaGraph::capture(stream, [&] { routing.run(d_probs.ptr(), plan, stream); });
      stream.synchronize();
      plan.poison(kPoisonNaN); // capture ran nothing; the graph must write everything
      graph.launch(stream);
      stream.synchronize();
      std::vector<float> probs = d_probs.download<float>();
      HostTopK top = top_k_on_host(s, probs);
      check_tables_equal(plan.download(), route_on_host(s, top.expert), s);

      // New probabilities in the same buffer: the replay routes them.
      std::vector<float> skewed = random_probs(s, rng, 1.0f);
      d_probs.upload(skewed);
      plan.poison(kPoisonOnes);
      graph.launch(stream);
      stream.synchronize();
      check_tables_equal(plan.download(), route_on_host(s, top_k_on_host(s, skewed).expert), s);
    }
  }

  TEST_CASE("cuda gpu: cuBLAS bf16 GEMMs match a CPU loop") {
    MOEFORGE_REQUIRE_GPU();
    Device device;
    Stream stream;
    CublasHandle cublas;
    const int64_t M = 96, N = 80, K = 72;
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    auto random_bf16 = [&](int64_t n) {
      std::vector<uint16_t> v(n);
      for (uint16_t &x : v)
        x = bf16_bits(u(rng));
      return v;
    };
    // Row-major element (i, j) of an r x c matrix, or of its stored transpose.
    auto at = [](const std::vector<uint16_t> &m, int64_t i, int64_t j, int64_t cols, bool transposed, int64_t rows) {
      return bf16_value(transposed ? m[j * rows + i] : m[i * cols + j]);
    };
    for (Transpose ta : {Transpose::no, Transpose::yes})
      for (Transpose tb : {Transpose::no, Transpose::yes}) {
        bool at_ = ta == Transpose::yes, bt = tb == Transpose::yes;
        CAPTURE(at_);
        CAPTURE(bt);
        std::vector<uint16_t> a = random_bf16(M * K), b = random_bf16(K * N);
        DeviceBuffer da = DeviceBuffer::from(a), db = DeviceBuffer::from(b);
        DeviceBuffer dc(M * N * sizeof(float)), dc16(M * N * sizeof(uint16_t));
        dc.fill32(kPoisonNaN);
        dc16.fill32(kPoisonNaN);
        gemm_bf16(cublas, stream, ta, tb, M, N, K, da.ptr(), db.ptr(), dc.ptr(), GemmOutput::f32);
        gemm_bf16(cublas, stream, ta, tb, M, N, K, da.ptr(), db.ptr(), dc16.ptr(), GemmOutput::bf16);
        stream.synchronize();
        std::vector<float> c = dc.download<float>();
        std::vector<uint16_t> c16 = dc16.download<uint16_t>();
        double worst = 0.0, worst16 = 0.0;
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < N; ++j) {
            double want = 0.0;
            for (int64_t q = 0; q < K; ++q)
              want += double(at(a, i, q, K, at_, M)) * double(at(b, q, j, N, bt, K));
            // A NaN left by the poison must fail: std::max would drop it.
            const double err = std::abs(c[i * N + j] - want), err16 = std::abs(bf16_value(c16[i * N + j]) - want);
            worst = std::max(worst, std::isnan(err) ? INFINITY : err);
            worst16 = std::max(worst16, std::isnan(err16) ? INFINITY : err16);
          }
        // fp32 accumulation of K=72 products of bf16 values in [-1, 1].
        CHECK(worst < 1e-4);
        // bf16 output: half an ulp of values up to ~10 is 2^-5.
        CHECK(worst16 < 0.04);
      }
  }

  TEST_CASE("cuda gpu: cuBLAS batched bf16 GEMMs match a CPU loop per batch") {
    MOEFORGE_REQUIRE_GPU();
    Device device;
    Stream stream;
    CublasHandle cublas;
    // Three GEMMs with their own operands: a wrong stride would mix one
    // batch's operands into another's result.
    const int64_t batch = 3, M = 40, N = 48, K = 56;
    std::mt19937 rng(2);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<uint16_t> a(batch * M * K), b(batch * K * N);
    for (uint16_t &x : a)
      x = bf16_bits(u(rng));
    for (uint16_t &x : b)
      x = bf16_bits(u(rng));
    DeviceBuffer da = DeviceBuffer::from(a), db = DeviceBuffer::from(b);
    DeviceBuffer dc(batch * M * N * sizeof(float));
    dc.fill32(kPoisonNaN);
    gemm_nn_batched(cublas, stream, batch, M, N, K, da.ptr(), db.ptr(), dc.ptr(), GemmOutput::f32);
    stream.synchronize();
    std::vector<float> c = dc.download<float>();
    for (int64_t e = 0; e < batch; ++e) {
      CAPTURE(e);
      double worst = 0.0;
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double want = 0.0;
          for (int64_t q = 0; q < K; ++q)
            want += double(bf16_value(a[(e * M + i) * K + q])) * double(bf16_value(b[(e * K + q) * N + j]));
          const double err = std::abs(c[(e * M + i) * N + j] - want);
          worst = std::max(worst, std::isnan(err) ? INFINITY : err); // std::max drops a NaN
        }
      // fp32 accumulation of K = 56 products of bf16 values in [-1, 1].
      CHECK(worst < 1e-4);
    }
    CHECK_THROWS_WITH_AS(gemm_nn_batched(cublas, stream, 0, M, N, K, da.ptr(), db.ptr(), dc.ptr()),
                         doctest::Contains("the count and every dimension must be positive"), UserError);
  }

} // TEST_SUITE("gpu")
