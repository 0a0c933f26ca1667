// FP8 on the CUDA backend's building blocks (runtime/fp8_kernels.h): the
// block rounding into e4m3 bytes and power-of-two scales, and the batched
// e4m3 GEMM with per-block promotion. In CI: every kernel compiles for
// sm_90a without spills, and bad tiles are refused. On a GPU: the rounding
// equals dsl/fp8.h's to the bit (activations by rows and gathered rows,
// weights in both layouts), and the GEMM equals the float64 product of the
// rounded operands to float32's accumulation error, at sizes that cut
// every tile and block, in both scale orientations and both output types,
// dense batches and routed rows (each padded row's token gathered, its
// expert's weight), the product rounded to e4m3 in its epilogue (equal to
// rounding its stored bf16 output), and a weight gradient summed by expert over blocks of
// 128 of its pairs with a scale per column.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/fp8_kernels.h"
#include "dsl/fp8.h"
#include "gpu_test.h"
#include "runtime/routing_host.h"
#include "runtime/tensor.h"
#include "user_error.h"

using namespace moeforge;

namespace {

// An e4m3 byte's value (OCP 8-bit floating point: bias 7, S.1111.111 NaN).
double decode_e4m3(uint8_t b) {
  const double sign = (b & 0x80) ? -1.0 : 1.0;
  const int e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7)
    return std::numeric_limits<double>::quiet_NaN();
  return sign * (e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10));
}

// Random bf16 values whose range changes from block to block by up to 2^+-20
// (a block's scale then differs from its neighbours'), as floats holding the
// bf16 values and as the bits to upload.
struct Bf16Matrix {
  std::vector<float> value;
  std::vector<uint16_t> bits;
};
Bf16Matrix random_bf16(int64_t rows, int64_t cols, int64_t block_rows, std::mt19937 &rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> binade(-20, 20);
  std::vector<int> shift(static_cast<size_t>(((rows + block_rows - 1) / block_rows) * ((cols + 127) / 128)));
  for (int &s : shift)
    s = binade(rng);
  Bf16Matrix m;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int s = shift[static_cast<size_t>((r / block_rows) * ((cols + 127) / 128) + c / 128)];
      const float v = static_cast<float>(round_to_bf16(std::ldexp(normal(rng), s)));
      m.value.push_back(v);
      m.bits.push_back(bf16_bits(v));
    }
  return m;
}

// The rounded values dsl/fp8.h gives `m` in blocks of block_rows x 128.
std::vector<double> rounded(const Bf16Matrix &m, int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols) {
  std::vector<double> v(m.value.begin(), m.value.end());
  fp8_round_blocks(v.data(), rows, cols, cols, block_rows, block_cols, Fp8Format::e4m3);
  return v;
}

// The device's e4m3 operand decoded: rows x K, scale of (row, k) by `scale_at`.
template <typename ScaleAt>
std::vector<double> decoded(const std::vector<uint8_t> &q, const std::vector<float> &scales, int64_t rows, int64_t K,
                            ScaleAt scale_at) {
  std::vector<double> v(static_cast<size_t>(rows * K));
  const int64_t row_bytes = cuda::fp8_row_bytes(K);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k)
      v[static_cast<size_t>(r * K + k)] =
          decode_e4m3(q[static_cast<size_t>(r * row_bytes + k)]) * scales[static_cast<size_t>(scale_at(r, k))];
  return v;
}

// Whether every byte past K of each row is zero (the GEMM reads them).
bool padding_is_zero(const std::vector<uint8_t> &q, int64_t rows, int64_t K) {
  const int64_t row_bytes = cuda::fp8_row_bytes(K);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = K; k < row_bytes; ++k)
      if (q[static_cast<size_t>(r * row_bytes + k)] != 0)
        return false;
  return true;
}

// How many of a and b differ (bit for bit, as doubles).
int64_t mismatches(const std::vector<double> &a, const std::vector<double> &b) {
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i)
    n += a[i] != b[i];
  return n;
}

// Two distinct experts for each of `tokens` tokens, among the first `used`
// (pair order: token t's at 2t and 2t + 1).
std::vector<int32_t> two_distinct_experts(int64_t tokens, int used, std::mt19937 &rng) {
  std::uniform_int_distribution<int> pick(0, used - 1);
  std::vector<int32_t> expert;
  for (int64_t t = 0; t < tokens; ++t) {
    const int first = pick(rng);
    expert.push_back(first);
    expert.push_back((first + 1 + pick(rng) % (used - 1)) % used);
  }
  return expert;
}

