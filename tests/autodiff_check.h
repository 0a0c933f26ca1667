// Checking reference gradients against central finite differences in f64:
// L = sum(seed * output); dL/dX from grad() against (L(X + h) - L(X - h)) / 2h
// one element at a time.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "backends/reference/evaluate.h"
#include "dsl/moeforge.h"
#include "examples/examples.h"

namespace moeforge::testing {

inline TensorMap only_buffers_of(const Pipeline &p, const TensorMap &all) {
  TensorMap in;
  for (const BufferPtr &b : p.buffers())
    if (all.count(b->name))
      in[b->name] = all.at(b->name);
  return in;
}

// The examples' shape for finite differences: small enough for one forward
// per perturbed element (6 tokens, 4 experts, k = 2, d = 3, f = 4).
inline ExampleShape finite_difference_shape() {
  ExampleShape s;
  s.tokens = 6;
  s.experts = 4;
  s.topk = 2;
  s.d = 3;
  s.f = 4;
  return s;
}

// Random inputs of an example, not rounded to bf16 (f64 differences).
inline TensorMap example_inputs(const Example &ex, const ExampleShape &s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  TensorMap out;
  for (const BufferPtr &bp : ex.pipeline.buffers()) {
    std::vector<int64_t> dims;
    for (const Dim &d : bp->dims)
      dims.push_back(d.is_dynamic() ? s.tokens : d.extent());
    auto it = ex.init_scale.find(bp->name);
    double sc = it == ex.init_scale.end() ? 1.0 : it->second;
    out[bp->name] = random_tensor(dims, rng, -sc, sc, false);
  }
  return out;
}

// L = sum over k of <seed_k, outputs[k]>, and the routes the forward chose.
inline double total_loss(const Pipeline &p, const std::vector<Func> &outputs, const TensorMap &inputs,
                         const std::vector<HostTensor> &seeds, std::map<std::string, RoutingResult> *routes) {
  EvalResult r = evaluate(p, only_buffers_of(p, inputs), Precision::f64);
  double l = 0;
  for (size_t k = 0; k < outputs.size(); ++k) {
    const HostTensor &y = r[outputs[k].name()];
    for (int64_t i = 0; i < y.size(); ++i)
      l += seeds[k].data[i] * y.data[i];
  }
  *routes = r.routes;
  return l;
}

struct GradCheck {
  int attempted = 0, checked = 0, skipped = 0;
  double worst = 0;
};

// Checks the gradient of every name in `wrt` at up to max_points positions
// each, for L over all the outputs with random seeds (grad(p, outputs)).
// Perturbations that flip a top-k choice are skipped (the selection is a
// constant of the derivative, not of the finite difference).
inline GradCheck check_gradients(const Pipeline &p, const std::vector<Func> &outputs, const TensorMap &inputs,
                                 const std::vector<std::string> &wrt, uint64_t rng_seed = 7, int max_points = 24) {
  std::mt19937_64 rng(rng_seed);
  EvalResult fwd = evaluate(p, only_buffers_of(p, inputs), Precision::f64);
  std::vector<HostTensor> seeds;
  for (const Func &o : outputs)
    seeds.push_back(random_tensor(fwd[o.name()].shape, rng, -1.0, 1.0, false));
  std::map<std::string, RoutingResult> base_routes;
  total_loss(p, outputs, inputs, seeds, &base_routes);

  Gradients g = grad(p, outputs);
  REQUIRE(g.seeds.size() == outputs.size());
  TensorMap with_seeds = inputs;
  for (size_t k = 0; k < outputs.size(); ++k)
    with_seeds[g.seeds[k]] = seeds[k];
  EvalResult back = evaluate(g.pipeline, only_buffers_of(g.pipeline, with_seeds), Precision::f64);

  GradCheck res;
  for (const std::string &name : wrt) {
    const HostTensor &analytic = back[g[name].name()];
    const HostTensor &x = inputs.at(name);
    REQUIRE(analytic.shape == x.shape);
    std::vector<int64_t> pos(static_cast<size_t>(x.size()));
    for (size_t i = 0; i < pos.size(); ++i)
      pos[i] = static_cast<int64_t>(i);
    std::shuffle(pos.begin(), pos.end(), rng);
    if (static_cast<int>(pos.size()) > max_points)
      pos.resize(static_cast<size_t>(max_points));
    for (int64_t at : pos) {
      ++res.attempted;
      double x0 = x.data[at], h = 1e-6 * std::max(1.0, std::fabs(x0));
      TensorMap plus = inputs, minus = inputs;
      plus[name].data[at] = x0 + h;
      minus[name].data[at] = x0 - h;
      std::map<std::string, RoutingResult> rp, rm;
      double lp = total_loss(p, outputs, plus, seeds, &rp), lm = total_loss(p, outputs, minus, seeds, &rm);
      bool stable = true;
      for (const auto &[rn, rr] : base_routes)
        stable &= rp.at(rn).expert == rr.expert && rm.at(rn).expert == rr.expert && rp.at(rn).kept == rr.kept &&
                  rm.at(rn).kept == rr.kept; // expert choice: which tokens an expert keeps
      if (!stable) {
        ++res.skipped;
        continue;
      }
      double fd = (lp - lm) / (2 * h), a = analytic.data[at];
      double err = std::fabs(a - fd) / std::max(std::fabs(fd), 1e-2);
      res.worst = std::max(res.worst, err);
      ++res.checked;
      CHECK_MESSAGE(err <= 1e-6, "d_" << name << "[" << at << "]: grad " << a << " vs finite difference " << fd);
    }
  }
  return res;
}

// One output.
inline GradCheck check_gradients(const Pipeline &p, const Func &out, const TensorMap &inputs,
                                 const std::vector<std::string> &wrt, uint64_t rng_seed = 7, int max_points = 30) {
  return check_gradients(p, std::vector<Func>{out}, inputs, wrt, rng_seed, max_points);
}

} // namespace moeforge::testing
