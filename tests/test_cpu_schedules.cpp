// Schedule sweeps on the LLVM CPU backend: changing a schedule never changes
// the result. Every combination of permutation, block size, tile width,
// epilogue fusion and gate placement runs both MoE examples against the Eigen
// reference (shapes small and ragged, so CI stays fast), then random small
// shapes with random valid schedules (a property test, seeded).
#include <doctest/doctest.h>

#include <random>

#include "cpu_compare.h"

using namespace moeforge;
using namespace moeforge::cpu_test;

namespace {

Schedule make_schedule(Permutation perm, int block, int tile_n, int tile_k, bool fuse, GateFusion gate) {
  Schedule s("sweep");
  s.permutation(perm).block(block).gate(gate).tile("*", 64, tile_n, tile_k).fuse_epilogue("h", fuse);
  return s;
}

// 36 schedules per (example, permutation): block x tile_n x fusion x gate.
int sweep(const char *example, Permutation perm) {
  // T = 150 is a multiple of no block; f = 192 of no tile_n but 64.
  ExampleShape s = shape(150, 64, 192, 8, 2);
  Example ex = make_example(example, s);
  TensorMap in = ex.random_inputs(s, 17);
  int cases = 0;
  for (int block : {64, 128, 256})
    for (int tile_n : {64, 128, 256})
      for (bool fuse : {true, false})
        for (GateFusion gate : {GateFusion::combine, GateFusion::epilogue}) {
          Schedule sch = make_schedule(perm, block, tile_n, tile_n == 128 ? 64 : 32, fuse, gate);
          Outcome o = run_and_compare(ex, in, s.tokens, sch);
          INFO(example << "\n" << sch.to_text());
          CHECK(o.routing_mismatches == 0);
          ++cases;
        }
  return cases;
}

} // namespace

TEST_SUITE("cpu") {
  TEST_CASE("cpu schedules: moe_mlp blocked (36 schedules)") { CHECK(sweep("moe_mlp", Permutation::blocked) == 36); }
  TEST_CASE("cpu schedules: moe_mlp scattered (36 schedules)") {
    CHECK(sweep("moe_mlp", Permutation::scattered) == 36);
  }
  TEST_CASE("cpu schedules: swiglu_moe blocked (36 schedules)") {
    CHECK(sweep("swiglu_moe", Permutation::blocked) == 36);
  }
  TEST_CASE("cpu schedules: swiglu_moe scattered (36 schedules)") {
    CHECK(sweep("swiglu_moe", Permutation::scattered) == 36);
  }

  TEST_CASE("cpu schedules: random small shapes with random valid schedules (40 seeded cases)") {
    std::mt19937_64 rng(2026);
    auto pick = [&](std::initializer_list<int> xs) {
      return *(xs.begin() + std::uniform_int_distribution<size_t>(0, xs.size() - 1)(rng));
    };
    auto between = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    for (int i = 0; i < 40; ++i) {
      // The lowering needs dims that are multiples of 8 (E too: the router GEMM).
      ExampleShape s = shape(between(1, 300), 8 * between(1, 12), 8 * between(1, 12), pick({8, 16}), 1);
      s.topk = between(1, static_cast<int>(s.experts));
      const bool swiglu = between(0, 1) == 1;
      const Bias bias = static_cast<Bias>(between(0, 3));
      int block = pick({64, 128, 256});
      Schedule sch("random");
      sch.permutation(between(0, 1) ? Permutation::blocked : Permutation::scattered)
          .block(block)
          .gate(between(0, 1) ? GateFusion::combine : GateFusion::epilogue)
          .tile("*", 64, pick({64, 128, 256}), pick({32, 64}))
          .tile("o", pick({64, block}), pick({64, 128}), pick({32, 64}))
          .fuse_epilogue("h", between(0, 1) == 1);
      Example ex = biased_moe(s, swiglu, bias, /*renormalize=*/swiglu);
      TensorMap in = biased_inputs(ex, s, bias, 100 + i);
      INFO("case " << i << ": T=" << s.tokens << " d=" << s.d << " f=" << s.f << " E=" << s.experts << " k=" << s.topk
                   << (swiglu ? " swiglu" : " gelu") << " bias " << static_cast<int>(bias));
      Outcome o = run_and_compare(ex, in, s.tokens, sch);
      CHECK(o.routing_mismatches == 0);
    }
  }
}