// The float64 sum of a[i * as] b[i * bs] over i < n, and of the products'
// magnitudes (the scale a float32 sum's error is measured against).
struct Dot {
  double sum = 0, magnitude = 0;
};
Dot dot(const double *a, int64_t as, const double *b, int64_t bs, int64_t n) {
  Dot d;
  for (int64_t i = 0; i < n; ++i) {
    const double p = a[i * as] * b[i * bs];
    d.sum += p;
    d.magnitude += std::fabs(p);
  }
  return d;
}

// The worst error of float32 sums against float64 ones, relative to the
// sum of the products' magnitudes (about K * 2^-24 for f32 accumulation),
// and the outputs left unwritten (still the poison's NaN).
struct SumErrors {
  double worst = 0;
  int64_t unwritten = 0;
  void add(float got, double sum, double magnitude) {
    unwritten += !std::isfinite(got);
    worst = std::max(worst, std::fabs(got - sum) / (magnitude + 1e-300));
  }
};

} // namespace

TEST_CASE("cuda: the FP8 kernels compile for sm_90a without spills, their wgmmas whole") {
  for (cuda::Fp8GemmTile tile : {cuda::Fp8GemmTile{128, 4}, cuda::Fp8GemmTile{64, 4}, cuda::Fp8GemmTile{128, 3}}) {
    CAPTURE(tile.columns);
    CAPTURE(tile.stages);
    const cuda::CompileResult r = cuda::compile_fp8_kernels("sm_90a", tile);
    for (const std::string &name : cuda::fp8_kernel_names(tile)) {
      CAPTURE(name);
      const cuda::ResourceReport *rep = r.resources_of(name);
      REQUIRE(rep != nullptr);
      CHECK(rep->spill_store_bytes == 0);
      CHECK(rep->spill_load_bytes == 0);
      CHECK(rep->stack_frame_bytes == 0);
      CHECK(rep->registers > 0);
      // The GEMM runs 256 threads a block: 255 registers fit one block an SM.
      CHECK(rep->registers <= 255);
      CHECK_FALSE(rep->wgmma_serialized);
    }
  }
}

TEST_CASE("cuda: an FP8 GEMM tile outside what the kernels hold is refused, naming the choices") {
  CHECK_THROWS_WITH_AS(cuda::fp8_compile_options("sm_90a", {256, 4}), doctest::Contains("64 or 128"), UserError);
  CHECK_THROWS_WITH_AS(cuda::fp8_compile_options("sm_90a", {128, 1}), doctest::Contains("2 to 6"), UserError);
  CHECK(cuda::fp8_row_bytes(1) == 128);
  CHECK(cuda::fp8_row_bytes(128) == 128);
  CHECK(cuda::fp8_row_bytes(300) == 384);
}

