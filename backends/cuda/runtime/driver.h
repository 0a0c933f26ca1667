// The CUDA driver API, loaded at run time.
//
// moeforge never links libcuda: machines without a GPU (developer machines,
// CI) have no libcuda.so.1, and a binary linked against it would not start
// there. Instead the driver library is dlopen'ed on first use and the entry
// points moeforge needs are looked up into a table of function pointers. If
// the library is missing, that simply means "no GPU": gpu_available() says
// so and GPU tests skip.
//
// Calls go through the table with the names cuda.h documents:
//     MOEFORGE_CU(cuMemAlloc, &ptr, bytes);
// which calls driver().cuMemAlloc(...) and throws CudaError naming the call
// and the driver's reason when the result is not CUDA_SUCCESS.
#pragma once

#include <cuda.h>

#include <stdexcept>
#include <string>

namespace moeforge::cuda {

// Every driver entry point moeforge uses. cuda.h #defines many of these
// names to versioned symbols (cuMemAlloc -> cuMemAlloc_v2, cuGraphInstantiate
// -> cuGraphInstantiateWithFlags, ...); the table member gets the same
// rename, and the loader looks up the *expanded* name, so each pointer has
// exactly the signature the header declares for it.
#define MOEFORGE_DRIVER_FUNCTIONS(X)                                                                                   \
  X(cuInit)                                                                                                            \
  X(cuDriverGetVersion)                                                                                                \
  X(cuGetErrorName)                                                                                                    \
  X(cuGetErrorString)                                                                                                  \
  X(cuDeviceGet)                                                                                                       \
  X(cuDeviceGetCount)                                                                                                  \
  X(cuDeviceGetName)                                                                                                   \
  X(cuDeviceGetAttribute)                                                                                              \
  X(cuDeviceGetPCIBusId)                                                                                               \
  X(cuDevicePrimaryCtxRetain)                                                                                          \
  X(cuDevicePrimaryCtxRelease)                                                                                         \
  X(cuCtxSetCurrent)                                                                                                   \
  X(cuCtxSynchronize)                                                                                                  \
  X(cuMemAlloc)                                                                                                        \
  X(cuMemFree)                                                                                                         \
  X(cuMemcpyHtoD)                                                                                                      \
  X(cuMemcpyDtoH)                                                                                                      \
  X(cuMemcpyDtoD)                                                                                                      \
  X(cuMemcpyHtoDAsync)                                                                                                 \
  X(cuMemcpyDtoHAsync)                                                                                                 \
  X(cuMemcpyDtoDAsync)                                                                                                 \
  X(cuMemHostAlloc)                                                                                                    \
  X(cuMemHostGetDevicePointer)                                                                                         \
  X(cuMemFreeHost)                                                                                                     \
  X(cuMemsetD8)                                                                                                        \
  X(cuMemsetD32)                                                                                                       \
  X(cuMemsetD2D32)                                                                                                     \
  X(cuMemsetD8Async)                                                                                                   \
  X(cuMemsetD32Async)                                                                                                  \
  X(cuModuleLoadData)                                                                                                  \
  X(cuModuleUnload)                                                                                                    \
  X(cuModuleGetFunction)                                                                                               \
  X(cuModuleGetGlobal)                                                                                                 \
  X(cuFuncSetAttribute)                                                                                                \
  X(cuFuncGetAttribute)                                                                                                \
  X(cuLaunchKernel)                                                                                                    \
  X(cuLaunchKernelEx)                                                                                                  \
  X(cuStreamCreate)                                                                                                    \
  X(cuStreamCreateWithPriority)                                                                                        \
  X(cuCtxGetStreamPriorityRange)                                                                                       \
  X(cuStreamDestroy)                                                                                                   \
  X(cuStreamSynchronize)                                                                                               \
  X(cuStreamWaitEvent)                                                                                                 \
  X(cuStreamBeginCapture)                                                                                              \
  X(cuStreamIsCapturing)                                                                                               \
  X(cuStreamEndCapture)                                                                                                \
  X(cuGraphInstantiate)                                                                                                \
  X(cuGraphLaunch)                                                                                                     \
  X(cuGraphExecDestroy)                                                                                                \
  X(cuGraphDestroy)                                                                                                    \
  X(cuEventCreate)                                                                                                     \
  X(cuEventRecord)                                                                                                     \
  X(cuEventSynchronize)                                                                                                \
  X(cuEventElapsedTime)                                                                                                \
  X(cuEventDestroy)                                                                                                    \
  X(cuTensorMapEncodeTiled)

struct DriverApi {
#define MOEFORGE_DRIVER_MEMBER(name) decltype(&::name) name = nullptr;
  MOEFORGE_DRIVER_FUNCTIONS(MOEFORGE_DRIVER_MEMBER)
#undef MOEFORGE_DRIVER_MEMBER

  // dlopen's `library` and resolves every entry point. Returns false with the
  // reason in *why (library not found, or the first symbol missing). The
  // library stays loaded for the life of the process.
  bool load(const std::string &library, std::string *why);
};

// The library the process-wide driver comes from: $MOEFORGE_LIBCUDA if set,
// else "libcuda.so.1" (found through the dynamic loader's search path).
std::string driver_library_name();

// True when the driver loads, cuInit succeeds and there is at least one
// device. Otherwise false, with the reason in *why (when why is not null),
// e.g. "libcuda.so.1 not found (...)". Cheap after the first call.
bool gpu_available(std::string *why = nullptr);

// The process-wide driver table, loaded and initialised (cuInit) on first
// use. Throws CudaError with gpu_available()'s reason when there is no GPU.
const DriverApi &driver();

// A failed driver call (or no driver at all).
class CudaError : public std::runtime_error {
public:
  CudaError(const std::string &message, CUresult code) : std::runtime_error(message), code_(code) {}
  CUresult code() const { return code_; }

private:
  CUresult code_;
};

// "cuModuleLoadData failed: CUDA_ERROR_INVALID_IMAGE (device kernel image is
// invalid)". `name` and `description` come from cuGetErrorName/String; when
// those are unavailable (null), the numeric code is shown instead.
std::string driver_error_message(const char *call, CUresult code, const char *name, const char *description);

// Throws CudaError for anything but CUDA_SUCCESS, asking the loaded driver
// for the error's name and description.
void check_driver(CUresult result, const char *call);

} // namespace moeforge::cuda

// Calls a driver entry point through the table and checks its result. The
// first argument is stringised before macro expansion, so messages show the
// documented name ("cuMemAlloc"), while the call uses the versioned member.
#define MOEFORGE_CU(fn, ...) ::moeforge::cuda::check_driver(::moeforge::cuda::driver().fn(__VA_ARGS__), #fn)
