#include "backends/cpu/fp8_operands.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "dsl/error.h"
#include "runtime/tensor.h"

namespace moeforge::cpu {

namespace {

bool over_tokens(const TensorDecl &t) {
  return std::any_of(t.dims.begin(), t.dims.end(), [](const Dim &d) { return d.is_dynamic(); });
}

// A tensor's values as floats, and back into its dtype's bytes.
std::vector<float> values_of(const TensorDecl &t, const std::vector<int64_t> &shape, const uint8_t *bytes,
                             size_t size) {
  internal_check(t.dtype == DType::f32 || t.dtype == DType::bf16)
      << "FP8 operand '" << t.name << "' is " << dtype_name(t.dtype);
  internal_check(shape.size() >= 2 && shape.size() <= 3) << "FP8 operand '" << t.name << "' of rank " << shape.size();
  const int64_t n = static_cast<int64_t>(size) / dtype_bytes(t.dtype);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (t.dtype == DType::f32) {
      std::memcpy(&v[static_cast<size_t>(i)], bytes + i * 4, 4);
    } else {
      uint16_t b;
      std::memcpy(&b, bytes + i * 2, 2);
      v[static_cast<size_t>(i)] = bf16_value(b);
    }
  }
  return v;
}

std::vector<uint8_t> bytes_of(const TensorDecl &t, const std::vector<float> &v) {
  std::vector<uint8_t> out(v.size() * static_cast<size_t>(dtype_bytes(t.dtype)));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t.dtype == DType::f32) {
      std::memcpy(out.data() + i * 4, &v[i], 4);
    } else {
      // Exact: a rounded value has at most 4 significant bits.
      const uint16_t b = bf16_bits(v[i]);
      std::memcpy(out.data() + i * 2, &b, 2);
    }
  }
  return out;
}

} // namespace

std::vector<Fp8Operand> fp8_operands(const GemmStep &g) {
  std::vector<Fp8Operand> out;
  auto add = [&](const std::string &name, bool k_last) {
    auto same = [&](const Fp8Operand &o) { return o.tensor == name; };
    if (std::none_of(out.begin(), out.end(), same))
      out.push_back({name, k_last});
    else
      internal_check(std::find_if(out.begin(), out.end(), same)->k_last == k_last)
          << "GEMM " << g.name << " reads '" << name << "' along two axes";
  };
  add(g.a, !g.a_trans);
  for (const std::string &b : g.b)
    add(b, g.b_trans);
  if (g.chained) {
    add(g.chained->a, !g.a_trans);
    add(g.chained->b, g.b_trans);
  }
  return out;
}

void check_fp8_gemms(const KernelProgram &program) {
  for (const Step &s : program.steps) {
    const auto *g = std::get_if<GemmStep>(&s);
    if (!g || !g->fp8)
      continue;
    if (g->expert_k)
      for (const auto &[name, map] : {std::pair{g->a, g->a_rows}, std::pair{g->b[0], g->b_rows}}) {
        const RowLayout l = program.tensor(name).layout;
        const bool per_pair =
            (map == RowMap::direct && (l == RowLayout::padded || l == RowLayout::padded_t || l == RowLayout::sorted)) ||
            (map == RowMap::gather_pair && l == RowLayout::pair);
        user_check(per_pair) << "definition '" << func_of(*g) << "': its weight gradient reads '" << name
                             << "' by each pair's token row; FP8 blocks of a weight gradient run over each "
                             << "expert's pairs, so a token's row would round differently in each expert. "
                             << "Schedule padded_elementwise(true), gather_in_gemms(false) and "
                             << "gather_upstream_in_gemms(false) (the GEMM then reads a per-pair copy), or drop "
                             << "fp8(\"" << func_of(*g) << "\", ...)";
      }
    const std::vector<std::string> reads = step_reads(s);
    for (const Fp8Operand &o : fp8_operands(*g)) {
      user_check(std::count(reads.begin(), reads.end(), o.tensor) == 1)
          << "definition '" << func_of(*g) << "': its GEMM reads '" << o.tensor << "' beside the product (in its "
          << "epilogue), which FP8 operands do not support yet: drop fp8(\"" << func_of(*g) << "\", ...) or "
          << "fuse_epilogue(\"" << func_of(*g) << "\", false)";
      const TensorDecl &t = program.tensor(o.tensor);
      user_check(!over_tokens(t) || t.dims.size() == 2)
          << "definition '" << func_of(*g) << "': FP8 operand '" << o.tensor << "' has " << t.dims.size()
          << " dimensions; an operand over the tokens is rounded as a matrix (rows, k)";
    }
  }
}

