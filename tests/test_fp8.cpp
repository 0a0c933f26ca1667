// dsl/fp8.h: the FP8 rounding every evaluator of a Schedule::fp8 choice
// shares, checked against the formats' bit patterns decoded here on their own.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "dsl/fp8.h"
#include "user_error.h"

using namespace moeforge;

namespace {

// The value of an FP8 bit pattern, decoded from the formats' definitions
// (OCP 8-bit floating point, v1.0): e4m3 has bias 7 and only S.1111.111 as
// NaN; e5m2 has bias 15 and IEEE's infinities and NaNs at exponent 31.
double decode(uint8_t b, Fp8Format f) {
  const double sign = (b & 0x80) ? -1.0 : 1.0;
  if (f == Fp8Format::e4m3) {
    const int e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7)
      return std::numeric_limits<double>::quiet_NaN();
    return sign * (e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10));
  }
  const int e = (b >> 2) & 31, m = b & 3;
  if (e == 31)
    return m ? std::numeric_limits<double>::quiet_NaN() : sign * std::numeric_limits<double>::infinity();
  return sign * (e == 0 ? std::ldexp(m, -16) : std::ldexp(4 + m, e - 17));
}

// Every finite non-negative value of the format, ascending.
std::vector<double> finite_values(Fp8Format f) {
  std::set<double> s;
  for (int b = 0; b < 128; ++b)
    if (double v = decode(static_cast<uint8_t>(b), f); std::isfinite(v))
      s.insert(v);
  return {s.begin(), s.end()};
}

// Whether v is the format's value with an even last mantissa bit.
bool even_mantissa(double v, Fp8Format f) {
  for (int b = 0; b < 128; ++b)
    if (decode(static_cast<uint8_t>(b), f) == v)
      return (b & 1) == 0;
  return false;
}

} // namespace

TEST_CASE("fp8: every value of either format rounds to itself, and the largest is the format's") {
  for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    CAPTURE(fp8_format_name(f));
    const std::vector<double> v = finite_values(f);
    CHECK(v.size() == (f == Fp8Format::e4m3 ? 127u : 124u));
    CHECK(v.back() == fp8_max(f));
    CHECK(v[1] == (f == Fp8Format::e4m3 ? std::ldexp(1.0, -9) : std::ldexp(1.0, -16)));
    for (double x : v) {
      CHECK(round_to_fp8(x, f) == x);
      CHECK(round_to_fp8(-x, f) == -x);
    }
  }
}

TEST_CASE("fp8: rounding goes to the nearest value, ties to the even one, and saturates") {
  for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    CAPTURE(fp8_format_name(f));
    const std::vector<double> v = finite_values(f);
    for (size_t i = 0; i + 1 < v.size(); ++i) {
      const double lo = v[i], hi = v[i + 1], mid = (lo + hi) / 2, gap = hi - lo;
      CAPTURE(lo);
      CHECK(round_to_fp8(mid, f) == (even_mantissa(lo, f) ? lo : hi));
      CHECK(round_to_fp8(mid - gap / 64, f) == lo);
      CHECK(round_to_fp8(mid + gap / 64, f) == hi);
      CHECK(round_to_fp8(-(mid + gap / 64), f) == -hi);
    }
    CHECK(round_to_fp8(fp8_max(f) * 1.01, f) == fp8_max(f));
    CHECK(round_to_fp8(-1e30, f) == -fp8_max(f));
    CHECK(round_to_fp8(std::numeric_limits<double>::infinity(), f) == fp8_max(f));
    CHECK(std::isnan(round_to_fp8(std::nan(""), f)));
    // Below half the smallest subnormal a value is zero, keeping its sign.
    const double tiny = v[1] / 4;
    CHECK(round_to_fp8(tiny, f) == 0);
    CHECK(std::signbit(round_to_fp8(-tiny, f)));
  }
}

TEST_CASE("fp8: a block's scale is the smallest power of two that brings its largest value under the format's") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  for (Fp8Format f : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    for (int e = -40; e <= 40; ++e) {
      const double amax = std::ldexp(mantissa(rng), e);
      const double s = fp8_block_scale(amax, f);
      int exp = 0;
      CHECK(std::frexp(s, &exp) == 0.5); // a power of two
      CHECK(amax / s <= fp8_max(f));
      CHECK(amax / s > fp8_max(f) / 2);
    }
    CHECK(fp8_block_scale(fp8_max(f), f) == 1.0);
    CHECK(fp8_block_scale(0.0, f) == 1.0);
  }
  CHECK(parse_fp8_format("e5m2") == Fp8Format::e5m2);
  CHECK(testing::user_error_of([] { parse_fp8_format("e3m4"); }).find("unknown FP8 format 'e3m4': use e4m3") !=
        std::string::npos);
}

TEST_CASE("fp8: blocks round on their own, to values the format holds times their scale, once and for all") {
  std::mt19937 rng(11);
  std::normal_distribution<double> normal(0.0, 1.0);
  const int64_t rows = 150, cols = 300, ld = 310; // ragged blocks at both ends, a row stride past the columns
  std::vector<double> x(static_cast<size_t>(rows * ld));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      // Rows of very different ranges: each row's blocks need their own scale.
      x[i * ld + j] = normal(rng) * std::ldexp(1.0, static_cast<int>(i % 23) - 11);
  for (auto [br, bc] : {std::pair<int64_t, int64_t>{1, 128}, {128, 128}, {128, 1}}) {
    CAPTURE(br);
    CAPTURE(bc);
    std::vector<double> q = x;
    fp8_round_blocks(q.data(), rows, cols, ld, br, bc, Fp8Format::e4m3);
    for (int64_t r0 = 0; r0 < rows; r0 += br)
      for (int64_t c0 = 0; c0 < cols; c0 += bc) {
        double amax = 0;
        for (int64_t i = r0; i < std::min(rows, r0 + br); ++i)
          for (int64_t j = c0; j < std::min(cols, c0 + bc); ++j)
            amax = std::max(amax, std::fabs(x[i * ld + j]));
        const double s = fp8_block_scale(amax, Fp8Format::e4m3);
        for (int64_t i = r0; i < std::min(rows, r0 + br); ++i)
          for (int64_t j = c0; j < std::min(cols, c0 + bc); ++j) {
            const double v = x[i * ld + j], got = q[i * ld + j];
            REQUIRE(got == round_to_fp8(v / s, Fp8Format::e4m3) * s);
            // Within half a spacing: 2^-4 of the value for normal values,
            // half the subnormal step below.
            CHECK(std::fabs(got - v) <= std::max(std::ldexp(std::fabs(v), -4), std::ldexp(s, -10)));
          }
      }
    for (int64_t i = 0; i < rows; ++i) // the stride's tail is not touched
      for (int64_t j = cols; j < ld; ++j)
        REQUIRE(q[i * ld + j] == x[i * ld + j]);
    std::vector<double> twice = q;
    fp8_round_blocks(twice.data(), rows, cols, ld, br, bc, Fp8Format::e4m3);
    CHECK(twice == q);
    // float holds the same dequantised values: the scales are powers of two.
    std::vector<float> xf(x.begin(), x.end());
    fp8_round_blocks(xf.data(), rows, cols, ld, br, bc, Fp8Format::e4m3);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        REQUIRE(static_cast<double>(xf[i * ld + j]) == q[i * ld + j]);
  }
}
