// Expert parallelism's split of the algebra (lowering/expert_parallel_split.h):
// what each side holds, the errors for layers it cannot split, and, with
// ranks emulated in one process by the host loopback exchange, the
// reference's forward and every gradient of the split layer equal to the
// unsplit layer's over every rank's tokens.
#include <doctest/doctest.h>

#include <algorithm>
#include <set>
#include <sstream>

#include "dsl/ops.h"
#include "examples/examples.h"
#include "expert_parallel_emulation.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "program_order.h"
#include "schedules/presets.h"
#include "user_error.h"

using namespace moeforge;
using namespace moeforge::testing;

namespace {

std::string text(const Pipeline &p) {
  std::ostringstream os;
  os << p;
  return os.str();
}

bool has(const std::string &s, const std::string &part) { return s.find(part) != std::string::npos; }

std::vector<std::string> names(const std::vector<Func> &fs) {
  std::vector<std::string> out;
  for (const Func &f : fs)
    out.push_back(f.name());
  return out;
}

// The unsplit layer's values and gradients over every token, and the
// emulated expert-parallel step's, compared tensor by tensor.
void check_matches_unsplit(const std::string &example, const ExampleShape &s, int ranks,
                           const std::vector<int64_t> &bounds, uint64_t seed) {
  CAPTURE(example);
  CAPTURE(ranks);
  Example ex = make_example(example, s);
  TensorMap in = ex.random_inputs(s, seed);
  std::mt19937_64 rng(seed + 1);
  HostTensor dy = random_tensor(in.at("x").shape, rng);
  Func y = ex.pipeline.func(ex.output);
  TrainingAlgebra whole = training_algebra(ex.pipeline, y);
  TensorMap whole_in = in;
  whole_in["d_" + ex.output] = dy;
  EvalResult want = evaluate(whole.pipeline, whole_in);

  ExpertParallelSplit split = split_expert_parallel(ex.pipeline, ranks);
  EmulatedStep got = emulate_expert_parallel(split, in, bounds, reference_evaluator(), &dy, ex.output);

  auto per_token = [&](const std::string &name) {
    std::vector<HostTensor> parts;
    for (int q = 0; q < ranks; ++q)
      parts.push_back(got.token[q].at(name));
    return row_concat(parts);
  };
  CHECK(max_normalized_error(per_token(ex.output), want[ex.output]) < 1e-12);
  CHECK(max_normalized_error(per_token("d_x"), want["d_x"]) < 1e-12);
  // The router's weights are on every rank: each holds its tokens' share
  // of their gradient, which a data-parallel all-reduce sums.
  HostTensor d_wr = got.token[0].at("d_wr");
  for (int q = 1; q < ranks; ++q)
    for (int64_t i = 0; i < d_wr.size(); ++i)
      d_wr.data[i] += got.token[q].at("d_wr").data[i];
  CHECK(max_normalized_error(d_wr, want["d_wr"]) < 1e-12);
  // Each rank owns its experts' weight gradients.
  for (const std::string &w : split.expert_params) {
    CAPTURE(w);
    std::vector<HostTensor> parts;
    for (int p = 0; p < ranks; ++p)
      parts.push_back(got.experts[p].at("d_" + w));
    CHECK(max_normalized_error(row_concat(parts), want["d_" + w]) < 1e-12);
  }
  int64_t rows = 0;
  for (int64_t n : got.received)
    rows += n;
  CHECK(rows == s.tokens * s.topk); // dropless: every pair computed once
}

} // namespace

