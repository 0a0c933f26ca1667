#include "backends/cuda/parallel/nccl.h"

#include <dlfcn.h>

#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include "backends/cuda/runtime/device.h"
#include "dsl/error.h"

namespace moeforge::cuda {
namespace {

struct ProcessNccl {
  NcclApi api;
  bool ready = false;
  std::string why;
};

// Opens `library` and resolves every entry point; false with the reason.
bool load(const std::string &library, NcclApi *api, std::string *why) {
  void *handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char *err = dlerror();
    *why = library + " not found (" + (err ? err : "dlopen failed") + ")";
    return false;
  }
  NcclApi table;
#define MOEFORGE_NCCL_RESOLVE(name)                                                                                    \
  table.name = reinterpret_cast<decltype(table.name)>(dlsym(handle, #name));                                           \
  if (!table.name) {                                                                                                   \
    *why = library + " lacks " #name " (NCCL older than 2.19?)";                                                       \
    dlclose(handle);                                                                                                   \
    return false;                                                                                                      \
  }
  MOEFORGE_NCCL_FUNCTIONS(MOEFORGE_NCCL_RESOLVE)
#undef MOEFORGE_NCCL_RESOLVE
  *api = table;
  return true;
}

ProcessNccl &process_nccl() {
  static ProcessNccl n;
  static std::once_flag once;
  std::call_once(once, [] {
    if (!gpu_available(&n.why))
      return;
    // No NVLink multicast unless asked for (see nccl.h); NCCL reads it at
    // communicator creation, so before any.
    setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
    std::vector<std::string> candidates;
    if (const char *env = std::getenv("MOEFORGE_LIBNCCL"); env && *env)
      candidates.push_back(env);
    else
      candidates = {"libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2"};
    std::string reasons;
    for (const std::string &c : candidates) {
      std::string why;
      if (load(c, &n.api, &why)) {
        n.ready = true;
        return;
      }
      reasons += (reasons.empty() ? "" : "; ") + why;
    }
    n.why = reasons + " (set MOEFORGE_LIBNCCL to the library's path)";
  });
  return n;
}

} // namespace

bool nccl_available(std::string *why) {
  const ProcessNccl &n = process_nccl();
  if (!n.ready && why)
    *why = n.why;
  return n.ready;
}

const NcclApi &nccl() {
  const ProcessNccl &n = process_nccl();
  if (!n.ready)
    throw CudaError("NCCL is not usable: " + n.why, CUDA_ERROR_NOT_FOUND);
  return n.api;
}

void check_nccl(ncclResult_t result, const char *call) {
  if (result == ncclSuccess)
    return;
  const NcclApi &api = nccl();
  std::string message = std::string(call) + " failed: " + api.ncclGetErrorString(result);
  // NCCL's last error on this thread, whichever communicator it came from.
  if (const char *last = api.ncclGetLastError(nullptr); last && *last)
    message += " (" + std::string(last) + ")";
  throw CudaError(message, CUDA_ERROR_UNKNOWN);
}

void on_each_rank(const std::vector<int> &ordinals, const std::function<void(int rank)> &fn) {
  std::vector<std::exception_ptr> errors(ordinals.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ordinals.size(); ++r)
    threads.emplace_back([&, r] {
      try {
        Device device(ordinals[r]);
        fn(static_cast<int>(r));
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (std::thread &t : threads)
    t.join();
  for (std::exception_ptr &e : errors)
    if (e)
      std::rethrow_exception(e);
}

Communicator::Communicator(ncclComm_t comm, bool owned) : comm_(comm), owned_(owned) {
  MOEFORGE_NCCL(ncclCommUserRank, comm_, &rank_);
  MOEFORGE_NCCL(ncclCommCount, comm_, &size_);
  MOEFORGE_NCCL(ncclCommCuDevice, comm_, &device_);
}

std::vector<Communicator> Communicator::for_devices(const std::vector<int> &ordinals) {
  user_check(!ordinals.empty()) << "Communicator::for_devices: no device listed";
  std::vector<ncclComm_t> comms(ordinals.size(), nullptr);
  MOEFORGE_NCCL(ncclCommInitAll, comms.data(), static_cast<int>(ordinals.size()), ordinals.data());
  std::vector<Communicator> out;
  for (ncclComm_t c : comms)
    out.push_back(Communicator(c, true));
  return out;
}

ncclUniqueId Communicator::unique_id() {
  ncclUniqueId id;
  MOEFORGE_NCCL(ncclGetUniqueId, &id);
  return id;
}

Communicator Communicator::join(const ncclUniqueId &id, int ranks, int rank) {
  user_check(ranks >= 1 && rank >= 0 && rank < ranks)
      << "Communicator::join: rank " << rank << " of " << ranks << " is out of range (0.." << ranks - 1 << ")";
  ncclComm_t comm = nullptr;
  MOEFORGE_NCCL(ncclCommInitRank, &comm, ranks, id, rank);
  return Communicator(comm, true);
}

Communicator Communicator::borrow(ncclComm_t comm) {
  user_check(comm != nullptr) << "Communicator::borrow: a null ncclComm_t";
  return Communicator(comm, false);
}

Communicator::Communicator(Communicator &&other) noexcept
    : comm_(std::exchange(other.comm_, nullptr)), owned_(std::exchange(other.owned_, false)), rank_(other.rank_),
      size_(other.size_), device_(other.device_) {}

Communicator &Communicator::operator=(Communicator &&other) noexcept {
  std::swap(comm_, other.comm_);
  std::swap(owned_, other.owned_);
  std::swap(rank_, other.rank_);
  std::swap(size_, other.size_);
  std::swap(device_, other.device_);
  return *this;
}

Communicator::~Communicator() {
  // Destructors must not throw; a failure to destroy leaves nothing to do.
  if (comm_ && owned_)
    nccl().ncclCommDestroy(comm_);
}

} // namespace moeforge::cuda
