// Fixed expert capacity with dropping (GShard / Tutel), a schedule choice
// over the unchanged dropless algebra: the rule (dsl/capacity.h), the
// schedule primitive, the host routing tables and the reference (the
// compiled backends: test_cpu_capacity.cpp, test_cuda_capacity.cpp).
#include <doctest/doctest.h>

#include <cmath>
#include <numeric>

#include "backends/reference/evaluate.h"
#include "dsl/capacity.h"
#include "dsl/ops.h"
#include "examples/aux_loss_example.h"
#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "runtime/routing_host.h"
#include "schedules/presets.h"
#include "schedules/schedule.h"
#include "user_error.h"

using namespace moeforge;

namespace {

// The reference's y under a capacity against the combine written by hand:
// y(t) = sum over t's kept pairs of gate(r) * o(r), with o and the gates
// from the same evaluation (a renormalised gate is renormalised over the
// kept pairs, since its sum over the token's pairs skips the dropped ones).
double kept_combine_error(const Example &ex, const TensorMap &in, double factor, int64_t *dropped) {
  EvalOptions cap;
  cap.capacity_factor = factor;
  EvalResult kept = evaluate(ex.pipeline, in, Precision::f64, cap);
  const RoutingResult &rr = kept.routes.at(ex.route);
  *dropped = rr.dropped();
  const HostTensor &y = kept["y"], &o = kept["o"], &gate = kept[ex.route + "_gate"];
  const int64_t d = y.shape[1];
  HostTensor hand(y.shape);
  for (size_t r = 0; r < rr.expert.size(); ++r)
    if (rr.kept[r])
      for (int64_t i = 0; i < d; ++i)
        hand.data[rr.token[r] * d + i] += gate.data[r] * o.data[r * d + i];
  double worst = 0, scale = 1e-30;
  for (size_t i = 0; i < y.data.size(); ++i) {
    worst = std::max(worst, std::fabs(y.data[i] - hand.data[i]));
    scale = std::max(scale, std::fabs(y.data[i]));
  }
  return worst / scale;
}

} // namespace

TEST_CASE("capacity: the GShard rule drops first choices past capacity, then second choices after every first") {
  // T = 4, k = 2, E = 3, factor 0.75: C = ceil(0.75 * 8 / 3) = 2.
  // Token experts (slot 0, slot 1): t0 (0, 1), t1 (0, 2), t2 (0, 1), t3 (1, 0).
  // First choices: expert 0 gets t0, t1 and t2 -> t2 dropped; expert 1 t3.
  // Second choices: t0 -> 1 (its 2nd, kept), t1 -> 2 (kept), t2 -> 1 (its
  // 3rd: dropped), t3 -> 0 (its 4th: dropped).
  const std::vector<int32_t> expert = {0, 1, 0, 2, 0, 1, 1, 0};
  CHECK(expert_capacity(0.75, 4, 2, 3, KeepPriority::token_order) == 2);
  const std::vector<uint8_t> kept =
      keep_within_capacity<float>(expert.data(), nullptr, 4, 2, 3, 2, KeepPriority::token_order);
  CHECK(kept == std::vector<uint8_t>{1, 1, 1, 1, 0, 0, 1, 0});
  // A capacity of every pair drops nothing; 0 drops everything.
  CHECK(keep_within_capacity<float>(expert.data(), nullptr, 4, 2, 3, 8, KeepPriority::token_order) ==
        std::vector<uint8_t>(8, 1));
  CHECK(keep_within_capacity<float>(expert.data(), nullptr, 4, 2, 3, 0, KeepPriority::token_order) ==
        std::vector<uint8_t>(8, 0));
  CHECK(expert_capacity(1.25, 256, 2, 8, KeepPriority::token_order) == 80);
  CHECK(expert_capacity(1.1, 100, 1, 1, KeepPriority::token_order) == 110);
}

TEST_CASE("capacity: by score, each expert keeps its largest scores, ties to the earlier token") {
  // Every token offers every expert (k = E = 2), pairs r = t * 2 + slot.
  const std::vector<int32_t> expert = {0, 1, 1, 0, 0, 1, 1, 0};
  const std::vector<float> score = {0.5f, 0.5f, 0.9f, 0.1f, 0.5f, 0.5f, 0.7f, 0.3f};
  // Expert 0: r0 (t0) 0.5, r3 (t1) 0.1, r4 (t2) 0.5, r7 (t3) 0.3 -> top 2:
  // r0 and r4 (the tie at 0.5 both kept). Expert 1: r1 0.5, r2 0.9, r5 0.5,
  // r6 0.7 -> r2 and r6.
  CHECK(keep_within_capacity(expert.data(), score.data(), 4, 2, 2, 2, KeepPriority::score) ==
        std::vector<uint8_t>{1, 0, 1, 0, 1, 0, 1, 0});
  // Capacity 1: expert 0's tie at 0.5 goes to the earlier token, t0.
  CHECK(keep_within_capacity(expert.data(), score.data(), 4, 2, 2, 1, KeepPriority::score) ==
        std::vector<uint8_t>{1, 0, 1, 0, 0, 0, 0, 0});
  CHECK(expert_capacity(2.0, 100, 8, 8, KeepPriority::score) == 25);
  CHECK(expert_capacity(100.0, 10, 4, 4, KeepPriority::score) == 10); // never more than every token
}

