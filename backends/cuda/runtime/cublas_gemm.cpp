#include "backends/cuda/runtime/cublas_gemm.h"

#include "dsl/error.h"

#include <climits>
#include <cmath>
#include <cstring>

namespace moeforge::cuda {

std::string cublas_error_message(const char *call, cublasStatus_t status) {
  return std::string(call) + " failed: " + cublasGetStatusName(status) + " (" + cublasGetStatusString(status) + ")";
}

namespace {
void check_cublas(cublasStatus_t status, const char *call) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw CublasError(cublas_error_message(call, status), status);
}
} // namespace

CublasHandle::CublasHandle() {
  // The runtime under cuBLAS would create the primary context itself; make
  // sure it is the one moeforge holds (a Device exists) and say so otherwise.
  driver();
  check_cublas(cublasCreate(&handle_), "cublasCreate");
}

CublasHandle::~CublasHandle() {
  if (handle_)
    cublasDestroy(handle_);
}

void gemm_bf16(const CublasHandle &handle, const Stream &stream, Transpose trans_a, Transpose trans_b, int64_t m,
               int64_t n, int64_t k, CUdeviceptr a, CUdeviceptr b, CUdeviceptr c, GemmOutput c_type) {
  user_check(m > 0 && n > 0 && k > 0) << "gemm_bf16 of shape " << m << "x" << n << "x" << k
                                      << ": every dimension must be positive";
  user_check(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX)
      << "gemm_bf16 of shape " << m << "x" << n << "x" << k << ": cublasGemmEx takes dimensions up to " << INT_MAX;
  // cuBLAS is column-major. A row-major [r, c] matrix is the column-major
  // [c, r] matrix (its transpose) with leading dimension c. So the row-major
  // C = op(A)·op(B) is the column-major C^T = op(B)^T · op(A)^T: call cuBLAS
  // with the operands swapped, m and n swapped, and each operand's own
  // transpose flag (B stored [K, N] is already B^T column-major, ld N; B
  // stored [N, K] needs OP_T, ld K; likewise A).
  cublasOperation_t op_b = trans_b == Transpose::yes ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t op_a = trans_a == Transpose::yes ? CUBLAS_OP_T : CUBLAS_OP_N;
  int ld_b = static_cast<int>(trans_b == Transpose::yes ? k : n);
  int ld_a = static_cast<int>(trans_a == Transpose::yes ? m : k);
  int ld_c = static_cast<int>(n);
  const float alpha = 1.0f, beta = 0.0f;
  cudaDataType_t out = c_type == GemmOutput::bf16 ? CUDA_R_16BF : CUDA_R_32F;

  check_cublas(cublasSetStream(handle.get(), stream.handle()), "cublasSetStream");
  check_cublas(cublasGemmEx(handle.get(), op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
                            &alpha, reinterpret_cast<const void *>(b), CUDA_R_16BF, ld_b,
                            reinterpret_cast<const void *>(a), CUDA_R_16BF, ld_a, &beta, reinterpret_cast<void *>(c),
                            out, ld_c, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx");
}

void gemm_nn_batched(const CublasHandle &handle, const Stream &stream, int64_t batch, int64_t m, int64_t n, int64_t k,
                     CUdeviceptr a, CUdeviceptr b, CUdeviceptr c, GemmOutput c_type) {
  user_check(batch > 0 && m > 0 && n > 0 && k > 0)
      << "gemm_nn_batched of " << batch << " GEMMs of shape " << m << "x" << n << "x" << k
      << ": the count and every dimension must be positive";
  user_check(batch <= INT_MAX && m <= INT_MAX && n <= INT_MAX && k <= INT_MAX)
      << "gemm_nn_batched of " << batch << " GEMMs of shape " << m << "x" << n << "x" << k
      << ": cublasGemmStridedBatchedEx takes counts and dimensions up to " << INT_MAX;
  // Column-major as in gemm_bf16 above: each row-major C_e = A_e·B_e is the
  // column-major C_e^T = B_e^T·A_e^T, so B comes first, untransposed.
  const float alpha = 1.0f, beta = 0.0f;
  cudaDataType_t out = c_type == GemmOutput::bf16 ? CUDA_R_16BF : CUDA_R_32F;
  check_cublas(cublasSetStream(handle.get(), stream.handle()), "cublasSetStream");
  check_cublas(cublasGemmStridedBatchedEx(handle.get(), CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n),
                                          static_cast<int>(m), static_cast<int>(k), &alpha,
                                          reinterpret_cast<const void *>(b), CUDA_R_16BF, static_cast<int>(n), k * n,
                                          reinterpret_cast<const void *>(a), CUDA_R_16BF, static_cast<int>(k), m * k,
                                          &beta, reinterpret_cast<void *>(c), out, static_cast<int>(n), m * n,
                                          static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmStridedBatchedEx");
}

} // namespace moeforge::cuda
