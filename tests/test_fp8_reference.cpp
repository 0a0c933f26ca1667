// The reference under Schedule::fp8: a contraction's operands are rounded by
// dsl/fp8.h's block rule before an exact product. Checked against the plain
// reference on operands rounded by hand, and against the error bound the
// rule implies.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backends/reference/evaluate.h"
#include "dsl/moeforge.h"
#include "examples/examples.h"
#include "schedules/schedule.h"
#include "user_error.h"

using namespace moeforge;

namespace {

// Rounds every expert's [rows, cols] slab of a weight [E, rows, cols] in
// 128 x 128 blocks.
HostTensor weight_rounded(HostTensor w, Fp8Format f) {
  const int64_t e = w.shape[0], rows = w.shape[1], cols = w.shape[2];
  for (int64_t x = 0; x < e; ++x)
    fp8_round_blocks(w.data.data() + x * rows * cols, rows, cols, cols, fp8_block, fp8_block, f);
  return w;
}

// A token tensor [T, D] rounded row by row in blocks of 128 along D.
HostTensor rows_rounded(HostTensor x, Fp8Format f) {
  fp8_round_blocks(x.data.data(), x.shape[0], x.shape[1], x.shape[1], 1, fp8_block, f);
  return x;
}

// FP8 operands are rounded from their bf16 values: inputs that bf16 holds
// exactly keep the bound below FP8's own.
double bf16_exact(double v) { return bf16_value(bf16_bits(static_cast<float>(v))); }

double max_abs_diff(const HostTensor &a, const HostTensor &b) {
  REQUIRE(a.shape == b.shape);
  double m = 0;
  for (size_t i = 0; i < a.data.size(); ++i)
    m = std::max(m, std::fabs(a.data[i] - b.data[i]));
  return m;
}

} // namespace

TEST_CASE("fp8 reference: a routed product rounds the tokens' rows and each expert's weight blocks, then is exact") {
  // d and f cut the blocks ragged (320 = 2.5 x 128, 200 = 1.56 x 128).
  const ExampleShape shape{37, 8, 2, 320, 200};
  const Example ex = make_example("swiglu_moe", shape);
  const TensorMap in = ex.random_inputs(shape, 3);
  for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    CAPTURE(fp8_format_name(f));
    const Schedule s = Schedule().fp8("h", f).fp8("o", f);
    EvalOptions fp8;
    fp8.fp8 = s.fp8_funcs(ex.pipeline);
    REQUIRE(fp8.fp8.size() == 2);
    const EvalResult got = evaluate(ex.pipeline, in, Precision::f64, fp8);

    // h from operands rounded beforehand, under the same routing (rounded x
    // would route differently through the router, which stays exact).
    TensorMap rounded = in;
    rounded["x"] = rows_rounded(in.at("x"), f);
    for (const char *w : {"w1", "w3"})
      rounded[w] = weight_rounded(in.at(w), f);
    EvalOptions same_route;
    same_route.given["route"] = got.routes.at("route").expert;
    const EvalResult want = evaluate(ex.pipeline, rounded, Precision::f64, same_route);
    CHECK(max_abs_diff(got["h"], want["h"]) == 0.0);
    // The router's product is not named, so it reads x as it is.
    CHECK(max_abs_diff(got["logits"], evaluate(ex.pipeline, in)["logits"]) == 0.0);

    // o by hand: each pair's h row, as a GEMM reads it (bf16), rounded in blocks
    // along F, its expert's w2 in 128 x 128 blocks.
    const HostTensor w2 = weight_rounded(in.at("w2"), f);
    HostTensor h = got["h"];
    for (double &v : h.data)
      v = bf16_value(bf16_bits(static_cast<float>(v)));
    fp8_round_blocks(h.data.data(), h.shape[0], h.shape[1], h.shape[1], 1, fp8_block, f);
    const RoutingResult &route = got.routes.at("route");
    double worst = 0;
    for (int64_t r = 0; r < h.shape[0]; ++r)
      for (int64_t i = 0; i < shape.d; ++i) {
        double o = 0;
        for (int64_t j = 0; j < shape.f; ++j)
          o += h.at({r, j}) * w2.at({route.expert[static_cast<size_t>(r)], j, i});
        worst = std::max(worst, std::fabs(o - got["o"].at({r, i})) / (1e-30 + std::fabs(o)));
      }
    CHECK(worst < 1e-12);
  }
}

