// Group-limited top-k (TopKOptions::groups, DeepSeek-V3's node-limited
// routing) and the deepseek_moe example built on it: the selection rule
// against an independent brute force, the algebra's checks and printing, the
// example's reference against hand-written loops, the CPU backend against the
// reference, and the CUDA compile (the device routing and the layer's GPU
// training are in test_cuda_gpu.cpp and test_cuda_training.cpp).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <sstream>

#include "backends/reference/evaluate.h"
#include "dsl/error.h"
#include "dsl/moeforge.h"
#include "dsl/top_k_select.h"
#include "examples/examples.h"
#include "lowering/lower.h"
#include "schedules/presets.h"
#include "user_error.h"

#ifdef MOEFORGE_HAVE_CPU_BACKEND
#include "cpu_compare.h"
#endif
#ifdef MOEFORGE_HAVE_CUDA
#include "backends/cuda/runtime/training_layer.h"
#include "cuda_resources.h"
#include "layer_compare.h"
#endif

using namespace moeforge;

namespace {

// The rule spelled out the slow way: every group's two largest by sorting a
// copy, groups ranked by a full sort, experts by a full sort of the kept ones.
std::vector<int32_t> brute_force(const std::vector<double> &row, int k, int groups, int top_groups) {
  const int E = static_cast<int>(row.size()), size = E / groups;
  std::vector<std::pair<double, int>> group_rank;
  for (int g = 0; g < groups; ++g) {
    std::vector<double> v(row.begin() + g * size, row.begin() + (g + 1) * size);
    std::sort(v.rbegin(), v.rend());
    group_rank.push_back({size == 1 ? v[0] : v[0] + v[1], g});
  }
  std::stable_sort(group_rank.begin(), group_rank.end(), [](auto a, auto b) { return a.first > b.first; });
  std::vector<std::pair<double, int>> kept;
  for (int i = 0; i < top_groups; ++i)
    for (int e = 0; e < size; ++e) {
      int expert = group_rank[i].second * size + e;
      kept.push_back({row[expert], expert});
    }
  std::sort(kept.begin(), kept.end(),
            [](auto a, auto b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
  std::vector<int32_t> out;
  for (int s = 0; s < k; ++s)
    out.push_back(kept[s].second);
  return out;
}

bool has(const std::string &s, const std::string &part) { return s.find(part) != std::string::npos; }

} // namespace

TEST_CASE("grouped top-k: the selection is the brute force's, ties included") {
  std::mt19937_64 rng(5);
  struct Case {
    int E, k, groups, top_groups;
  };
  for (Case c : {Case{8, 2, 4, 2}, Case{16, 4, 8, 4}, Case{12, 3, 3, 1}, Case{8, 8, 1, 1}, Case{6, 2, 6, 2},
                 Case{64, 8, 8, 3}}) {
    for (int n = 0; n < 300; ++n) {
      std::vector<double> row(static_cast<size_t>(c.E));
      // Few distinct values half the time: ties between experts and groups.
      for (double &v : row)
        v = n % 2 ? double(rng() % 4) / 4.0 : std::uniform_real_distribution<double>(0, 1)(rng);
      std::vector<int32_t> got(static_cast<size_t>(c.k));
      select_top_k(row.data(), c.E, c.k, c.groups, c.top_groups, got.data());
      INFO("E " << c.E << " k " << c.k << " groups " << c.groups << " top " << c.top_groups << " case " << n);
      CHECK(got == brute_force(row, c.k, c.groups, c.top_groups));
    }
  }
  // Where it differs from plain top-k: expert 0 has the best score, but its
  // group (0, 1) sums less than group (2, 3).
  std::vector<double> row = {0.9, 0.0, 0.6, 0.5};
  std::vector<int32_t> plain(2), grouped(2);
  select_top_k(row.data(), 4, 2, 1, 1, plain.data());
  select_top_k(row.data(), 4, 2, 2, 1, grouped.data());
  CHECK(plain == std::vector<int32_t>{0, 2});
  CHECK(grouped == std::vector<int32_t>{2, 3});
}

TEST_CASE("grouped top-k: impossible groupings are user errors, and the route prints its groups") {
  Dim T = Dim::dynamic("T"), E("E", 12);
  Var t("t", T), e("e", E);
  Input s("s", {T, E}, DType::f32);
  Func p("p", DType::f32);
  p(t, e) = s(t, e);
  auto with = [&](int k, int groups, int top_groups) {
    TopKOptions o;
    o.groups = groups;
    o.top_groups = top_groups;
    return testing::user_error_of([&] { top_k(p, e, k, o); });
  };
  CHECK(has(with(2, 5, 1), "top_k: groups = 5 must divide the 12 experts along 'e' into equal groups"));
  CHECK(has(with(2, 0, 1), "groups = 0 must divide"));
  CHECK(has(with(2, 4, 5), "top_k: top_groups = 5 of 4 groups: choose 1 <= top_groups <= groups"));
  CHECK(has(with(2, 4, 0), "top_groups = 0 of 4 groups"));
  CHECK(has(with(7, 4, 2), "top_k: k = 7 but the 2 best groups of 3 experts hold only 6: raise top_groups or lower k"));
  TopKOptions o;
  o.groups = 4;
  o.top_groups = 2;
  Route r = top_k(p, e, 2, o);
  Func y("y", DType::f32);
  y(t) = combine(r, t, r.gate(r.pair()));
  std::ostringstream text;
  text << Pipeline({y});
  CHECK(has(text.str(), "route = top_k(p, e, k = 2, groups = 4, top_groups = 2)"));
}

TEST_CASE("grouped top-k: a softmax router's softmax stays a step before grouped routing") {
  // The fused softmax-in-routing kernels select among all experts; the
  // grouped kernel takes the probabilities.
  Dim T = Dim::dynamic("T"), D("D", 64), E("E", 16);
  Var t("t", T), e("e", E), i("i", D);
  Input x("x", {T, D});
  Param wr("wr", {D, E});
  Func logits("logits", DType::f32), probs("probs", DType::f32);
  logits(t, e) = sum(i, x(t, i) * wr(i, e));
  probs(t, e) = softmax(e, logits(t, e));
  for (int groups : {1, 4}) {
    TopKOptions o;
    o.groups = groups;
    o.top_groups = 2;
    Route r = top_k(probs, e, 2, o);
    Func y("y", DType::f32);
    y(t) = combine(r, t, r.gate(r.pair()));
    KernelProgram p = lower(Pipeline({y}), preset("scattermoe"));
    for (const Step &s : p.steps)
      if (auto *rs = std::get_if<RoutingStep>(&s)) {
        INFO("groups " << groups);
        CHECK(rs->softmax == (groups == 1));
      }
  }
}

TEST_CASE("grouped top-k: deepseek_moe's reference matches hand-written loops") {
  ExampleShape s{40, 16, 4, 32, 48}; // T, E, k, d, f: 8 groups of 2, the best 4 kept
  Example ex = make_example("deepseek_moe", s);
  TensorMap in = ex.random_inputs(s, 3);
  EvalResult ref = evaluate(ex.pipeline, in);
  const HostTensor &x = in.at("x"), &wr = in.at("wr"), &b = in.at("bias"), &w1 = in.at("w1"), &w3 = in.at("w3"),
                   &w2 = in.at("w2");
  auto silu = [](double v) { return v / (1 + std::exp(-v)); };
  auto bf16 = [](double v) { return round_to_bf16(v); }; // h and o are stored in bf16
  double worst = 0, scale = 0;
  for (int64_t t = 0; t < s.tokens; ++t) {
    std::vector<double> score(s.experts), choice(s.experts);
    for (int64_t e = 0; e < s.experts; ++e) {
      double l = 0;
      for (int64_t i = 0; i < s.d; ++i)
        l += x.at({t, i}) * wr.at({i, e});
      score[e] = 1 / (1 + std::exp(-l));
      choice[e] = score[e] + b.at({e});
    }
    std::vector<int32_t> chosen = brute_force(choice, 4, 8, 4);
    for (int slot = 0; slot < 4; ++slot)
      CHECK(ref.routes.begin()->second.expert[t * 4 + slot] == chosen[slot]);
    double total = 0;
    for (int32_t e : chosen)
      total += score[e];
    for (int64_t i = 0; i < s.d; ++i) {
      double y = 0;
      for (int32_t e : chosen) {
        double o = 0;
        for (int64_t j = 0; j < s.f; ++j) {
          double a = 0, c = 0;
          for (int64_t q = 0; q < s.d; ++q) {
            a += x.at({t, q}) * w1.at({e, q, j});
            c += x.at({t, q}) * w3.at({e, q, j});
          }
          o += bf16(silu(a) * c) * w2.at({e, j, i});
        }
        y += 2.5 * score[e] / total * bf16(o);
      }
      worst = std::max(worst, std::abs(y - ref["y"].at({t, i})));
      scale = std::max(scale, std::abs(y));
    }
  }
  // h and o rounded to bf16 on both sides; a different summation order may
  // round an element the other way (one bf16 ulp, ~4e-3 of it), so the bar
  // is a few ulps of y's scale, far below what a wrong gate or route gives.
  CHECK(worst <= 5e-3 * scale);
}

#ifdef MOEFORGE_HAVE_CPU_BACKEND
TEST_CASE("grouped top-k: deepseek_moe on the CPU backend matches the reference") {
  for (const char *p : {"megablocks", "scattermoe"}) {
    ExampleShape s = testing::shape(300, 64, 96, 32, 8); // 8 groups of 4, the best 4 kept
    Example ex = make_example("deepseek_moe", s);
    INFO(p);
    testing::Outcome o = cpu_test::run_and_compare(ex, ex.random_inputs(s, 4), s.tokens, preset(p));
    CHECK(o.routing_mismatches == 0);
    CHECK(o.worst_error <= 1e-2);
  }
}
#endif

#ifdef MOEFORGE_HAVE_CUDA
TEST_CASE("grouped top-k: deepseek_moe compiles for sm_90a without spills, forward and training") {
  ExampleShape s = testing::shape(64, 64, 128, 16, 4);
  Example ex = make_example("deepseek_moe", s);
  for (const char *p : {"megablocks", "scattermoe"}) {
    INFO(p);
    testing::check_resources(cuda::compile_layer(ex.pipeline, preset(p)), std::string("deepseek_moe / ") + p);
    testing::check_resources(cuda::compile_training(ex.pipeline, ex.pipeline.func("y"), preset(p)).layer,
                             std::string("deepseek_moe training / ") + p);
  }
}
#endif

TEST_CASE("grouped top-k: a NaN or infinite score is a user error naming the token and expert, never a choice") {
  // The sweep's case: one NaN in deepseek_moe's selection-only bias sent
  // every token to expert 0, with y finite, on the reference and the CPU
  // backend alike.
  ExampleShape s;
  s.tokens = 16;
  s.d = 64;
  s.f = 128;
  s.experts = 8;
  s.topk = 2;
  Example ex = make_example("deepseek_moe", s);
  for (double bad : {std::nan(""), double(INFINITY), -double(INFINITY)}) {
    INFO(bad);
    TensorMap in = ex.random_inputs(s, 3);
    in.at("bias").data[3] = bad;
    std::string m = testing::user_error_of([&] { evaluate(ex.pipeline, in); });
    CHECK(has(m, "top_k: the routing score of token 0, expert 3 is "));
    CHECK(has(m, "which chooses no expert by any order: find where it comes from"));
#ifdef MOEFORGE_HAVE_CPU_BACKEND
    cpu::CompiledCpuLayer compiled = cpu::compile_cpu_layer(ex.pipeline, preset("scattermoe"));
    cpu::CpuLayer layer(compiled, s.tokens);
    layer.upload(in);
    m = testing::user_error_of([&] { layer.run(); });
    CHECK(has(m, "top_k: the routing score of token 0, expert 3 is "));
#endif
  }
  // A NaN in the tokens reaches the scores too: refused where it would route.
  TensorMap in = ex.random_inputs(s, 4);
  in.at("x").data[5 * s.d] = std::nan("");
  CHECK(has(testing::user_error_of([&] { evaluate(ex.pipeline, in); }), "routing score of token 5, expert 0"));
}
