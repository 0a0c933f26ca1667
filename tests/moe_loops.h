// Plain C++ loops for the MoE layer, written from the math and not from the
// evaluator, so that the reference tests compare two independent derivations.
// Everything is double; tensors are HostTensors (row-major).
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <vector>

#include <doctest/doctest.h>

#include "runtime/tensor.h"

namespace moeforge::loops {

inline double gelu(double x) {
  const double c = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x)));
}
inline double silu(double x) { return x / (1.0 + std::exp(-x)); }
inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// out(a, c) = sum_b l(a, b) * r(b, c)
inline HostTensor matmul(const HostTensor &l, const HostTensor &r) {
  int64_t A = l.shape[0], B = l.shape[1], C = r.shape[1];
  HostTensor out({A, C});
  for (int64_t a = 0; a < A; ++a)
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0;
      for (int64_t b = 0; b < B; ++b)
        acc += l.at({a, b}) * r.at({b, c});
      out.at({a, c}) = acc;
    }
  return out;
}

// Softmax of each row.
inline HostTensor softmax_rows(const HostTensor &logits) {
  int64_t T = logits.shape[0], E = logits.shape[1];
  HostTensor p({T, E});
  for (int64_t t = 0; t < T; ++t) {
    double mx = -INFINITY, total = 0;
    for (int64_t e = 0; e < E; ++e)
      mx = std::max(mx, logits.at({t, e}));
    for (int64_t e = 0; e < E; ++e)
      total += (p.at({t, e}) = std::exp(logits.at({t, e}) - mx));
    for (int64_t e = 0; e < E; ++e)
      p.at({t, e}) /= total;
  }
  return p;
}

// The routing as the math states it: for each token, k times take the largest
// remaining probability, scanning experts upwards so ties go to the lower one.
struct Routing {
  std::vector<int32_t> token, expert;
  std::vector<double> gate; // probs(t, e), divided by the k-sum when renormalised
};

inline Routing top_k(const HostTensor &probs, int k, bool renormalize) {
  int64_t T = probs.shape[0], E = probs.shape[1];
  Routing r;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<bool> taken(static_cast<size_t>(E), false);
    double total = 0;
    for (int s = 0; s < k; ++s) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || probs.at({t, e}) > probs.at({t, best})))
          best = e;
      taken[best] = true;
      r.token.push_back(static_cast<int32_t>(t));
      r.expert.push_back(static_cast<int32_t>(best));
      r.gate.push_back(probs.at({t, best}));
      total += probs.at({t, best});
    }
    if (renormalize)
      for (int s = 0; s < k; ++s)
        r.gate[static_cast<size_t>(t * k + s)] /= total;
  }
  return r;
}

struct MoeLoops {
  HostTensor h, o, y; // h(r, j), o(r, i), y(t, i)
};

// The expert MLP per routed pair and the gated combine. With w3 given (rank 3)
// the expert is SwiGLU: silu(x W1) * (x W3); otherwise gelu(x W1).
inline MoeLoops moe(const HostTensor &x, const Routing &route, const HostTensor &w1, const HostTensor &w2,
                    const HostTensor *w3 = nullptr) {
  int64_t T = x.shape[0], D = x.shape[1], F = w1.shape[2];
  int64_t R = static_cast<int64_t>(route.token.size());
  MoeLoops m{HostTensor({R, F}), HostTensor({R, D}), HostTensor({T, D})};
  for (int64_t r = 0; r < R; ++r) {
    int64_t t = route.token[r], e = route.expert[r];
    for (int64_t j = 0; j < F; ++j) {
      double a = 0, b = 0;
      for (int64_t i = 0; i < D; ++i) {
        a += x.at({t, i}) * w1.at({e, i, j});
        if (w3)
          b += x.at({t, i}) * w3->at({e, i, j});
      }
      m.h.at({r, j}) = w3 ? silu(a) * b : gelu(a);
    }
    for (int64_t i = 0; i < D; ++i) {
      double acc = 0;
      for (int64_t j = 0; j < F; ++j)
        acc += m.h.at({r, j}) * w2.at({e, j, i});
      m.o.at({r, i}) = acc;
      m.y.at({t, i}) += route.gate[r] * acc;
    }
  }
  return m;
}

// |a - b| <= tol * max(|b|, floor) everywhere, with a readable failure.
inline void check_close(const HostTensor &a, const HostTensor &b, double tol, const char *what, double floor = 1e-3) {
  INFO("comparing " << what);
  REQUIRE(a.shape == b.shape);
  double err = max_relative_error(a, b, floor);
  INFO("max relative error " << err << " (tolerance " << tol << ")");
  CHECK(err <= tol);
}

} // namespace moeforge::loops
