// FP8 on the device: dsl/fp8.h's block rounding into e4m3 operands, and the
// batched e4m3 GEMM over them with per-block scales (device/fp8_kernels.cuh,
// tiles/fp8.cuh). The building blocks of Schedule::fp8 on the CUDA backend
// (issue 55), tested against the CPU's rounding and products.
//
// An e4m3 operand is `rows` rows of ceil(K / 128) * 128 bytes (zero past K:
// the GEMM reads whole 128-deep blocks), the contracted index along the row,
// with float32 scales, each a power of two (dsl/fp8.h), by block.
#pragma once

#include "backends/cuda/codegen/nvrtc_compiler.h"
#include "backends/cuda/runtime/driver.h"
#include "backends/cuda/runtime/module.h"
#include "backends/cuda/runtime/stream.h"

#include <cstdint>
#include <string>
#include <vector>

namespace moeforge::cuda {

// Bytes of an e4m3 operand of `rows` rows over a contracted extent K.
int64_t fp8_row_bytes(int64_t K);
inline int64_t fp8_operand_bytes(int64_t rows, int64_t K) { return rows * fp8_row_bytes(K); }
// Blocks of 128 along n.
inline int64_t fp8_blocks(int64_t n) { return (n + 127) / 128; }

// The GEMM's column tile (128 or 64) and its stages, compiled in.
struct Fp8GemmTile {
  int columns = 128;
  int stages = 4;
};

// NVRTC input and options for the FP8 kernels; compiles (or loads from the
// cache) for `arch` with no GPU needed.
const char *fp8_kernels_source();
CompileOptions fp8_compile_options(const std::string &arch, Fp8GemmTile tile = {});
CompileResult compile_fp8_kernels(const std::string &arch, Fp8GemmTile tile = {});
// The kernels compiled for `tile` (mf_fp8_gemm_e4m3 with 128 columns only).
std::vector<std::string> fp8_kernel_names(Fp8GemmTile tile = {});

// One side of an FP8 product: the e4m3 bytes and their scales, batch z at
// data + z * batch_stride bytes and scales + z * (the scales of a batch).
struct Fp8Operand {
  CUdeviceptr data = 0, scales = 0;
  int64_t batch_stride = 0; // bytes
};

class Fp8Kernels {
public:
  // Compiles for `arch` (Device::arch_specific()) and loads the module.
  explicit Fp8Kernels(const std::string &arch, Fp8GemmTile tile = {});

  // Rows of an activation (bf16, `rows` x K, ld_x apart) rounded in 1 x 128
  // blocks into q (rows x fp8_row_bytes(K)) and scales (rows x
  // fp8_blocks(K)); row_index (int32 [rows], or 0): the row of x each
  // output row rounds (a gathered operand).
  void quantize_rows(CUdeviceptr x, int64_t ld_x, CUdeviceptr row_index, int64_t rows, int64_t K, CUdeviceptr q,
                     CUdeviceptr scales, const Stream &stream) const;
  // A weight (bf16 [batches][R][C], dense) in 128 x 128 blocks: q [R] rows
  // of C (the operand of a product over C), q_t [C] rows of R (over R),
  // either 0 for not wanted; scales [batches][fp8_blocks(R)][fp8_blocks(C)].
  void quantize_weight(CUdeviceptr w, int64_t batches, int64_t R, int64_t C, CUdeviceptr q, CUdeviceptr q_t,
                       CUdeviceptr scales, const Stream &stream) const;

  // c[z] (M x N at ld_c, f32 or bf16) = a[z] b[z]^T over K, a with M rows
  // and 1 x 128 scales (M x fp8_blocks(K) a batch), b with N rows and a
  // weight's 128 x 128 scales; b_scales_by_k: the weight's scale grid is
  // (K blocks, N blocks) (b is a weight's q_t), else (N blocks, K blocks)
  // (its q).
  enum class Out { f32, bf16 };
  void gemm(const Fp8Operand &a, const Fp8Operand &b, bool b_scales_by_k, CUdeviceptr c, Out out,
            int64_t c_batch_stride, int64_t ld_c, int64_t M, int64_t N, int64_t K, int64_t batches,
            const Stream &stream) const;

