// cuBLAS bf16 GEMMs: the dense roof the MoE kernels are measured against
// (design.md, "dense roof"), and a known-good GEMM for tests.
//
// Matrices are row-major, as everywhere in moeforge; the column-major
// translation is done here once. Inputs are bf16, accumulation is fp32
// (CUBLAS_COMPUTE_32F), the output is bf16 or f32.
//
// cuBLAS runs on the CUDA runtime, which attaches to the device's *primary*
// context: the one moeforge::cuda::Device retains and makes current. So
// pointers from DeviceBuffer and streams from Stream are valid for cuBLAS as
// long as a Device for the same GPU exists (construct it before the handle).
#pragma once

#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/stream.h"

#include <cublas_v2.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace moeforge::cuda {

// A failed cuBLAS call: "cublasGemmEx failed: CUBLAS_STATUS_INVALID_VALUE (...)".
class CublasError : public std::runtime_error {
public:
  CublasError(const std::string &message, cublasStatus_t status) : std::runtime_error(message), status_(status) {}
  cublasStatus_t status() const { return status_; }

private:
  cublasStatus_t status_;
};

std::string cublas_error_message(const char *call, cublasStatus_t status);

// One cuBLAS handle (per thread and device; not thread-safe itself).
class CublasHandle {
public:
  CublasHandle();
  ~CublasHandle();
  CublasHandle(const CublasHandle &) = delete;
  CublasHandle &operator=(const CublasHandle &) = delete;
  cublasHandle_t get() const { return handle_; }

private:
  cublasHandle_t handle_ = nullptr;
};

enum class Transpose { no, yes };
enum class GemmOutput { bf16, f32 };

// C[M, N] = op(A) · op(B), row-major, where op(A) is [M, K] and op(B) is
// [K, N]. With Transpose::yes the operand is stored transposed: A as [K, M],
// B as [N, K]. The backward of an MoE layer needs A^T·B (weight gradients)
// and A·B^T (input gradients). Queued on `stream`; C is overwritten.
void gemm_bf16(const CublasHandle &handle, const Stream &stream, Transpose trans_a, Transpose trans_b, int64_t m,
               int64_t n, int64_t k, CUdeviceptr a, CUdeviceptr b, CUdeviceptr c, GemmOutput c_type = GemmOutput::bf16);

// The three forms by name: A·B, A^T·B, A·B^T.
inline void gemm_nn(const CublasHandle &h, const Stream &s, int64_t m, int64_t n, int64_t k, CUdeviceptr a,
                    CUdeviceptr b, CUdeviceptr c, GemmOutput c_type = GemmOutput::bf16) {
  gemm_bf16(h, s, Transpose::no, Transpose::no, m, n, k, a, b, c, c_type);
}
inline void gemm_tn(const CublasHandle &h, const Stream &s, int64_t m, int64_t n, int64_t k, CUdeviceptr a,
                    CUdeviceptr b, CUdeviceptr c, GemmOutput c_type = GemmOutput::bf16) {
  gemm_bf16(h, s, Transpose::yes, Transpose::no, m, n, k, a, b, c, c_type);
}
inline void gemm_nt(const CublasHandle &h, const Stream &s, int64_t m, int64_t n, int64_t k, CUdeviceptr a,
                    CUdeviceptr b, CUdeviceptr c, GemmOutput c_type = GemmOutput::bf16) {
  gemm_bf16(h, s, Transpose::no, Transpose::yes, m, n, k, a, b, c, c_type);
}

// C_e[M, N] = A_e[M, K] · B_e[K, N] for each e in [0, batch): `batch`
// row-major GEMMs of one shape whose operands lie back to back (A_e at
// a + e·M·K elements, B_e at b + e·K·N, C_e at c + e·M·N). An MoE layer's
// expert GEMMs with every expert given the same rows and no routing: what the
// vendor's GEMM does with per-expert weights at its best (dense_roof.h).
void gemm_nn_batched(const CublasHandle &handle, const Stream &stream, int64_t batch, int64_t m, int64_t n, int64_t k,
                     CUdeviceptr a, CUdeviceptr b, CUdeviceptr c, GemmOutput c_type = GemmOutput::bf16);

} // namespace moeforge::cuda
