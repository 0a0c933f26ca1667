#include "dsl/fp8.h"

#include <algorithm>
#include <cmath>

#include "dsl/error.h"

namespace moeforge {

namespace {

struct Fp8Layout {
  int mantissa_bits;
  int min_normal_exp; // the smallest normal value is 2^min_normal_exp
  double max;
};

Fp8Layout layout_of(Fp8Format f) {
  // e4m3 (bias 7) keeps exponent 15 for finite values (its only NaN is
  // S.1111.111), so its largest value is 1.75 * 2^8; e5m2 (bias 15) keeps
  // IEEE's infinities, so its largest is 1.75 * 2^15.
  return f == Fp8Format::e4m3 ? Fp8Layout{3, -6, 448.0} : Fp8Layout{2, -14, 57344.0};
}

} // namespace

const char *fp8_format_name(Fp8Format f) { return f == Fp8Format::e4m3 ? "e4m3" : "e5m2"; }

Fp8Format parse_fp8_format(const std::string &name) {
  if (name == "e4m3")
    return Fp8Format::e4m3;
  if (name == "e5m2")
    return Fp8Format::e5m2;
  user_error << "unknown FP8 format '" << name << "': use e4m3 (weights and activations) or e5m2 (wider range)";
}

double fp8_max(Fp8Format f) { return layout_of(f).max; }

double round_to_fp8(double x, Fp8Format f) {
  if (std::isnan(x) || x == 0)
    return x;
  const Fp8Layout l = layout_of(f);
  const double a = std::fabs(x);
  if (a >= l.max)
    return std::copysign(l.max, x);
  // The spacing of the format's values around a: 2^(e - mantissa_bits) for
  // a in [2^e, 2^(e+1)), and the subnormals' fixed spacing below the
  // smallest normal. nearbyint under the default rounding mode rounds half
  // to even, and a / spacing is exact (a power-of-two division).
  const int e = std::max(std::ilogb(a), l.min_normal_exp);
  const double spacing = std::ldexp(1.0, e - l.mantissa_bits);
  const double q = std::nearbyint(a / spacing) * spacing;
  return std::copysign(std::min(q, l.max), x);
}

double fp8_block_scale(double amax, Fp8Format f) {
  if (!(amax > 0) || std::isinf(amax))
    return 1.0; // zeros (or a NaN / infinity the rounding passes on or saturates)
  const double max = fp8_max(f);
  int e = std::ilogb(amax) - std::ilogb(max);
  while (std::ldexp(max, e) < amax)
    ++e;
  while (std::ldexp(max, e - 1) >= amax)
    --e;
  return std::ldexp(1.0, e);
}

template <typename T>
void fp8_round_blocks(T *data, int64_t rows, int64_t cols, int64_t ld, int64_t block_rows, int64_t block_cols,
                      Fp8Format f) {
  internal_check(block_rows > 0 && block_cols > 0) << "FP8 blocks of " << block_rows << " x " << block_cols;
  for (int64_t r0 = 0; r0 < rows; r0 += block_rows)
    for (int64_t c0 = 0; c0 < cols; c0 += block_cols) {
      const int64_t r1 = std::min(rows, r0 + block_rows), c1 = std::min(cols, c0 + block_cols);
      double amax = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c)
          amax = std::max(amax, std::fabs(static_cast<double>(data[r * ld + c])));
      const double s = fp8_block_scale(amax, f);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) {
          T &v = data[r * ld + c];
          v = static_cast<T>(round_to_fp8(static_cast<double>(v) / s, f) * s);
        }
    }
}

template void fp8_round_blocks<double>(double *, int64_t, int64_t, int64_t, int64_t, int64_t, Fp8Format);
template void fp8_round_blocks<float>(float *, int64_t, int64_t, int64_t, int64_t, int64_t, Fp8Format);

} // namespace moeforge