  // The routed product: c's rows in the routing's padded order (block 128,
  // one GEMM row tile a routing tile), row p = a's row p, or with a_rows
  // (int32, sorted_pair: each padded row's pair, -1 for padding) a's row
  // a_rows[p] / a_row_div (x's token rows: k); b per expert (batch_stride
  // bytes apart, its scales a weight's grid each). The tile tables (int32:
  // tile_expert, tile_row_start, tile_rows; num_tiles, on the device) as
  // runtime/routing_format.h has them; max_tiles bounds the grid.
  struct RouteTables {
    CUdeviceptr tile_expert = 0, tile_row_start = 0, tile_rows = 0, num_tiles = 0, a_rows = 0;
    int a_row_div = 1;
    int64_t max_tiles = 0;
    int block = 128;
  };
  void gemm_routed(const Fp8Operand &a, const Fp8Operand &b, bool b_scales_by_k, const RouteTables &route,
                   CUdeviceptr c, Out out, int64_t ld_c, int64_t N, int64_t K, const Stream &stream) const;

  // gemm() or gemm_routed() (route.tile_expert 0: dense, M rows a batch)
  // with the product rounded to e4m3 in the epilogue: the operand of a next
  // product over N (q: rows of fp8_row_bytes(N), a dense batch's after the
  // batches before it; scales: fp8_blocks(N) a row), with no pass over a
  // stored output. The 128-column tile only.
  void gemm_to_e4m3(const Fp8Operand &a, const Fp8Operand &b, bool b_scales_by_k, const RouteTables &route,
                    CUdeviceptr q, CUdeviceptr scales, int64_t M, int64_t N, int64_t K, int64_t batches,
                    const Stream &stream) const;

  // A weight gradient's operand: rows p < 128 * num_tiles of the padded
  // order (gather: x's row a_rows[p] / a_row_div, else row p of x; zero
  // where a_rows[p] < 0: a_rows is the route's sorted_pair) rounded in blocks of 128 rows (a routing
  // tile: 128 of one expert's pairs) by one column and stored transposed:
  // q_t, C rows of 128 * max_tiles bytes; scales [max_tiles][C]. num_tiles
  // on the device (int32), the routing's count.
  void quantize_tiles_t(CUdeviceptr x, int64_t ld_x, CUdeviceptr a_rows, bool gather, int a_row_div,
                        CUdeviceptr num_tiles, int64_t max_tiles, int64_t C, CUdeviceptr q_t, CUdeviceptr scales,
                        const Stream &stream) const;
  // The weight gradient c[e] (M x N, dense, e at c + e M N elements) = the
  // sum over expert e's pairs of a's column times b's column: a and b from
  // quantize_tiles_t over the same route (M and N columns), offsets its
  // padded offsets (int32 [experts + 1], on the device, block 128).
  void gemm_expert_k(CUdeviceptr a_t, CUdeviceptr a_scales, CUdeviceptr b_t, CUdeviceptr b_scales, CUdeviceptr offsets,
                     int64_t experts, int64_t max_tiles, int64_t M, int64_t N, CUdeviceptr c, Out out,
                     const Stream &stream) const;

  const CompileResult &compiled() const { return compiled_; }
  Fp8GemmTile tile() const { return tile_; }

private:
  // One launch of either GEMM form (route.tile_expert 0: dense).
  void launch_gemm(const Fp8Operand &a, const Fp8Operand &b, bool b_scales_by_k, const RouteTables &route,
                   CUdeviceptr c, Out out, int64_t c_batch_stride, int64_t ld_c, int64_t M, int64_t N, int64_t K,
                   int64_t row_tiles, int64_t batches, const Stream &stream) const;

  Fp8GemmTile tile_;
  CompileResult compiled_;
  Module module_;
  Kernel quantize_rows_, quantize_weight_, quantize_tiles_t_, gemm_f32_, gemm_bf16_, gemm_e4m3_, expert_k_f32_,
      expert_k_bf16_;
  int gemm_shared_bytes_ = 0;
};

} // namespace moeforge::cuda
