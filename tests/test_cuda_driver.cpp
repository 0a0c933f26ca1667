// The driver layer without a GPU: how "no GPU" is reported, how failed calls
// are worded, and that every entry point moeforge looks up exists under the
// name it looks for (checked against the toolkit's stub libcuda).
#include <doctest/doctest.h>

#include "runtime/tensor.h"

#include <cmath>
#include <filesystem>
#include <string>

#include "backends/cuda/codegen/nvrtc_compiler.h"
#include "backends/cuda/runtime/cublas_gemm.h"
#include "backends/cuda/runtime/driver.h"

using namespace moeforge;
using namespace moeforge::cuda;
using moeforge::bf16_bits;
using moeforge::bf16_value;

TEST_CASE("cuda: gpu_available gives a reason when it says no") {
  std::string why;
  bool available = gpu_available(&why);
  if (available) {
    MESSAGE("this machine has a GPU; the no-GPU path is not exercised here");
    CHECK(why.empty());
    return;
  }
  MESSAGE("no GPU: " << why);
  CHECK_FALSE(why.empty());
  // Whatever the reason, asking for the driver must fail with it, not crash.
  try {
    driver();
    FAIL("driver() returned without a GPU");
  } catch (const CudaError &e) {
    CHECK(std::string(e.what()).find(why) != std::string::npos);
  }
}

TEST_CASE("cuda: a missing driver library is reported by name") {
  DriverApi api;
  std::string why;
  CHECK_FALSE(api.load("libcuda-that-does-not-exist.so.1", &why));
  CHECK(why.find("libcuda-that-does-not-exist.so.1 not found") == 0);
}

TEST_CASE("cuda: a failed driver call names the call and the reason") {
  CHECK(driver_error_message("cuModuleLoadData", CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE",
                             "device kernel image is invalid") ==
        "cuModuleLoadData failed: CUDA_ERROR_INVALID_IMAGE (device kernel image is invalid)");
  // Without the driver there is no name to ask for: the code is shown.
  CHECK(driver_error_message("cuMemAlloc", CUDA_ERROR_OUT_OF_MEMORY, nullptr, nullptr) ==
        "cuMemAlloc failed: CUDA error 2");
  try {
    check_driver(CUDA_ERROR_INVALID_VALUE, "cuMemsetD32");
    FAIL("check_driver accepted an error");
  } catch (const CudaError &e) {
    CHECK(e.code() == CUDA_ERROR_INVALID_VALUE);
    CHECK(std::string(e.what()).rfind("cuMemsetD32 failed: ", 0) == 0);
  }
  CHECK_NOTHROW(check_driver(CUDA_SUCCESS, "cuInit"));
}

TEST_CASE("cuda: every driver entry point resolves in the toolkit's stub libcuda") {
  // The stub exports every driver symbol (its functions only return
  // CUDA_ERROR_STUB_LIBRARY), so loading it checks the versioned names the
  // table looks up, without a GPU.
  std::filesystem::path stub = "/usr/local/cuda/lib64/stubs/libcuda.so";
  if (!std::filesystem::exists(stub)) {
    MESSAGE("SKIPPED: no stub libcuda at " << stub.string());
    return;
  }
  DriverApi api;
  std::string why;
  REQUIRE_MESSAGE(api.load(stub.string(), &why), why);
  // Spot checks of renamed entry points (cuMemAlloc_v2, cuGraphInstantiateWithFlags).
  bool resolved = api.cuMemAlloc != nullptr && api.cuGraphInstantiate != nullptr && api.cuLaunchKernel != nullptr;
  CHECK(resolved);
  CUresult init = api.cuInit(0);
  CHECK(init != CUDA_SUCCESS); // a stub has no GPU behind it
}

TEST_CASE("cuda: cuBLAS errors name the call and the status") {
  std::string m = cublas_error_message("cublasGemmEx", CUBLAS_STATUS_INVALID_VALUE);
  CHECK(m.rfind("cublasGemmEx failed: CUBLAS_STATUS_INVALID_VALUE (", 0) == 0);
}

TEST_CASE("cuda: host bf16 conversion rounds to nearest even") {
  CHECK(bf16_bits(1.0f) == 0x3F80);
  CHECK(bf16_value(0x3F80) == 1.0f);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even 1.
  CHECK(bf16_bits(1.0f + 1.0f / 256) == 0x3F80);
  CHECK(bf16_bits(1.0f + 3.0f / 256) == 0x3F82);
  CHECK(bf16_bits(-2.5f) == 0xC020);
  CHECK(std::isnan(bf16_value(bf16_bits(std::nanf("")))));
}
