// NCCL, loaded at run time, and the communicators expert parallelism moves
// rows over.
//
// Like the driver (driver.h), NCCL is opened with dlopen and never linked:
// a machine without it (or without a GPU) still runs every binary, and
// nccl_available() says why it cannot communicate. Every call goes through
// MOEFORGE_NCCL, which throws CudaError naming the call and NCCL's reason.
//
// NCCL's NVLink multicast (NVLS) stays off unless the caller set
// NCCL_NVLS_ENABLE themselves: it reserves device memory per communicator
// and moeforge's exchanges are point-to-point.
#pragma once

#include <nccl.h>

#include <functional>
#include <string>
#include <vector>

#include "backends/cuda/runtime/driver.h"

namespace moeforge::cuda {

#define MOEFORGE_NCCL_FUNCTIONS(X)                                                                                     \
  X(ncclGetErrorString)                                                                                                \
  X(ncclGetLastError)                                                                                                  \
  X(ncclGetUniqueId)                                                                                                   \
  X(ncclCommInitRank)                                                                                                  \
  X(ncclCommInitAll)                                                                                                   \
  X(ncclCommDestroy)                                                                                                   \
  X(ncclCommCount)                                                                                                     \
  X(ncclCommUserRank)                                                                                                  \
  X(ncclCommCuDevice)                                                                                                  \
  X(ncclGroupStart)                                                                                                    \
  X(ncclGroupEnd)                                                                                                      \
  X(ncclSend)                                                                                                          \
  X(ncclRecv)

struct NcclApi {
#define MOEFORGE_NCCL_MEMBER(name) decltype(&::name) name = nullptr;
  MOEFORGE_NCCL_FUNCTIONS(MOEFORGE_NCCL_MEMBER)
#undef MOEFORGE_NCCL_MEMBER
};

// True when NCCL loads and a GPU is usable; otherwise false with the reason.
// The library: $MOEFORGE_LIBNCCL if set, else "libnccl.so.2" (the dynamic
// loader's search path, then the CUDA toolkit's lib64).
bool nccl_available(std::string *why = nullptr);

// The process-wide table. Throws CudaError with nccl_available()'s reason.
const NcclApi &nccl();

void check_nccl(ncclResult_t result, const char *call);

#define MOEFORGE_NCCL(fn, ...) ::moeforge::cuda::check_nccl(::moeforge::cuda::nccl().fn(__VA_ARGS__), #fn)

// One rank's NCCL communicator: owned (made here, destroyed with it) or
// borrowed from a framework that already has one (never destroyed here).
class Communicator {
public:
  // One communicator per listed device, all driven by this process (one
  // thread per rank, or grouped calls): rank i on device `ordinals[i]`.
  static std::vector<Communicator> for_devices(const std::vector<int> &ordinals);
  // This process's rank of `ranks`, all sharing `id` (made by one rank with
  // unique_id() and handed to the others by the caller's own means). The
  // device is the one current on the calling thread.
  static Communicator join(const ncclUniqueId &id, int ranks, int rank);
  static ncclUniqueId unique_id();
  // A framework's communicator (torch.distributed's, say), used as it is.
  static Communicator borrow(ncclComm_t comm);

  Communicator(Communicator &&other) noexcept;
  Communicator &operator=(Communicator &&other) noexcept;
  Communicator(const Communicator &) = delete;
  Communicator &operator=(const Communicator &) = delete;
  ~Communicator();

  ncclComm_t handle() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; } // the CUDA ordinal this rank runs on

private:
  explicit Communicator(ncclComm_t comm, bool owned);
  ncclComm_t comm_ = nullptr;
  bool owned_ = false;
  int rank_ = 0, size_ = 1, device_ = 0;
};

// Runs fn(rank) for every rank on a thread of its own, with device
// ordinals[rank] current there (one process driving several GPUs: a rank's
// NCCL calls wait for its peers', so the ranks cannot take turns on one
// thread), joins them all and rethrows the first failed rank's error.
void on_each_rank(const std::vector<int> &ordinals, const std::function<void(int rank)> &fn);

} // namespace moeforge::cuda