TEST_CASE("expert parallel split: the two sides of a GeLU-MLP MoE") {
  Example ex = make_example("moe_mlp", ExampleShape{32, 8, 2, 16, 24});
  ExpertParallelSplit split = split_expert_parallel(ex.pipeline, 4);
  CHECK(split.route == "route");
  CHECK(split.experts == 8);
  CHECK(split.local_experts == 2);
  CHECK(names(split.token_outputs) == std::vector<std::string>{"y", "x_rows"});
  CHECK(names(split.expert_outputs) == std::vector<std::string>{"o_rows"});
  REQUIRE(split.dispatched.size() == 1);
  CHECK(split.dispatched[0].token_side == "x_rows");
  CHECK(split.dispatched[0].width == 16);
  REQUIRE(split.returned.size() == 1);
  CHECK(split.returned[0].token_side == "o_returned");
  CHECK(split.returned[0].expert_side == "o_rows");
  CHECK(split.expert_params == std::vector<std::string>{"w1", "w2"});

  const std::string token = text(split.token_pipeline());
  CHECK(has(token, "input o_returned(route.pairs, D)"));
  CHECK(has(token, "y(t, i) = combine(route, t, route_gate(r) * o_returned(r, i))"));
  CHECK(has(token, "x_rows(r, d) = x(token(r), d)"));
  CHECK(!has(token, "w1"));
  const std::string experts = text(split.expert_pipeline());
  CHECK(has(experts, "param w1(E, D, F)"));
  CHECK(has(experts, "E = 2"));
  CHECK(has(experts, "route = top_k(expert_select_scores, e, k = 1)"));
  CHECK(has(experts, "h(r, j) = gelu(sum(i, x_rows(token(r), i) * w1(expert(r), i, j)))"));
  CHECK(has(experts, "o_rows(n, i) = combine(route, n, o(r, i))"));
  CHECK(!has(experts, "wr"));
}

TEST_CASE("expert parallel split: the reference's step equals the unsplit layer's, every gradient") {
  const ExampleShape s{40, 8, 2, 16, 24};
  for (const char *example : {"moe_mlp", "swiglu_moe", "expert_bias_moe", "rmsnorm_moe"}) {
    check_matches_unsplit(example, s, 1, {0, 40}, 11);
    check_matches_unsplit(example, s, 2, {0, 17, 40}, 12);         // ranks with different token counts
    check_matches_unsplit(example, s, 4, {0, 10, 10, 31, 40}, 13); // a rank without tokens
  }
}

TEST_CASE("expert parallel split: an expert with no rows on any rank") {
  // Router weights that never choose expert 5: its rank computes no rows
  // for it, and its weight gradient is zero, as on one GPU.
  const ExampleShape s{24, 8, 2, 16, 24};
  Example ex = make_example("moe_mlp", s);
  TensorMap in = ex.random_inputs(s, 21);
  for (int64_t i = 0; i < s.d; ++i)
    in["wr"].at({i, 5}) = -8.0;
  in["x"] = HostTensor(in["x"].shape, 0.0);
  std::mt19937_64 rng(3);
  for (double &v : in["x"].data)
    v = 0.25 + 0.5 * std::uniform_real_distribution<double>(0, 1)(rng);
  ExpertParallelSplit split = split_expert_parallel(ex.pipeline, 2);
  HostTensor dy = random_tensor(in.at("x").shape, rng);
  EmulatedStep got = emulate_expert_parallel(split, in, {0, 12, 24}, reference_evaluator(), &dy);
  EvalResult fwd = evaluate(ex.pipeline, in);
  for (int32_t e : fwd.routes.at("route").expert)
    REQUIRE(e != 5);
  const HostTensor &d_w1 = got.experts[1].at("d_w1"); // rank 1 owns experts 4..7: local 1 is expert 5
  for (int64_t i = 0; i < s.d; ++i)
    for (int64_t j = 0; j < s.f; ++j)
      CHECK(d_w1.at({1, i, j}) == 0.0);
}

