// `run --check` on a sample of the tokens (tools/sampled_check.h): which
// layers allow it, that the reference on the sampled tokens gives exactly
// their rows of the whole batch, and what the CLI says and checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <sstream>

#include "backends/reference/evaluate.h"
#include "dsl/losses.h"
#include "examples/aux_loss_example.h"
#include "examples/examples.h"
#include "tools/cli.h"
#include "tools/sampled_check.h"

using namespace moeforge;

namespace {

bool has(const std::string &text, const std::string &part) { return text.find(part) != std::string::npos; }

} // namespace

TEST_CASE("sampled check: token-wise layers allow it, reductions over the tokens do not") {
  ExampleShape s;
  for (const char *name : {"moe_mlp", "swiglu_moe", "geglu_moe", "expert_bias_moe", "shared_expert_moe", "deepseek_moe",
                           "rmsnorm_moe", "dense_mlp"}) {
    INFO(name);
    CHECK(token_sampling_blocker(make_example(name, s).pipeline) == "");
  }
  CHECK(token_sampling_blocker(make_example("attention", s).pipeline) == "'p' takes a softmax over the tokens");
  // An auxiliary loss averages over the tokens.
  AuxLossLayer aux = make_aux_loss_example("moe_mlp", s);
  CHECK(has(token_sampling_blocker(aux.example.pipeline), "sums over the tokens"));
}

TEST_CASE("sampled check: the reference on the sampled tokens gives their rows of the whole batch") {
  for (const char *name : {"moe_mlp", "swiglu_moe", "deepseek_moe", "rmsnorm_moe"}) {
    INFO(name);
    ExampleShape s{300, 16, 4, 64, 96};
    Example ex = make_example(name, s);
    TensorMap in = ex.random_inputs(s, 8);
    EvalResult all = evaluate(ex.pipeline, in);
    TokenSample sample = sample_tokens(ex.pipeline, in, s.tokens, 40, 3);
    REQUIRE(sample.tokens.size() == 40u);
    CHECK(std::is_sorted(sample.tokens.begin(), sample.tokens.end()));
    CHECK(std::adjacent_find(sample.tokens.begin(), sample.tokens.end()) == sample.tokens.end());
    CHECK(sample.inputs.at("x").shape == std::vector<int64_t>{40, 64});
    CHECK(sample.inputs.at("w1").shape == in.at("w1").shape); // weights whole
    EvalResult part = evaluate(ex.pipeline, sample.inputs);
    for (const auto &[func, values] : part.values) {
      INFO(func);
      HostTensor rows = sample_rows(ex.pipeline, func, all[func], sample);
      REQUIRE(rows.shape == values.shape);
      // Per-token arithmetic: the same numbers, up to the order Eigen sums a
      // GEMM's rows in.
      CHECK(max_normalized_error(rows, values) < 1e-12);
    }
    // The routing of the sampled tokens is theirs in the whole batch.
    const RoutingResult &r_all = all.routes.begin()->second, &r_part = part.routes.begin()->second;
    for (size_t i = 0; i < sample.tokens.size(); ++i)
      for (int slot = 0; slot < r_all.k; ++slot)
        CHECK(r_part.expert[i * r_all.k + slot] == r_all.expert[sample.tokens[i] * r_all.k + slot]);
  }
}

TEST_CASE("sampled check: the sample evaluated in token groups on threads gives the one evaluation's values") {
  for (const char *name : {"moe_mlp", "swiglu_moe", "deepseek_moe", "rmsnorm_moe", "shared_expert_moe"}) {
    INFO(name);
    ExampleShape s{300, 16, 4, 64, 96};
    Example ex = make_example(name, s);
    TokenSample sample = sample_tokens(ex.pipeline, ex.random_inputs(s, 9), s.tokens, 37, 4);
    EvalResult one = evaluate(ex.pipeline, sample.inputs);
    for (int groups : {1, 2, 3, 7, 37, 100}) {
      INFO(groups << " groups");
      EvalResult split = evaluate_sample(ex.pipeline, sample, groups);
      REQUIRE(split.values.size() == one.values.size());
      for (const auto &[func, values] : one.values) {
        INFO(func);
        CHECK(split.values.at(func).shape == values.shape);
        // Per-token arithmetic: the same numbers, up to the order Eigen sums
        // a GEMM's rows in (which can depend on the row count).
        CHECK(max_normalized_error(split.values.at(func), values) < 1e-12);
      }
      const RoutingResult &a = one.routes.begin()->second, &b = split.routes.at(one.routes.begin()->first);
      CHECK(a.tokens == b.tokens);
      CHECK(a.token == b.token);
      CHECK(a.expert == b.expert);
      CHECK(split.extents == one.extents);
    }
  }
}

#ifdef MOEFORGE_HAVE_CPU_BACKEND
TEST_CASE("sampled check: run --check samples 64 tokens where it can, --check=full checks every one") {
  auto cli = [](const std::vector<std::string> &args, std::string &out) {
    std::ostringstream o, e;
    int code = run_cli(args, o, e);
    out = o.str();
    return code;
  };
  std::string out;
  CHECK(cli({"run", "moe_mlp", "--tokens", "500", "--backend", "cpu", "--check"}, out) == 0);
  CHECK(has(out, "check     64 of 500 tokens, drawn at random, with their routing (--check=full: every token)"));
  CHECK(has(out, "check     y                max |ours - ref| / max |ref| ="));
  CHECK(!has(out, "FAIL"));
  CHECK(cli({"run", "moe_mlp", "--tokens", "500", "--backend", "cpu", "--check=full"}, out) == 0);
  CHECK(!has(out, "tokens, drawn at random"));
  CHECK(has(out, "check     y "));
  // Few tokens: all of them, no sampling said.
  CHECK(cli({"run", "moe_mlp", "--tokens", "40", "--backend", "cpu", "--check"}, out) == 0);
  CHECK(!has(out, "drawn at random"));
  CHECK(cli({"run", "attention", "--tokens", "100", "--backend", "cpu", "--check"}, out) == 0);
  CHECK(has(out, "check     every token: 'p' takes a softmax over the tokens"));
}
#endif