TEST_SUITE("gpu") {
  TEST_CASE("cuda gpu: activation rows round to e4m3 as dsl/fp8.h rounds them, gathered rows too") {
    MOEFORGE_REQUIRE_GPU();
    cuda::Device device;
    cuda::Stream stream;
    const cuda::Fp8Kernels fp8(device.arch_specific());
    std::mt19937 rng(55);
    const int64_t rows = 37, K = 300, KB = cuda::fp8_blocks(K);
    Bf16Matrix x = random_bf16(rows, K, 1, rng);
    // A row of zeros (scale 1) and a row with an infinity (saturates, scale 1).
    for (int64_t k = 0; k < K; ++k) {
      x.value[static_cast<size_t>(3 * K + k)] = 0.f;
      x.bits[static_cast<size_t>(3 * K + k)] = bf16_bits(0.f);
    }
    x.value[static_cast<size_t>(5 * K + 7)] = std::numeric_limits<float>::infinity();
    x.bits[static_cast<size_t>(5 * K + 7)] = bf16_bits(std::numeric_limits<float>::infinity());
    const std::vector<double> want = rounded(x, rows, K, 1, 128);
    cuda::DeviceBuffer d_x = cuda::DeviceBuffer::from(x.bits);
    cuda::DeviceBuffer q(static_cast<size_t>(cuda::fp8_operand_bytes(rows, K)));
    cuda::DeviceBuffer scales(static_cast<size_t>(rows * KB) * sizeof(float));
    q.fill32(cuda::kPoisonNaN);
    scales.fill32(cuda::kPoisonNaN);
    fp8.quantize_rows(d_x.ptr(), K, 0, rows, K, q.ptr(), scales.ptr(), stream);
    stream.synchronize();
    const std::vector<uint8_t> hq = q.download<uint8_t>();
    const std::vector<float> hs = scales.download<float>();
    const std::vector<double> got = decoded(hq, hs, rows, K, [&](int64_t r, int64_t k) { return r * KB + k / 128; });
    CHECK(mismatches(got, want) == 0);
    CHECK(padding_is_zero(hq, rows, K));
    CHECK(hs[static_cast<size_t>(3 * KB)] == 1.f);
    CHECK(hs[static_cast<size_t>(5 * KB)] == 1.f);
    CHECK(got[static_cast<size_t>(5 * K + 7)] == 448.0);

    // Gathered: output row r rounds x's row index[r] (rows repeated and skipped).
    const std::vector<int32_t> index = {36, 0, 5, 5, 12, 3, 30};
    const int64_t g = static_cast<int64_t>(index.size());
    cuda::DeviceBuffer d_index = cuda::DeviceBuffer::from(index);
    q.fill32(cuda::kPoisonNaN);
    scales.fill32(cuda::kPoisonNaN);
    fp8.quantize_rows(d_x.ptr(), K, d_index.ptr(), g, K, q.ptr(), scales.ptr(), stream);
    stream.synchronize();
    const std::vector<double> got_g = decoded(q.download<uint8_t>(), scales.download<float>(), g, K,
                                              [&](int64_t r, int64_t k) { return r * KB + k / 128; });
    int64_t bad = 0;
    for (int64_t r = 0; r < g; ++r)
      for (int64_t k = 0; k < K; ++k)
        bad += got_g[static_cast<size_t>(r * K + k)] != want[static_cast<size_t>(index[r] * K + k)];
    CHECK(bad == 0);
  }

  TEST_CASE("cuda gpu: a weight rounds in 128 x 128 blocks into both layouts, one grid of scales") {
    MOEFORGE_REQUIRE_GPU();
    cuda::Device device;
    cuda::Stream stream;
    const cuda::Fp8Kernels fp8(device.arch_specific());
    std::mt19937 rng(56);
    const int64_t E = 2, R = 200, C = 300, RB = cuda::fp8_blocks(R), CB = cuda::fp8_blocks(C);
    std::vector<Bf16Matrix> w;
    std::vector<uint16_t> bits;
    for (int64_t e = 0; e < E; ++e) {
      w.push_back(random_bf16(R, C, 128, rng));
      bits.insert(bits.end(), w.back().bits.begin(), w.back().bits.end());
    }
    cuda::DeviceBuffer d_w = cuda::DeviceBuffer::from(bits);
    cuda::DeviceBuffer q(static_cast<size_t>(E * cuda::fp8_operand_bytes(R, C)));
    cuda::DeviceBuffer q_t(static_cast<size_t>(E * cuda::fp8_operand_bytes(C, R)));
    cuda::DeviceBuffer scales(static_cast<size_t>(E * RB * CB) * sizeof(float));
    q.fill32(cuda::kPoisonNaN);
    q_t.fill32(cuda::kPoisonNaN);
    scales.fill32(cuda::kPoisonNaN);
    fp8.quantize_weight(d_w.ptr(), E, R, C, q.ptr(), q_t.ptr(), scales.ptr(), stream);
    stream.synchronize();
    const std::vector<uint8_t> hq = q.download<uint8_t>(), hqt = q_t.download<uint8_t>();
    const std::vector<float> hs = scales.download<float>();
    for (int64_t e = 0; e < E; ++e) {
      CAPTURE(e);
      const std::vector<double> want = rounded(w[static_cast<size_t>(e)], R, C, 128, 128);
      const std::vector<float> s(hs.begin() + e * RB * CB, hs.begin() + (e + 1) * RB * CB);
      const std::vector<uint8_t> qe(hq.begin() + e * cuda::fp8_operand_bytes(R, C),
                                    hq.begin() + (e + 1) * cuda::fp8_operand_bytes(R, C));
      const std::vector<uint8_t> qte(hqt.begin() + e * cuda::fp8_operand_bytes(C, R),
                                     hqt.begin() + (e + 1) * cuda::fp8_operand_bytes(C, R));
      CHECK(mismatches(decoded(qe, s, R, C, [&](int64_t r, int64_t c) { return (r / 128) * CB + c / 128; }), want) ==
            0);
      // q_t holds W^T: its row c, column r is W's (r, c).
      const std::vector<double> t =
          decoded(qte, s, C, R, [&](int64_t c, int64_t r) { return (r / 128) * CB + c / 128; });
      int64_t bad = 0;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c)
          bad += t[static_cast<size_t>(c * R + r)] != want[static_cast<size_t>(r * C + c)];
      CHECK(bad == 0);
      CHECK(padding_is_zero(qe, R, C));
      CHECK(padding_is_zero(qte, C, R));
    }
  }

  TEST_CASE("cuda gpu: the e4m3 GEMM equals the float64 product of the rounded operands") {
    MOEFORGE_REQUIRE_GPU();
    cuda::Device device;
    cuda::Stream stream;
    // M, N and K cut the 128-row tiles, the column tiles and the 128-deep blocks.
    const int64_t E = 2, M = 300, K = 400, N = 320, KB = cuda::fp8_blocks(K);
    for (cuda::Fp8GemmTile tile : {cuda::Fp8GemmTile{128, 4}, cuda::Fp8GemmTile{64, 3}}) {
      CAPTURE(tile.columns);
      const cuda::Fp8Kernels fp8(device.arch_specific(), tile);
      std::mt19937 rng(57);
      // Per batch: x [M, K] (rows), w [K, N] (a weight, the product x w over
      // K: its q_t), g [M, N] (rows, the product g w^T over N: its q).
      std::vector<Bf16Matrix> x, w, g;
      std::vector<uint16_t> xb, wb, gb;
      for (int64_t e = 0; e < E; ++e) {
        x.push_back(random_bf16(M, K, 1, rng));
        w.push_back(random_bf16(K, N, 128, rng));
        g.push_back(random_bf16(M, N, 1, rng));
        xb.insert(xb.end(), x.back().bits.begin(), x.back().bits.end());
        wb.insert(wb.end(), w.back().bits.begin(), w.back().bits.end());
        gb.insert(gb.end(), g.back().bits.begin(), g.back().bits.end());
      }
      cuda::DeviceBuffer d_x = cuda::DeviceBuffer::from(xb), d_w = cuda::DeviceBuffer::from(wb),
                         d_g = cuda::DeviceBuffer::from(gb);
      const int64_t NB = cuda::fp8_blocks(N);
      cuda::DeviceBuffer qx(static_cast<size_t>(E * cuda::fp8_operand_bytes(M, K))),
          sx(static_cast<size_t>(E * M * KB) * sizeof(float));
      cuda::DeviceBuffer qg(static_cast<size_t>(E * cuda::fp8_operand_bytes(M, N))),
          sg(static_cast<size_t>(E * M * NB) * sizeof(float));
      cuda::DeviceBuffer qw(static_cast<size_t>(E * cuda::fp8_operand_bytes(K, N))),
          qw_t(static_cast<size_t>(E * cuda::fp8_operand_bytes(N, K))),
          sw(static_cast<size_t>(E * KB * NB) * sizeof(float));
      // The batches' rows lie back to back: one call rounds them all.
      fp8.quantize_rows(d_x.ptr(), K, 0, E * M, K, qx.ptr(), sx.ptr(), stream);
      fp8.quantize_rows(d_g.ptr(), N, 0, E * M, N, qg.ptr(), sg.ptr(), stream);
      fp8.quantize_weight(d_w.ptr(), E, K, N, qw.ptr(), qw_t.ptr(), sw.ptr(), stream);
      cuda::DeviceBuffer y32(static_cast<size_t>(E * M * N) * sizeof(float)),
          y16(static_cast<size_t>(E * M * N) * sizeof(uint16_t)), z32(static_cast<size_t>(E * M * K) * sizeof(float));
      y32.fill32(cuda::kPoisonNaN);
      y16.fill32(cuda::kPoisonNaN);
      z32.fill32(cuda::kPoisonNaN);
      const cuda::Fp8Operand ax{qx.ptr(), sx.ptr(), cuda::fp8_operand_bytes(M, K)},
          bw_t{qw_t.ptr(), sw.ptr(), cuda::fp8_operand_bytes(N, K)},
          ag{qg.ptr(), sg.ptr(), cuda::fp8_operand_bytes(M, N)}, bw{qw.ptr(), sw.ptr(), cuda::fp8_operand_bytes(K, N)};
      fp8.gemm(ax, bw_t, true, y32.ptr(), cuda::Fp8Kernels::Out::f32, M * N, N, M, N, K, E, stream);
      fp8.gemm(ax, bw_t, true, y16.ptr(), cuda::Fp8Kernels::Out::bf16, M * N, N, M, N, K, E, stream);
      fp8.gemm(ag, bw, false, z32.ptr(), cuda::Fp8Kernels::Out::f32, M * K, K, M, K, N, E, stream);
      // Rounded in the epilogue (128-column tiles): the operand of a next
      // product, to the bit what rounding the stored bf16 output gives.
      if (tile.columns == 128) {
        cuda::DeviceBuffer qy(static_cast<size_t>(E * cuda::fp8_operand_bytes(M, N))),
            sy(static_cast<size_t>(E * M * NB) * 4), qy_want(qy.bytes()), sy_want(sy.bytes());
        qy.fill32(cuda::kPoisonNaN);
        sy.fill32(cuda::kPoisonNaN);
        fp8.gemm_to_e4m3(ax, bw_t, true, {}, qy.ptr(), sy.ptr(), M, N, K, E, stream);
        fp8.quantize_rows(y16.ptr(), N, 0, E * M, N, qy_want.ptr(), sy_want.ptr(), stream);
        stream.synchronize();
        CHECK(qy.download<uint8_t>() == qy_want.download<uint8_t>());
        CHECK(sy.download<float>() == sy_want.download<float>());
      }
      stream.synchronize();
      const std::vector<float> hy32 = y32.download<float>(), hz32 = z32.download<float>();
      const std::vector<uint16_t> hy16 = y16.download<uint16_t>();

      for (int64_t e = 0; e < E; ++e) {
        CAPTURE(e);
        const std::vector<double> rx = rounded(x[static_cast<size_t>(e)], M, K, 1, 128),
                                  rw = rounded(w[static_cast<size_t>(e)], K, N, 128, 128),
                                  rg = rounded(g[static_cast<size_t>(e)], M, N, 1, 128);
        // |error| of a float32 sum of products against float64, relative to
        // the sum of |products| (blocks of 128 sum on the tensor cores, then
        // in float32): about K * 2^-24; 1e-5 leaves room for neither a
        // missing block (~1/KB of the sum) nor a wrong scale (a power of two).
        SumErrors y_f32, z_f32;
        double worst16 = 0;
        int64_t unwritten16 = 0;
        for (int64_t m = 0; m < M; ++m) {
          for (int64_t n = 0; n < N; ++n) {
            const auto [sum, mag] = dot(&rx[static_cast<size_t>(m * K)], 1, &rw[static_cast<size_t>(n)], N, K);
            const size_t at = static_cast<size_t>((e * M + m) * N + n);
            y_f32.add(hy32[at], sum, mag);
            const float v16 = bf16_value(hy16[at]);
            unwritten16 += !std::isfinite(v16);
            worst16 = std::max(worst16, std::fabs(v16 - sum) / (std::fabs(sum) + 1e-3 * mag + 1e-300));
          }
          for (int64_t k = 0; k < K; ++k) {
            const auto [sum, mag] = dot(&rg[static_cast<size_t>(m * N)], 1, &rw[static_cast<size_t>(k * N)], 1, N);
            const size_t at = static_cast<size_t>((e * M + m) * K + k);
            z_f32.add(hz32[at], sum, mag);
          }
        }
        CHECK(y_f32.unwritten + z_f32.unwritten + unwritten16 == 0);
        CHECK(y_f32.worst < 1e-5);
        CHECK(z_f32.worst < 1e-5);
        // bf16 output: its rounding, 2^-9 of the value.
        CHECK(worst16 < 4e-3);
      }
    }
  }

  TEST_CASE("cuda gpu: the routed e4m3 GEMM gathers each padded row's token and takes its expert's weight") {
    MOEFORGE_REQUIRE_GPU();
    cuda::Device device;
    cuda::Stream stream;
    const cuda::Fp8Kernels fp8(device.arch_specific());
    std::mt19937 rng(58);
    // Experts' rows cut their last tiles (about 150 pairs each), K and N the blocks.
    const RoutingShape shape{300, 4, 2, 128};
    const int64_t T = shape.tokens, E = shape.experts, K = 200, N = 192, KB = cuda::fp8_blocks(K),
                  NB = cuda::fp8_blocks(N);
    const std::vector<int32_t> expert = two_distinct_experts(T, static_cast<int>(E), rng);
    const RoutingTables tables = route_on_host(shape, expert);
    const Bf16Matrix x = random_bf16(T, K, 1, rng);
    std::vector<Bf16Matrix> w;
    std::vector<uint16_t> wb;
    for (int64_t e = 0; e < E; ++e) {
      w.push_back(random_bf16(K, N, 128, rng));
      wb.insert(wb.end(), w.back().bits.begin(), w.back().bits.end());
    }
    cuda::DeviceBuffer d_x = cuda::DeviceBuffer::from(x.bits), d_w = cuda::DeviceBuffer::from(wb);
    cuda::DeviceBuffer qx(static_cast<size_t>(cuda::fp8_operand_bytes(T, K))), sx(static_cast<size_t>(T * KB) * 4);
    cuda::DeviceBuffer qw_t(static_cast<size_t>(E * cuda::fp8_operand_bytes(N, K))),
        sw(static_cast<size_t>(E * KB * NB) * 4);
    fp8.quantize_rows(d_x.ptr(), K, 0, T, K, qx.ptr(), sx.ptr(), stream);
    fp8.quantize_weight(d_w.ptr(), E, K, N, 0, qw_t.ptr(), sw.ptr(), stream);
    cuda::DeviceBuffer tile_expert = cuda::DeviceBuffer::from(tables.tile_expert),
                       tile_row_start = cuda::DeviceBuffer::from(tables.tile_row_start),
                       tile_rows = cuda::DeviceBuffer::from(tables.tile_rows),
                       num_tiles = cuda::DeviceBuffer::from(std::vector<int32_t>{tables.num_tiles}),
                       sorted_pair = cuda::DeviceBuffer::from(tables.sorted_pair);
    const int64_t padded_rows = shape.max_padded_rows();
    cuda::DeviceBuffer y(static_cast<size_t>(padded_rows * N) * sizeof(float));
    y.fill32(cuda::kPoisonNaN);
    cuda::Fp8Kernels::RouteTables route;
    route.tile_expert = tile_expert.ptr();
    route.tile_row_start = tile_row_start.ptr();
    route.tile_rows = tile_rows.ptr();
    route.num_tiles = num_tiles.ptr();
    route.a_rows = sorted_pair.ptr();
    route.a_row_div = shape.k;
    route.max_tiles = shape.max_tiles();
    fp8.gemm_routed({qx.ptr(), sx.ptr(), 0}, {qw_t.ptr(), sw.ptr(), cuda::fp8_operand_bytes(N, K)}, true, route,
                    y.ptr(), cuda::Fp8Kernels::Out::f32, N, N, K, stream);
    stream.synchronize();
    const std::vector<float> hy = y.download<float>();
    const std::vector<double> rx = rounded(x, T, K, 1, 128);
    std::vector<std::vector<double>> rw;
    for (int64_t e = 0; e < E; ++e)
      rw.push_back(rounded(w[static_cast<size_t>(e)], K, N, 128, 128));
    SumErrors err;
    int64_t pairs_seen = 0;
    for (int64_t p = 0; p < padded_rows; ++p) {
      const int32_t r = tables.sorted_pair[static_cast<size_t>(p)];
      if (r < 0)
        continue;
      ++pairs_seen;
      const int64_t token = r / shape.k, e = expert[static_cast<size_t>(r)];
      for (int64_t n = 0; n < N; ++n) {
        const Dot d =
            dot(&rx[static_cast<size_t>(token * K)], 1, &rw[static_cast<size_t>(e)][static_cast<size_t>(n)], N, K);
        err.add(hy[static_cast<size_t>(p * N + n)], d.sum, d.magnitude);
      }
    }
    CHECK(pairs_seen == shape.pairs());
    CHECK(err.unwritten == 0);
    CHECK(err.worst < 1e-5);
  }

  TEST_CASE("cuda gpu: an e4m3 weight gradient sums each expert's pairs in blocks of 128, one scale a column") {
    MOEFORGE_REQUIRE_GPU();
    cuda::Device device;
    cuda::Stream stream;
    const cuda::Fp8Kernels fp8(device.arch_specific());
    std::mt19937 rng(59);
    // Expert 4 gets no pair (its gradient is zero); the others about 200,
    // so an expert's last block of 128 is ragged.
    const RoutingShape shape{300, 5, 2, 128};
    const int64_t T = shape.tokens, E = shape.experts, D = 200, F = 192;
    const std::vector<int32_t> expert = two_distinct_experts(T, 4, rng);
    const RoutingTables tables = route_on_host(shape, expert);
    const int64_t padded_rows = shape.max_padded_rows(), max_tiles = shape.max_tiles();
    // x by tokens (gathered through sorted_pair); dh in the padded order,
    // its padding rows holding values the rounding must leave out.
    const Bf16Matrix x = random_bf16(T, D, 1, rng), dh = random_bf16(padded_rows, F, 1, rng);
    cuda::DeviceBuffer d_x = cuda::DeviceBuffer::from(x.bits), d_dh = cuda::DeviceBuffer::from(dh.bits);
    cuda::DeviceBuffer sorted_pair = cuda::DeviceBuffer::from(tables.sorted_pair),
                       offsets = cuda::DeviceBuffer::from(tables.offsets),
                       num_tiles = cuda::DeviceBuffer::from(std::vector<int32_t>{tables.num_tiles});
    cuda::DeviceBuffer qa(static_cast<size_t>(D * max_tiles * 128)), sa(static_cast<size_t>(max_tiles * D) * 4);
    cuda::DeviceBuffer qb(static_cast<size_t>(F * max_tiles * 128)), sb(static_cast<size_t>(max_tiles * F) * 4);
    cuda::DeviceBuffer dw(static_cast<size_t>(E * D * F) * sizeof(float));
    dw.fill32(cuda::kPoisonNaN);
    fp8.quantize_tiles_t(d_x.ptr(), D, sorted_pair.ptr(), true, shape.k, num_tiles.ptr(), max_tiles, D, qa.ptr(),
                         sa.ptr(), stream);
    fp8.quantize_tiles_t(d_dh.ptr(), F, sorted_pair.ptr(), false, 1, num_tiles.ptr(), max_tiles, F, qb.ptr(), sb.ptr(),
                         stream);
    fp8.gemm_expert_k(qa.ptr(), sa.ptr(), qb.ptr(), sb.ptr(), offsets.ptr(), E, max_tiles, D, F, dw.ptr(),
                      cuda::Fp8Kernels::Out::f32, stream);
    stream.synchronize();
    const std::vector<float> got = dw.download<float>();
    SumErrors err;
    int64_t nonzero_in_empty = 0;
    for (int64_t e = 0; e < E; ++e) {
      CAPTURE(e);
      // The expert's pairs in the routing's order, its rows of x and dh.
      std::vector<double> xe, he;
      for (int64_t p = tables.offsets[static_cast<size_t>(e)]; p < tables.offsets[static_cast<size_t>(e) + 1]; ++p) {
        const int32_t r = tables.sorted_pair[static_cast<size_t>(p)];
        if (r < 0)
          continue;
        for (int64_t m = 0; m < D; ++m)
          xe.push_back(x.value[static_cast<size_t>((r / shape.k) * D + m)]);
        for (int64_t n = 0; n < F; ++n)
          he.push_back(dh.value[static_cast<size_t>(p * F + n)]);
      }
      const int64_t rows = static_cast<int64_t>(xe.size()) / D;
      CHECK(rows == tables.counts[static_cast<size_t>(e)]);
      fp8_round_blocks(xe.data(), rows, D, D, 128, 1, Fp8Format::e4m3);
      fp8_round_blocks(he.data(), rows, F, F, 128, 1, Fp8Format::e4m3);
      for (int64_t m = 0; m < D; ++m)
        for (int64_t n = 0; n < F; ++n) {
          const float g = got[static_cast<size_t>((e * D + m) * F + n)];
          if (rows > 0) {
            const Dot d = dot(&xe[static_cast<size_t>(m)], D, &he[static_cast<size_t>(n)], F, rows);
            err.add(g, d.sum, d.magnitude);
          } else {
            err.unwritten += !std::isfinite(g);
            nonzero_in_empty += g != 0.f;
          }
        }
    }
    CHECK(tables.counts[4] == 0);
    CHECK(err.unwritten == 0);
    CHECK(nonzero_in_empty == 0);
    CHECK(err.worst < 1e-5);
  }
}