TEST_CASE("capacity: the schedule primitive traces, replays and refuses a factor that is not positive") {
  Schedule s("capped");
  s.capacity(1.25);
  CHECK(s.capacity() == 1.25);
  CHECK(s.to_text().find("capacity(1.25)") != std::string::npos);
  CHECK(Schedule::from_text(s.to_text()).capacity() == 1.25);
  CHECK(Schedule("plain").capacity() == 0); // dropless by default
  CHECK(testing::user_error_of([] { Schedule().capacity(0); }).find("must be a positive number") != std::string::npos);
  // Too large is not "not positive" (#51): said as the bound it passes.
  for (const char *text : {"capacity(1e308)", "capacity(inf)"})
    CHECK(testing::user_error_of([&] { Schedule::from_text(text); }).find("must be at most 1024") != std::string::npos);
  CHECK(testing::user_error_of([] { Schedule().capacity(-1); }).find("do not call capacity()") != std::string::npos);
  CHECK(testing::user_error_of([] { Schedule::from_text("capacity(lots)"); }).find("expected a number") !=
        std::string::npos);
}

TEST_CASE("capacity: host routing leaves dropped pairs out of the tables and sends them to the drop row") {
  RoutingShape s{4, 3, 2, 64};
  s.capacity = 2;
  const std::vector<int32_t> expert = {0, 1, 0, 2, 0, 1, 1, 0};
  RoutingTables t = route_on_host(s, expert);
  CHECK(verify_routing_tables(s, t).empty());
  CHECK(t.counts == std::vector<int32_t>{2, 2, 1});
  CHECK(dropped_pairs(s, t) == 3);
  for (int r : {4, 5, 7})
    CHECK(t.pair_pos[r] == s.drop_row());
  // The drop row is past every tile.
  CHECK(t.offsets.back() <= s.drop_row());
  // A table that kept a dropped pair is caught.
  RoutingTables dropless = route_on_host(RoutingShape{4, 3, 2, 64}, expert);
  CHECK_FALSE(verify_routing_tables(s, dropless).empty());
}

TEST_CASE("capacity: the reference's combine sums the kept pairs only") {
  for (const char *name : {"moe_mlp", "swiglu_moe"}) {
    ExampleShape s = testing::shape(200, 32, 64, 8, 2);
    Example ex = make_example(name, s);
    TensorMap in = ex.random_inputs(s, 7);
    int64_t dropped = 0;
    const double err = kept_combine_error(ex, in, 1.0, &dropped);
    INFO(name << ": " << dropped << " pairs dropped");
    CHECK(dropped > 0); // random routing overflows a capacity of the even share
    CHECK(err < 1e-12);
    // A large factor drops nothing.
    if (std::string(name) == "swiglu_moe") { // renormalised: a token's kept gates sum to 1
      EvalOptions cap;
      cap.capacity_factor = 1.0;
      EvalResult r = evaluate(ex.pipeline, in, Precision::f64, cap);
      const RoutingResult &rr = r.routes.at(ex.route);
      std::vector<double> sum(static_cast<size_t>(s.tokens), 0.0);
      std::vector<int> n(static_cast<size_t>(s.tokens), 0);
      for (size_t p = 0; p < rr.expert.size(); ++p)
        if (rr.kept[p]) {
          sum[rr.token[p]] += r[ex.route + "_gate"].data[p];
          ++n[rr.token[p]];
        }
      for (int64_t t = 0; t < s.tokens; ++t)
        if (n[t])
          CHECK(sum[t] == doctest::Approx(1.0).epsilon(1e-12));
    }
    EvalOptions roomy;
    roomy.capacity_factor = 8.0;
    CHECK(evaluate(ex.pipeline, in, Precision::f64, roomy).routes.at(ex.route).dropped() == 0);
  }
}

TEST_CASE("capacity: lowering refuses a plain sum over a dropping route's padded rows, not the load-balancing loss") {
  // o's rows are in the padded order, where a dropped pair has no row of
  // its own: summing o over every pair cannot be compiled under a capacity.
  Dim T = Dim::dynamic("T"), D("D", 16), F("F", 32), E("E", 4);
  Var t("t", T), e("e", E), i("i", D), j("j", F);
  Input x("x", {T, D});
  Param wr("wr", {D, E}), w1("w1", {E, D, F}), w2("w2", {E, F, D});
  Func logits("logits", DType::f32), probs("probs", DType::f32);
  logits(t, e) = sum(i, x(t, i) * wr(i, e));
  probs(t, e) = softmax(e, logits(t, e));
  Route route = top_k(probs, e, 2);
  Var r = route.pair();
  Func h("h"), o("o"), y("y"), total("total", DType::f32);
  h(r, j) = gelu(sum(i, x(route.token(r), i) * w1(route.expert(r), i, j)));
  o(r, i) = sum(j, h(r, j) * w2(route.expert(r), j, i));
  y(t, i) = combine(route, t, route.gate(r) * o(r, i));
  total(i) = sum(r, o(r, i));
  Pipeline p({y, total});
  Schedule s = preset("megablocks");
  CHECK_NOTHROW(lower(p, s)); // dropless: every pair has its row
  s.capacity(1.0);
  const std::string msg = testing::user_error_of([&] { lower(p, s); });
  CHECK(msg.find("'total' sums 'o' over every pair of route 'route'") != std::string::npos);
  CHECK(msg.find("combine() or expert_sum()") != std::string::npos);
  // The load-balancing loss sums an index function over the pairs: it
  // counts every pair, as the reference does, and compiles.
  AuxLossLayer a = make_aux_loss_example("moe_mlp", testing::shape(64, 16, 32, 4, 2));
  CHECK_NOTHROW(lower_training(a.example.pipeline, a.output_funcs(), s));
}
