// An expert-parallel training step with its ranks emulated in one process:
// each side of split_expert_parallel evaluated by a given evaluator (the
// reference, or a backend), rows moved by the host loopback exchange. The
// tests compare it with the unsplit layer over every rank's tokens.
#pragma once

#include <doctest/doctest.h>

#include <functional>
#include <string>
#include <vector>

#include "backends/reference/evaluate.h"
#include "dsl/training.h"
#include "lowering/expert_parallel_split.h"
#include "runtime/expert_exchange_host.h"

namespace moeforge::testing {

// The values of every Func of `p` on `inputs` and the experts route `route`
// chose (pair order), by whatever evaluator the test checks.
struct Evaluated {
  TensorMap values;
  std::vector<int32_t> experts;
};
using Evaluator = std::function<Evaluated(const Pipeline &p, const TensorMap &inputs, const std::string &route)>;

inline Evaluator reference_evaluator() {
  return [](const Pipeline &p, const TensorMap &inputs, const std::string &route) {
    EvalResult r = evaluate(p, inputs);
    return Evaluated{r.values, r.routes.at(route).expert};
  };
}

inline HostTensor row_slice(const HostTensor &t, int64_t begin, int64_t end) {
  std::vector<int64_t> shape = t.shape;
  shape[0] = end - begin;
  HostTensor s(shape);
  const int64_t w = t.size() / t.shape[0];
  std::copy(t.data.begin() + begin * w, t.data.begin() + end * w, s.data.begin());
  return s;
}

inline HostTensor row_concat(const std::vector<HostTensor> &parts) {
  std::vector<int64_t> shape = parts.front().shape;
  shape[0] = 0;
  for (const HostTensor &p : parts)
    shape[0] += p.shape[0];
  HostTensor out(shape);
  size_t at = 0;
  for (const HostTensor &p : parts) {
    std::copy(p.data.begin(), p.data.end(), out.data.begin() + at);
    at += p.data.size();
  }
  return out;
}

struct EmulatedStep {
  std::vector<TensorMap> token;   // per rank: the token side's values (y, d_x, d_wr, ...)
  std::vector<TensorMap> experts; // per rank: the expert side's values (d_w1 of its experts, ...)
  std::vector<int64_t> received;  // rows each rank's experts computed
};

// One step over `ranks` ranks: rank q's tokens are rows [bounds[q],
// bounds[q+1]) of the layer's token Inputs (and of the upstream gradient
// `seed` of output `output` when training); every rank holds the token
// side's Params and its slice of the experts' Params.
inline EmulatedStep emulate_expert_parallel(const ExpertParallelSplit &split, const TensorMap &inputs,
                                            const std::vector<int64_t> &bounds, const Evaluator &eval,
                                            const HostTensor *seed = nullptr, const std::string &output = "y") {
  const int R = split.ranks;
  REQUIRE(static_cast<int>(bounds.size()) == R + 1);
  const Pipeline token = split.token_pipeline(), experts = split.expert_pipeline();
  const bool training = seed != nullptr;
  const TrainingAlgebra *token_training = nullptr, *expert_training = nullptr;
  std::unique_ptr<TrainingAlgebra> tt, et;
  if (training) {
    tt = std::make_unique<TrainingAlgebra>(training_algebra(token, split.token_outputs));
    et = std::make_unique<TrainingAlgebra>(training_algebra(experts, split.expert_outputs));
    token_training = tt.get();
    expert_training = et.get();
  }
  const Pipeline &token_p = training ? token_training->pipeline : token;
  const Pipeline &expert_p = training ? expert_training->pipeline : experts;
  const int64_t k = [&] {
    for (const RoutingPtr &r : token.routes())
      if (r->name == split.route)
        return static_cast<int64_t>(r->k);
    return int64_t(0);
  }();

  // Each rank's token-side inputs; what arrives later starts as zeros.
  std::vector<TensorMap> in(R);
  for (int q = 0; q < R; ++q) {
    const int64_t tokens = bounds[q + 1] - bounds[q];
    for (const BufferPtr &b : token.buffers()) {
      if (inputs.count(b->name)) {
        const HostTensor &t = inputs.at(b->name);
        const bool per_token = b->dims[0].is_dynamic();
        in[q][b->name] = per_token ? row_slice(t, bounds[q], bounds[q + 1]) : t;
      }
    }
    for (const auto &c : split.returned)
      in[q][c.token_side] = HostTensor({tokens * k, c.width}, 0.0);
    if (training) {
      in[q]["d_" + output] = row_slice(*seed, bounds[q], bounds[q + 1]);
      for (const auto &c : split.dispatched)
        in[q]["d_" + c.token_side] = HostTensor({tokens * k, c.width}, 0.0);
    }
  }
  std::vector<Evaluated> tok(R);
  std::vector<std::vector<int32_t>> routed(R);
  for (int q = 0; q < R; ++q) {
    tok[q] = eval(token_p, in[q], split.route);
    routed[q] = tok[q].experts;
  }
  HostExpertExchange ex(split.experts, R, routed);

  std::vector<TensorMap> ein(R);
  for (int p = 0; p < R; ++p) {
    ein[p][split.selector] = ex.selector(p);
    for (const std::string &name : split.expert_params) {
      const HostTensor &w = inputs.at(name);
      ein[p][name] = row_slice(w, p * split.local_experts, (p + 1) * split.local_experts);
    }
  }
  auto exchange = [&](const std::string &from, const std::string &to, bool out, const std::vector<TensorMap> &src,
                      std::vector<TensorMap> &dst) {
    std::vector<HostTensor> rows;
    for (int q = 0; q < R; ++q)
      rows.push_back(src[q].at(from));
    std::vector<HostTensor> moved = out ? ex.dispatch(rows) : ex.give_back(rows);
    for (int q = 0; q < R; ++q)
      dst[q][to] = moved[q];
  };
  std::vector<TensorMap> tv(R);
  for (int q = 0; q < R; ++q)
    tv[q] = tok[q].values;
  for (const auto &c : split.dispatched)
    exchange(c.token_side, c.expert_side, true, tv, ein);
  if (training) // the experts' upstream gradients are computed below
    for (int p = 0; p < R; ++p)
      for (const auto &c : split.returned)
        ein[p]["d_" + c.expert_side] = HostTensor({ex.received(p), c.width}, 0.0);
  std::vector<TensorMap> ev(R);
  for (int p = 0; p < R; ++p)
    ev[p] = eval(expert_p, ein[p], split.route).values;
  for (const auto &c : split.returned)
    exchange(c.expert_side, c.token_side, false, ev, in);
  for (int q = 0; q < R; ++q)
    tv[q] = eval(token_p, in[q], split.route).values;
  if (training) {
    // The token side's gradients of the returned rows go to the experts;
    // the experts' gradients of the received rows come back.
    for (const auto &c : split.returned)
      exchange("d_" + c.token_side, "d_" + c.expert_side, true, tv, ein);
    for (int p = 0; p < R; ++p)
      ev[p] = eval(expert_p, ein[p], split.route).values;
    for (const auto &c : split.dispatched)
      exchange("d_" + c.expert_side, "d_" + c.token_side, false, ev, in);
    for (int q = 0; q < R; ++q)
      tv[q] = eval(token_p, in[q], split.route).values;
  }
  EmulatedStep step{tv, ev, {}};
  for (int p = 0; p < R; ++p)
    step.received.push_back(ex.received(p));
  return step;
}

} // namespace moeforge::testing
