// FP8 operands of a contraction: the rounding rule every evaluator of a
// Schedule::fp8 choice shares (the reference, the CPU backend, the tests'
// oracles), so that a backend's FP8 product and the reference's are the same
// numbers before any summing starts.
//
// An operand is its bf16 value (what the compiled GEMMs multiply, whatever
// the algebra declares): a value near the middle of two FP8 values rounds to
// either, and a bf16 rounding moves it by up to 2^-9 of itself, so FP8 of the
// exact value and FP8 of the stored one differ by a whole FP8 step (2^-4) on
// about one element in sixteen; from the bf16 value every evaluator agrees.
// It is split into blocks; each block is divided by a scale, rounded
// to the format (round to nearest, ties to even, saturating at the largest
// finite value: an overflow must not become an infinity that poisons every
// sum it enters), and multiplied back. The blocks follow DeepSeek-V3's recipe:
// 128 elements along the contracted index; across it, one row for an operand
// over the tokens or the routed pairs (an activation or a gradient: a
// token's values have their own range), and 128 for a weight, so one block
// grid serves W and its transpose (the forward's product and the backward's
// input gradient quantise a weight once).
//
// The scale is a power of two, the smallest whose multiple of the format's
// largest value covers the block's largest magnitude (as OCP's microscaling
// formats and DeepGEMM's UE8M0 scales do), not amax / max. Dividing by a
// power of two is exact, and so is the dequantised value q * scale (4 or 3
// significant bits, in bf16, f32 or f64 alike), so every backend and the
// reference hold the same dequantised operand bit for bit, and a product over
// dequantised values equals the scales times the product of the FP8 values:
// the GPU's FP8 tensor cores with per-block promotion and the CPU's plain
// product of dequantised values compute the same sum. The price is up to one
// binade of range at the top of each block (its largest value lands in
// (max / 2, max] instead of at max).
#pragma once

#include <cstdint>
#include <string>

namespace moeforge {

enum class Fp8Format {
  e4m3, // 4 exponent bits, 3 mantissa bits: largest 448, smallest 2^-9 (OCP's "E4M3FN": no infinities)
  e5m2, // 5 exponent bits, 2 mantissa bits: largest 57344, smallest 2^-16
};

const char *fp8_format_name(Fp8Format f);
// Parses "e4m3" or "e5m2"; throws UserError naming the choices otherwise.
Fp8Format parse_fp8_format(const std::string &name);

// Elements per block along the contracted index, and across it for a weight.
constexpr int fp8_block = 128;

// The format's largest finite magnitude.
double fp8_max(Fp8Format f);
// x rounded to the nearest value of the format, ties to even, saturating at
// +-fp8_max; NaN stays NaN, an infinity saturates.
double round_to_fp8(double x, Fp8Format f);
// The power-of-two scale of a block whose largest magnitude is amax: the
// smallest 2^e with amax <= fp8_max * 2^e; 1 for a block of zeros.
double fp8_block_scale(double amax, Fp8Format f);

// A row-major matrix of `rows` x `cols` values, row i at data + i * ld,
// rounded in place block by block (blocks of block_rows x block_cols from
// the first element, ragged at the ends): each value v becomes
// round_to_fp8(v / s) * s with s its block's fp8_block_scale.
template <typename T>
void fp8_round_blocks(T *data, int64_t rows, int64_t cols, int64_t ld, int64_t block_rows, int64_t block_cols,
                      Fp8Format f);

} // namespace moeforge