std::vector<uint8_t> fp8_rounded_copy(const TensorDecl &t, const std::vector<int64_t> &shape, const uint8_t *bytes,
                                      size_t size, bool k_last, Fp8Format format) {
  std::vector<float> v = values_of(t, shape, bytes, size);
  const int64_t n = static_cast<int64_t>(v.size());
  const int64_t rows = shape[shape.size() - 2], cols = shape.back();
  if (over_tokens(t)) {
    // Rows past the current count (a padded tensor's bound) round on their
    // own too: a block never spans two rows, or two columns of a transpose.
    const int64_t stored_rows = n / cols;
    fp8_round_blocks(v.data(), stored_rows, cols, cols, k_last ? 1 : fp8_block, k_last ? fp8_block : 1, format);
  } else {
    // Each expert's matrix at its stride (a Param inside a larger tensor
    // keeps the other half's bytes between them, which stay as they are).
    if (shape.size() == 2) {
      fp8_round_blocks(v.data(), rows, cols, t.outer_stride ? t.outer_stride : cols, fp8_block, fp8_block, format);
    } else {
      const int64_t stride = t.outer_stride ? t.outer_stride : rows * cols;
      for (int64_t e = 0; e < shape[0]; ++e)
        fp8_round_blocks(v.data() + e * stride, rows, cols, cols, fp8_block, fp8_block, format);
    }
  }
  return bytes_of(t, v);
}

std::vector<uint8_t> fp8_rounded_expert_copy(const TensorDecl &t, const std::vector<int64_t> &shape,
                                             const uint8_t *bytes, size_t size, RowMap rows, const ExpertRows &route,
                                             Fp8Format format) {
  std::vector<float> v = values_of(t, shape, bytes, size);
  internal_check(shape.size() == 2) << "weight-gradient operand '" << t.name << "' of rank " << shape.size();
  // Stored [pairs, cols], or transposed [cols, pairs] (padded_t).
  const bool transposed = t.layout == RowLayout::padded_t;
  const int64_t cols = transposed ? shape[0] : shape[1], stride = shape[1];
  auto row_of = [&](int64_t e, int64_t rank) -> int64_t {
    if (t.layout == RowLayout::sorted)
      return route.offsets_unpadded[e] + rank;
    if (rows == RowMap::gather_pair)
      return route.sorted_pair[route.offsets[e] + rank];
    return route.offsets[e] + rank; // padded, padded_t
  };
  std::vector<int64_t> block_rows;
  for (int64_t e = 0; e < route.experts; ++e)
    for (int64_t r0 = 0; r0 < route.counts[e]; r0 += fp8_block) {
      block_rows.clear();
      for (int64_t r = r0; r < std::min<int64_t>(route.counts[e], r0 + fp8_block); ++r)
        block_rows.push_back(row_of(e, r));
      for (int64_t c = 0; c < cols; ++c) {
        auto at = [&](int64_t row) -> float & {
          return v[static_cast<size_t>(transposed ? c * stride + row : row * stride + c)];
        };
        double amax = 0;
        for (int64_t row : block_rows)
          amax = std::max(amax, std::fabs(static_cast<double>(at(row))));
        const double s = fp8_block_scale(amax, format);
        for (int64_t row : block_rows)
          at(row) = static_cast<float>(round_to_fp8(static_cast<double>(at(row)) / s, format) * s);
      }
    }
  return bytes_of(t, v);
}

} // namespace moeforge::cpu
