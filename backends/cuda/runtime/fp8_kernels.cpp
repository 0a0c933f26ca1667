#include "backends/cuda/runtime/fp8_kernels.h"

#include "backends/cuda/codegen/tile_library.h"
#include "backends/cuda/device/fp8_kernels_cuh.h"
#include "dsl/error.h"

#include <climits>
#include <cstddef>

namespace moeforge::cuda {

namespace {
constexpr unsigned kQuantizeThreads = 256; // both quantising kernels
constexpr unsigned kGemmThreads = 256;     // two consumer warpgroups of 64 rows
constexpr int kGemmRows = 128;

unsigned grid_dim(int64_t n, const char *what) {
  internal_check(n > 0 && n <= INT_MAX) << "FP8 kernel grid of " << n << " " << what;
  return static_cast<unsigned>(n);
}
// Fp8Route in device/fp8_kernels.cuh, the same layout: five addresses, then an int.
struct Fp8RouteArg {
  CUdeviceptr tile_expert, tile_row_start, tile_rows, num_tiles, a_rows;
  int a_row_div;
};
static_assert(sizeof(Fp8RouteArg) == 48 && offsetof(Fp8RouteArg, a_row_div) == 40, "mf's Fp8Route on the device");

int int_arg(int64_t n, const char *what) {
  user_check(n >= 0 && n <= INT_MAX) << "FP8 " << what << " of " << n << ": at most " << INT_MAX;
  return static_cast<int>(n);
}
} // namespace

int64_t fp8_row_bytes(int64_t K) { return fp8_blocks(K) * 128; }

const char *fp8_kernels_source() { return kFp8KernelsSource; }

CompileOptions fp8_compile_options(const std::string &arch, Fp8GemmTile tile) {
  user_check(tile.columns == 64 || tile.columns == 128)
      << "an FP8 GEMM tile of " << tile.columns << " columns: 64 or 128 (two accumulator sets a thread)";
  user_check(tile.stages >= 2 && tile.stages <= 6) << "an FP8 GEMM of " << tile.stages << " stages: 2 to 6";
  CompileOptions o;
  o.arch = arch;
  o.headers = tile_library_headers();
  o.extra_options = {"-DMF_FP8_GEMM_BN=" + std::to_string(tile.columns),
                     "-DMF_FP8_GEMM_STAGES=" + std::to_string(tile.stages)};
  return o;
}

CompileResult compile_fp8_kernels(const std::string &arch, Fp8GemmTile tile) {
  return compile_cuda(fp8_kernels_source(), "fp8_kernels.cu", fp8_compile_options(arch, tile));
}

std::vector<std::string> fp8_kernel_names(Fp8GemmTile tile) {
  std::vector<std::string> names = {"mf_fp8_quantize_rows",     "mf_fp8_quantize_weight", "mf_fp8_quantize_tiles_t",
                                    "mf_fp8_gemm_f32",          "mf_fp8_gemm_bf16",       "mf_fp8_gemm_expert_k_f32",
                                    "mf_fp8_gemm_expert_k_bf16"};
  if (tile.columns == 128)
    names.push_back("mf_fp8_gemm_e4m3");
  return names;
}

Fp8Kernels::Fp8Kernels(const std::string &arch, Fp8GemmTile tile)
    : tile_(tile), compiled_(compile_fp8_kernels(arch, tile)) {
  module_ = Module(compiled_.cubin, "fp8_kernels");
  quantize_rows_ = module_.kernel("mf_fp8_quantize_rows");
  quantize_weight_ = module_.kernel("mf_fp8_quantize_weight");
  gemm_f32_ = module_.kernel("mf_fp8_gemm_f32");
  gemm_bf16_ = module_.kernel("mf_fp8_gemm_bf16");
  quantize_tiles_t_ = module_.kernel("mf_fp8_quantize_tiles_t");
  expert_k_f32_ = module_.kernel("mf_fp8_gemm_expert_k_f32");
  expert_k_bf16_ = module_.kernel("mf_fp8_gemm_expert_k_bf16");
  // Fp8WgmmaConfig::SMEM_BYTES: the stages of A (128 rows) and B, 128 bytes
  // a row, and the slack that aligns them to the swizzle's 1024 bytes.
  gemm_shared_bytes_ = tile.stages * (kGemmRows + tile.columns) * 128 + 1024;
  if (tile.columns == 128) {
    gemm_e4m3_ = module_.kernel("mf_fp8_gemm_e4m3");
    gemm_e4m3_.set_max_dynamic_shared_memory(gemm_shared_bytes_);
  }
  gemm_f32_.set_max_dynamic_shared_memory(gemm_shared_bytes_);
  gemm_bf16_.set_max_dynamic_shared_memory(gemm_shared_bytes_);
  expert_k_f32_.set_max_dynamic_shared_memory(gemm_shared_bytes_);
  expert_k_bf16_.set_max_dynamic_shared_memory(gemm_shared_bytes_);
}

void Fp8Kernels::quantize_rows(CUdeviceptr x, int64_t ld_x, CUdeviceptr row_index, int64_t rows, int64_t K,
                               CUdeviceptr q, CUdeviceptr scales, const Stream &stream) const {
  user_check(K > 0) << "FP8 rows of " << K << " values: at least one";
  user_check(ld_x >= K) << "FP8 rows " << ld_x << " apart, shorter than their " << K << " values";
  if (rows == 0)
    return;
  int n_rows = int_arg(rows, "rows"), n_k = int_arg(K, "row length");
  long long ld = ld_x;
  void *args[] = {&x, &ld, &row_index, &n_rows, &n_k, &q, &scales};
  const int64_t warps = rows * fp8_blocks(K), per_block = kQuantizeThreads / 32;
  quantize_rows_.launch({grid_dim((warps + per_block - 1) / per_block, "blocks")}, {kQuantizeThreads}, 0, stream, args);
}

void Fp8Kernels::quantize_weight(CUdeviceptr w, int64_t batches, int64_t R, int64_t C, CUdeviceptr q, CUdeviceptr q_t,
                                 CUdeviceptr scales, const Stream &stream) const {
  user_check(R > 0 && C > 0) << "an FP8 weight of " << R << " x " << C << ": both at least one";
  if (batches == 0)
    return;
  long long stride = R * C;
  int n_r = int_arg(R, "weight rows"), n_c = int_arg(C, "weight columns");
  void *args[] = {&w, &stride, &n_r, &n_c, &q, &q_t, &scales};
  quantize_weight_.launch(
      {grid_dim(fp8_blocks(C), "column blocks"), grid_dim(fp8_blocks(R), "row blocks"), grid_dim(batches, "batches")},
      {kQuantizeThreads}, 0, stream, args);
}

void Fp8Kernels::gemm(const Fp8Operand &a, const Fp8Operand &b, bool b_scales_by_k, CUdeviceptr c, Out out,
                      int64_t c_batch_stride, int64_t ld_c, int64_t M, int64_t N, int64_t K, int64_t batches,
                      const Stream &stream) const {
  if (M == 0 || batches == 0)
    return;
  launch_gemm(a, b, b_scales_by_k, RouteTables{}, c, out, c_batch_stride, ld_c, M, N, K,
              (M + kGemmRows - 1) / kGemmRows, batches, stream);
}

void Fp8Kernels::gemm_routed(const Fp8Operand &a, const Fp8Operand &b, bool b_scales_by_k, const RouteTables &route,
                             CUdeviceptr c, Out out, int64_t ld_c, int64_t N, int64_t K, const Stream &stream) const {
  user_check(route.block == kGemmRows) << "an FP8 routed product over routing blocks of " << route.block
                                       << " rows: its row tiles are " << kGemmRows << " (route with block " << kGemmRows
                                       << ")";
  internal_check(route.tile_expert && route.tile_row_start && route.tile_rows && route.num_tiles)
      << "an FP8 routed product without its tile tables";
  user_check(route.a_row_div >= 1) << "FP8 gathered rows divided by " << route.a_row_div << ": at least 1";
  if (route.max_tiles == 0)
    return;
  launch_gemm(a, b, b_scales_by_k, route, c, out, 0, ld_c, 0, N, K, route.max_tiles, 1, stream);
}

void Fp8Kernels::launch_gemm(const Fp8Operand &a, const Fp8Operand &b, bool b_scales_by_k, const RouteTables &route,
                             CUdeviceptr c, Out out, int64_t c_batch_stride, int64_t ld_c, int64_t M, int64_t N,
                             int64_t K, int64_t row_tiles, int64_t batches, const Stream &stream) const {
  user_check(K > 0) << "an FP8 product over " << K << " values: at least one";
  user_check(ld_c >= N) << "FP8 product rows " << ld_c << " apart, shorter than their " << N << " columns";
  if (N == 0)
    return;
  CUdeviceptr a_data = a.data, a_scales = a.scales, b_data = b.data, b_scales = b.scales;
  long long stride_a = a.batch_stride, stride_b = b.batch_stride, stride_c = c_batch_stride;
  int by_k = b_scales_by_k ? 1 : 0, n_ld = int_arg(ld_c, "output row stride"), n_m = int_arg(M, "rows"),
      n_n = int_arg(N, "columns"), n_k = int_arg(K, "contracted extent");
  Fp8RouteArg r{route.tile_expert, route.tile_row_start, route.tile_rows,
                route.num_tiles,   route.a_rows,         route.a_row_div};
  void *args[] = {&a_data, &stride_a, &a_scales, &b_data, &stride_b, &b_scales, &by_k,
                  &c,      &stride_c, &n_ld,     &n_m,    &n_n,      &n_k,      &r};
  const Kernel &k = out == Out::f32 ? gemm_f32_ : gemm_bf16_;
  k.launch({grid_dim((N + tile_.columns - 1) / tile_.columns, "column tiles"), grid_dim(row_tiles, "row tiles"),
            grid_dim(batches, "batches")},
           {kGemmThreads}, static_cast<unsigned>(gemm_shared_bytes_), stream, args);
}

// Fp8Out in device/fp8_kernels.cuh, the same layout.
struct Fp8OutArg {
  CUdeviceptr q, scales;
  long long ld_q, scale_stride;
};
static_assert(sizeof(Fp8OutArg) == 32, "mf's Fp8Out on the device");

void Fp8Kernels::gemm_to_e4m3(const Fp8Operand &a, const Fp8Operand &b, bool b_scales_by_k, const RouteTables &route,
                              CUdeviceptr q, CUdeviceptr scales, int64_t M, int64_t N, int64_t K, int64_t batches,
                              const Stream &stream) const {
  user_check(tile_.columns == 128) << "an FP8 product rounded to e4m3 in its epilogue needs 128-column tiles (a row's "
                                   << "block of 128 in one tile); these kernels have " << tile_.columns;
  user_check(K > 0) << "an FP8 product over " << K << " values: at least one";
  const bool routed = route.tile_expert != 0;
  if (routed)
    user_check(route.block == kGemmRows) << "an FP8 routed product over routing blocks of " << route.block
                                         << " rows: its row tiles are " << kGemmRows;
  const int64_t row_tiles = routed ? route.max_tiles : (M + kGemmRows - 1) / kGemmRows;
  if (N == 0 || row_tiles == 0 || batches == 0 || (!routed && M == 0))
    return;
  CUdeviceptr a_data = a.data, a_scales = a.scales, b_data = b.data, b_scales = b.scales;
  long long stride_a = a.batch_stride, stride_b = b.batch_stride;
  int by_k = b_scales_by_k ? 1 : 0, n_m = int_arg(M, "rows"), n_n = int_arg(N, "columns"),
      n_k = int_arg(K, "contracted extent");
  Fp8OutArg out{q, scales, fp8_row_bytes(N), fp8_blocks(N)};
  Fp8RouteArg r{route.tile_expert, route.tile_row_start, route.tile_rows,
                route.num_tiles,   route.a_rows,         route.a_row_div};
  void *args[] = {&a_data, &stride_a, &a_scales, &b_data, &stride_b, &b_scales, &by_k, &out, &n_m, &n_n, &n_k, &r};
  gemm_e4m3_.launch({grid_dim((N + 127) / 128, "column tiles"), grid_dim(row_tiles, "row tiles"),
                     grid_dim(routed ? 1 : batches, "batches")},
                    {kGemmThreads}, static_cast<unsigned>(gemm_shared_bytes_), stream, args);
}

void Fp8Kernels::quantize_tiles_t(CUdeviceptr x, int64_t ld_x, CUdeviceptr a_rows, bool gather, int a_row_div,
                                  CUdeviceptr num_tiles, int64_t max_tiles, int64_t C, CUdeviceptr q_t,
                                  CUdeviceptr scales, const Stream &stream) const {
  user_check(C > 0) << "FP8 rows of " << C << " columns: at least one";
  user_check(ld_x >= C) << "FP8 rows " << ld_x << " apart, shorter than their " << C << " values";
  user_check(a_row_div >= 1) << "FP8 gathered rows divided by " << a_row_div << ": at least 1";
  internal_check(a_rows != 0) << "a weight gradient's FP8 operand without its route's sorted_pair";
  if (max_tiles == 0)
    return;
  long long ld = ld_x, ld_q = max_tiles * 128;
  int n_c = int_arg(C, "columns"), by_rows = gather ? 1 : 0;
  void *args[] = {&x, &ld, &a_rows, &by_rows, &a_row_div, &num_tiles, &ld_q, &n_c, &q_t, &scales};
  quantize_tiles_t_.launch({grid_dim(fp8_blocks(C), "column blocks"), grid_dim(max_tiles, "tiles")}, {kQuantizeThreads},
                           0, stream, args);
}

void Fp8Kernels::gemm_expert_k(CUdeviceptr a_t, CUdeviceptr a_scales, CUdeviceptr b_t, CUdeviceptr b_scales,
                               CUdeviceptr offsets, int64_t experts, int64_t max_tiles, int64_t M, int64_t N,
                               CUdeviceptr c, Out out, const Stream &stream) const {
  if (M == 0 || N == 0 || experts == 0)
    return;
  long long ld_q = max_tiles * 128;
  int n_m = int_arg(M, "rows"), n_n = int_arg(N, "columns");
  void *args[] = {&a_t, &a_scales, &b_t, &b_scales, &offsets, &ld_q, &c, &n_m, &n_n};
  const Kernel &k = out == Out::f32 ? expert_k_f32_ : expert_k_bf16_;
  k.launch({grid_dim((N + tile_.columns - 1) / tile_.columns, "column tiles"),
            grid_dim((M + kGemmRows - 1) / kGemmRows, "row tiles"), grid_dim(experts, "experts")},
           {kGemmThreads}, static_cast<unsigned>(gemm_shared_bytes_), stream, args);
}

} // namespace moeforge::cuda