TEST_CASE("fp8 reference: each product stays within the bound the rounding implies, and moves") {
  // out(t, n) = sum(i, x(t, i) w(i, n)). With x' = x (1 + a) + dx and
  // w' = w (1 + b) + dw, |a|, |b| <= u = 2^-(mantissa bits + 1), and dx, dw
  // at most half a subnormal step of their block (values under the smallest
  // normal), each term's error is at most
  //   (2u + u^2) |x w| + (1 + u) (|x| dw + |w| dx) + dx dw.
  const int64_t T = 33, D = 300, N = 260;
  Dim t_dim = Dim::dynamic("T"), d_dim{"D", D}, n_dim{"N", N};
  Var t{"t", t_dim}, i{"i", d_dim}, n{"n", n_dim};
  Input x{"x", {t_dim, d_dim}, DType::f32};
  Param w{"w", {d_dim, n_dim}, DType::f32};
  Func out("out", DType::f32);
  out(t, n) = sum(i, x(t, i) * w(i, n));
  Pipeline p({out});
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal(0.0, 1.0);
  TensorMap in;
  in["x"] = HostTensor({T, D});
  in["w"] = HostTensor({D, N});
  // Rows and columns of very different ranges, small values among large
  // ones: the subnormal terms of the bound are exercised too.
  for (int64_t a = 0; a < T; ++a)
    for (int64_t b = 0; b < D; ++b)
      in["x"].at({a, b}) = bf16_exact(normal(rng) * std::ldexp(1.0, static_cast<int>((a * 7 + b) % 29) - 14));
  for (int64_t a = 0; a < D; ++a)
    for (int64_t b = 0; b < N; ++b)
      in["w"].at({a, b}) = bf16_exact(normal(rng) * std::ldexp(1.0, static_cast<int>(b % 5) - 2));
  const HostTensor exact = evaluate(p, in)["out"];
  for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    CAPTURE(fp8_format_name(f));
    EvalOptions o;
    o.fp8 = Schedule().fp8("*", f).fp8_funcs(p);
    const HostTensor got = evaluate(p, in, Precision::f64, o)["out"];
    const double u = std::ldexp(1.0, f == Fp8Format::e4m3 ? -4 : -3);
    const int sub = f == Fp8Format::e4m3 ? -10 : -17; // half the smallest subnormal
    // Each element's half subnormal step, from its block's scale.
    HostTensor dx_of({T, D}), dw_of({D, N});
    for (int64_t a = 0; a < T; ++a)
      for (int64_t b0 = 0; b0 < D; b0 += 128) {
        double amax = 0;
        for (int64_t c = b0; c < std::min(D, b0 + 128); ++c)
          amax = std::max(amax, std::fabs(in["x"].at({a, c})));
        for (int64_t c = b0; c < std::min(D, b0 + 128); ++c)
          dx_of.at({a, c}) = std::ldexp(fp8_block_scale(amax, f), sub);
      }
    for (int64_t a0 = 0; a0 < D; a0 += 128)
      for (int64_t b0 = 0; b0 < N; b0 += 128) {
        double amax = 0;
        for (int64_t r = a0; r < std::min(D, a0 + 128); ++r)
          for (int64_t c = b0; c < std::min(N, b0 + 128); ++c)
            amax = std::max(amax, std::fabs(in["w"].at({r, c})));
        for (int64_t r = a0; r < std::min(D, a0 + 128); ++r)
          for (int64_t c = b0; c < std::min(N, b0 + 128); ++c)
            dw_of.at({r, c}) = std::ldexp(fp8_block_scale(amax, f), sub);
      }
    double moved = 0, norm = 0;
    for (int64_t a = 0; a < T; ++a)
      for (int64_t b = 0; b < N; ++b) {
        double bound = 0;
        for (int64_t c = 0; c < D; ++c) {
          const double xv = std::fabs(in["x"].at({a, c})), wv = std::fabs(in["w"].at({c, b}));
          const double dx = dx_of.at({a, c}), dw = dw_of.at({c, b});
          bound += (2 * u + u * u) * xv * wv + (1 + u) * (xv * dw + wv * dx) + dx * dw;
        }
        const double err = std::fabs(got.at({a, b}) - exact.at({a, b}));
        REQUIRE(err <= bound * (1 + 1e-12));
        moved += err * err;
        norm += exact.at({a, b}) * exact.at({a, b});
      }
    // The rounding happened: the relative error is FP8's, not float64's.
    CHECK(std::sqrt(moved / norm) > 1e-3);
    CHECK(std::sqrt(moved / norm) < 0.1);
  }
}

TEST_CASE("fp8 schedule: recorded per Func, replayed from text, and only where a contraction is") {
  const Example ex = make_example("swiglu_moe", ExampleShape{});
  const Schedule s = Schedule().fp8("*", Fp8Format::e4m3).fp8("logits", std::nullopt).fp8("o", Fp8Format::e5m2);
  const std::map<std::string, Fp8Format> want{{"h", Fp8Format::e4m3}, {"o", Fp8Format::e5m2}};
  CHECK(s.fp8_funcs(ex.pipeline) == want);
  const Schedule back = Schedule::from_text(s.to_text());
  CHECK(back.to_text() == s.to_text());
  CHECK(back.fp8_funcs(ex.pipeline) == want);
  CHECK(s.to_text().find("fp8(\"logits\", \"off\")") != std::string::npos);
  const std::string bad = testing::user_error_of([] { Schedule::from_text("fp8(\"h\", \"e2m5\")"); });
  CHECK(bad.find("unknown FP8 format 'e2m5': use e4m3") != std::string::npos);
  const std::string not_gemm =
      testing::user_error_of([&] { Schedule().fp8("route_gate", Fp8Format::e4m3).check_names(ex.pipeline); });
  CHECK(not_gemm.find("'route_gate' has no contraction: fp8() applies only to Funcs with a sum(...)") !=
        std::string::npos);
}