TEST_CASE("expert parallel split: layers it cannot split are user errors that say why") {
  const ExampleShape s{16, 8, 2, 16, 24};
  Example ex = make_example("moe_mlp", s);
  CHECK(has(user_error_of([&] { split_expert_parallel(ex.pipeline, 3); }), "do not split evenly over 3 ranks"));
  CHECK(has(user_error_of([&] { split_expert_parallel(ex.pipeline, 0); }), "choose a rank count that divides 8"));
  CHECK(has(user_error_of([&] { split_expert_parallel(make_example("expert_choice_moe", s).pipeline, 2); }),
            "is expert choice"));

  Dim T = Dim::dynamic("T"), D("D", 16), F("F", 24), E("E", 8);
  Var t("t", T), e("e", E), i("i", D), j("j", F);
  Input x("x", {T, D});
  Param wr("wr", {D, E}), w1("w1", {E, D, F}), w2("w2", {E, F, D}), b("b", {D});
  Func logits("logits", DType::f32);
  logits(t, e) = sum(i, x(t, i) * wr(i, e));
  Func probs("probs", DType::f32);
  probs(t, e) = softmax(e, logits(t, e));
  Route route = top_k(probs, e, 2);
  Var r = route.pair();
  Func h("h");
  h(r, j) = gelu(sum(i, x(route.token(r), i) * w1(route.expert(r), i, j)));
  {
    // The gate applied inside the experts: a per-pair value of the token side.
    Func o("o");
    o(r, i) = route.gate(r) * sum(j, h(r, j) * w2(route.expert(r), j, i));
    Func y("y");
    y(t, i) = combine(route, t, o(r, i));
    CHECK(has(user_error_of([&] { split_expert_parallel(Pipeline({y}), 2); }), "apply it in the combine instead"));
  }
  {
    // A bias every expert shares.
    Func o("o");
    o(r, i) = sum(j, h(r, j) * w2(route.expert(r), j, i)) + b(i);
    Func y("y");
    y(t, i) = combine(route, t, route.gate(r) * o(r, i));
    CHECK(has(user_error_of([&] { split_expert_parallel(Pipeline({y}), 2); }), "which every expert shares"));
  }
  {
    // The layer's output itself per expert.
    Func o("o");
    o(r, i) = sum(j, h(r, j) * w2(route.expert(r), j, i));
    CHECK(has(user_error_of([&] { split_expert_parallel(Pipeline({o}), 2); }), "output 'o' is computed per expert"));
  }
  {
    // Nothing per expert.
    Func y("y");
    y(t, i) = combine(route, t, route.gate(r) * x(route.token(r), i));
    CHECK(has(user_error_of([&] { split_expert_parallel(Pipeline({y}), 2); }), "nothing to spread"));
  }
}

TEST_CASE("expert parallel split: the schedule's expert_parallel(ranks)") {
  Schedule s = Schedule("ep").permutation(Permutation::scattered).expert_parallel(4);
  CHECK(s.expert_parallel_ranks() == 4);
  const std::string text = s.to_text();
  CHECK(has(text, "expert_parallel(4)"));
  Schedule again = Schedule::from_text(text);
  CHECK(again.expert_parallel_ranks() == 4);
  CHECK(again.to_text() == text);
  // Each side of the split runs under the rest of the schedule, on one rank.
  Schedule one = s.on_one_rank();
  CHECK(one.expert_parallel_ranks() == 1);
  CHECK(!has(one.to_text(), "expert_parallel"));
  CHECK(has(one.to_text(), "permutation(scattered)"));
  CHECK(has(user_error_of([] { Schedule().expert_parallel(0); }), "expert_parallel(0): the experts spread over 1 to"));
  // One layer (any backend: the check is in lowering) refuses to spread its experts.
  Example ex = make_example("moe_mlp", ExampleShape{16, 8, 2, 16, 24});
  CHECK(has(user_error_of([&] { lower(ex.pipeline, s); }), "compile it with cuda::compile_expert_parallel"));
  CHECK(has(user_error_of([&] { lower_training(ex.pipeline, ex.pipeline.func("y"), s); }),
            "expert_parallel(4) spreads the experts over GPUs"));
}

