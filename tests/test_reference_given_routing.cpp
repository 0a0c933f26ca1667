// The reference under a routing given from outside (evaluate(..., given)):
// what a backend's values are compared against when a near-tie of two
// selection scores went the other way under bf16 rounding. The given
// experts replace the selection only; the gates and everything after are
// computed from them as usual.
#include <doctest/doctest.h>

#include <string>

#include "backends/reference/evaluate.h"
#include "dsl/error.h"
#include "examples/examples.h"
#include "user_error.h"

using namespace moeforge;

using Given = std::map<std::string, std::vector<int32_t>>;

namespace {
bool has(const std::string &text, const std::string &part) { return text.find(part) != std::string::npos; }
} // namespace

TEST_CASE("given routing: the reference's own experts give its own values exactly") {
  for (const char *name : {"moe_mlp", "swiglu_moe", "deepseek_moe"}) {
    INFO(name);
    ExampleShape s{40, 16, 4, 32, 48};
    Example ex = make_example(name, s);
    TensorMap in = ex.random_inputs(s, 5);
    EvalResult ref = evaluate(ex.pipeline, in);
    EvalResult again = evaluate(ex.pipeline, in, Precision::f64, Given{{ex.route, ref.routes.at(ex.route).expert}});
    CHECK(again.routes.at(ex.route).expert == ref.routes.at(ex.route).expert);
    for (const auto &[func, value] : ref.values) {
      INFO(func);
      CHECK(again.values.at(func).data == value.data);
    }
  }
}

TEST_CASE("given routing: another routing is followed, with gates read at the given experts") {
  ExampleShape s{24, 8, 2, 16, 32};
  Example ex = make_example("moe_mlp", s); // gate = probs(token, expert), not renormalised
  TensorMap in = ex.random_inputs(s, 6);
  EvalResult ref = evaluate(ex.pipeline, in);
  // Every token's two slots swapped, and token 0's second expert replaced
  // by one it was not routed to.
  std::vector<int32_t> swapped = ref.routes.at(ex.route).expert;
  for (size_t p = 0; p < swapped.size(); p += 2)
    std::swap(swapped[p], swapped[p + 1]);
  int32_t other = 0;
  while (other == swapped[0] || other == swapped[1])
    ++other;
  swapped[1] = other;
  EvalResult got = evaluate(ex.pipeline, in, Precision::f64, Given{{ex.route, swapped}});
  CHECK(got.routes.at(ex.route).expert == swapped);
  const HostTensor &probs = got.values.at("probs");
  const HostTensor &gate = got.values.at("route_gate");
  for (int64_t r = 0; r < s.tokens * s.topk; ++r)
    CHECK(gate.data[r] == probs.at({r / s.topk, swapped[r]}));
  // Token 0's second expert changed, so its output row did.
  bool row0_moved = false;
  for (int64_t i = 0; i < s.d; ++i)
    row0_moved |= got.values.at("y").at({0, i}) != ref.values.at("y").at({0, i});
  CHECK(row0_moved);
}

TEST_CASE("given routing: a wrong count, an expert out of range or chosen twice, an unknown route") {
  ExampleShape s{6, 8, 2, 16, 32};
  Example ex = make_example("moe_mlp", s);
  TensorMap in = ex.random_inputs(s, 7);
  std::vector<int32_t> ok(12, 0);
  for (size_t p = 0; p < ok.size(); ++p)
    ok[p] = static_cast<int32_t>(p % 2);
  auto error_with = [&](std::map<std::string, std::vector<int32_t>> given) {
    return testing::user_error_of([&] { evaluate(ex.pipeline, in, Precision::f64, given); });
  };
  CHECK_NOTHROW(evaluate(ex.pipeline, in, Precision::f64, Given{{ex.route, ok}}));
  CHECK(has(error_with({{ex.route, std::vector<int32_t>(11, 0)}}), "11 experts given, but 6 tokens x k = 2 needs 12"));
  std::vector<int32_t> bad = ok;
  bad[4] = 8;
  CHECK(has(error_with({{ex.route, bad}}), "expert 8 given for token 2, outside 0..7"));
  bad = ok;
  bad[5] = bad[4];
  CHECK(has(error_with({{ex.route, bad}}), "expert 0 given twice for token 2"));
  CHECK(has(error_with({{"nosuch", ok}}), "experts given for 'nosuch', which is not a route of this pipeline"));
}