TEST_CASE("expert parallel split: the schedule's exchange_chunks(rounds)") {
  Schedule s = Schedule("ep").expert_parallel(2).exchange_chunks(4);
  CHECK(s.exchange_chunks() == 4);
  CHECK(Schedule().exchange_chunks() == 1);
  const std::string text = s.to_text();
  CHECK(has(text, "exchange_chunks(4)"));
  Schedule again = Schedule::from_text(text);
  CHECK(again.exchange_chunks() == 4);
  CHECK(again.to_text() == text);
  // Each side compiles as one rank's layer: no exchange, no rounds.
  Schedule one = s.on_one_rank();
  CHECK(one.exchange_chunks() == 1);
  CHECK(!has(one.to_text(), "exchange_chunks"));
  CHECK(has(user_error_of([] { Schedule().exchange_chunks(0); }), "exchange_chunks(0): the forward's rows cross in 1"));
  // A layer on one GPU has no exchange to divide, on every backend.
  Example ex = make_example("moe_mlp", ExampleShape{16, 8, 2, 16, 24});
  CHECK(has(user_error_of([&] { lower(ex.pipeline, Schedule().exchange_chunks(2)); }),
            "exchange_chunks(2) divides an expert-parallel layer's row exchange, and one layer has none"));
  // One is the default, accepted anywhere.
  CHECK(!lower(ex.pipeline, Schedule().exchange_chunks(1)).steps.empty());
}

namespace {
std::vector<std::string> step_names(const KernelProgram &p, size_t begin, size_t end) {
  std::vector<std::string> out;
  for (size_t i = begin; i < end; ++i)
    out.push_back(step_name(p.steps[i]));
  return out;
}

// Whether `part` keeps the order `whole` has.
bool in_order(const std::vector<std::string> &part, const std::vector<std::string> &whole) {
  size_t at = 0;
  for (const std::string &n : part) {
    while (at < whole.size() && whole[at] != n)
      ++at;
    if (at++ >= whole.size())
      return false;
  }
  return true;
}
} // namespace

TEST_CASE("expert parallel split: the token side's steps ordered around the exchange") {
  Example ex = make_example("swiglu_moe", ExampleShape{64, 8, 2, 16, 24});
  ExpertParallelSplit split = split_expert_parallel(ex.pipeline, 2);
  TrainingProgram t = lower_training(split.token_pipeline(), split.token_outputs, preset("scattermoe"));
  KernelProgram &p = t.program;
  const std::vector<std::string> before = step_names(p, 0, p.steps.size());
  REQUIRE(testing::reads_follow_writes(p)); // the checker holds for the program as lowered

  // The forward: what reads the returned rows (and what reads that) last.
  const size_t out = defer_steps_reading(p, 0, t.forward_steps, {"o_returned"});
  CHECK(out < t.forward_steps);
  for (size_t i = 0; i < t.forward_steps; ++i) {
    const std::vector<std::string> r = step_reads(p.steps[i]);
    const bool reads = std::find(r.begin(), r.end(), "o_returned") != r.end();
    if (i < out)
      CHECK(!reads);
  }
  CHECK(testing::reads_follow_writes(p));
  CHECK(in_order(step_names(p, 0, out), before));
  CHECK(in_order(step_names(p, out, t.forward_steps), before));

  // The backward: what the returned rows' gradient needs first, the rest after.
  const std::string grad = t.gradient_of("o_returned");
  const size_t needed = defer_steps_not_needed_for(p, t.forward_steps, p.steps.size(), {grad});
  CHECK(needed > t.forward_steps);
  CHECK(needed < p.steps.size());
  bool written = false;
  for (size_t i = t.forward_steps; i < needed; ++i) {
    const std::vector<std::string> o = step_outputs(p.steps[i]);
    written = written || std::find(o.begin(), o.end(), grad) != o.end();
  }
  CHECK(written);
  CHECK(testing::reads_follow_writes(p));
  CHECK(in_order(step_names(p, t.forward_steps, needed), before));
  CHECK(in_order(step_names(p, needed, p.steps.size()), before));
}
