#include "backends/cuda/runtime/driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <sstream>

// Stringise after macro expansion: MOEFORGE_XSTR(cuMemAlloc) is "cuMemAlloc_v2".
#define MOEFORGE_STR(x) #x
#define MOEFORGE_XSTR(x) MOEFORGE_STR(x)

namespace moeforge::cuda {

bool DriverApi::load(const std::string &library, std::string *why) {
  // RTLD_LOCAL: the driver's symbols serve only this table, never the
  // dynamic linker's global lookup.
  void *handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char *err = dlerror();
    if (why)
      *why = library + " not found (" + (err ? err : "dlopen failed") + ")";
    return false;
  }
  DriverApi table;
#define MOEFORGE_RESOLVE(name)                                                                                         \
  table.name = reinterpret_cast<decltype(table.name)>(dlsym(handle, MOEFORGE_XSTR(name)));                             \
  if (!table.name) {                                                                                                   \
    if (why)                                                                                                           \
      *why = library + " lacks the driver entry point " MOEFORGE_XSTR(name) " (driver older than CUDA " +              \
             std::to_string(CUDA_VERSION / 1000) + "." + std::to_string(CUDA_VERSION % 1000 / 10) + "?)";              \
    dlclose(handle);                                                                                                   \
    return false;                                                                                                      \
  }
  MOEFORGE_DRIVER_FUNCTIONS(MOEFORGE_RESOLVE)
#undef MOEFORGE_RESOLVE
  *this = table;
  return true;
}

std::string driver_library_name() {
  const char *env = std::getenv("MOEFORGE_LIBCUDA");
  return env && *env ? env : "libcuda.so.1";
}

namespace {

// The process-wide driver: loaded and initialised once, with the outcome
// (and the reason for a failure) remembered.
struct ProcessDriver {
  DriverApi api;
  bool loaded = false; // the table is filled (error names can be asked)
  bool ready = false;  // cuInit succeeded and a device exists
  CUresult failure = CUDA_ERROR_NOT_INITIALIZED;
  std::string why;
};

ProcessDriver &process_driver() {
  static ProcessDriver d;
  static std::once_flag once;
  std::call_once(once, [] {
    std::string library = driver_library_name();
    d.loaded = d.api.load(library, &d.why);
    if (!d.loaded)
      return;
    CUresult r = d.api.cuInit(0);
    if (r != CUDA_SUCCESS) {
      const char *name = nullptr, *text = nullptr;
      d.api.cuGetErrorName(r, &name);
      d.api.cuGetErrorString(r, &text);
      d.why = driver_error_message("cuInit", r, name, text);
      d.failure = r;
      return;
    }
    int count = 0;
    r = d.api.cuDeviceGetCount(&count);
    if (r != CUDA_SUCCESS || count < 1) {
      d.why = r != CUDA_SUCCESS ? driver_error_message("cuDeviceGetCount", r, nullptr, nullptr)
                                : library + " loaded, but it reports no CUDA device";
      d.failure = r != CUDA_SUCCESS ? r : CUDA_ERROR_NO_DEVICE;
      return;
    }
    d.ready = true;
  });
  return d;
}

} // namespace

bool gpu_available(std::string *why) {
  const ProcessDriver &d = process_driver();
  if (!d.ready && why)
    *why = d.why;
  return d.ready;
}

const DriverApi &driver() {
  const ProcessDriver &d = process_driver();
  if (!d.ready)
    throw CudaError("no usable GPU: " + d.why, d.failure);
  return d.api;
}

std::string driver_error_message(const char *call, CUresult code, const char *name, const char *description) {
  std::ostringstream s;
  s << call << " failed: ";
  if (name)
    s << name;
  else
    s << "CUDA error " << static_cast<int>(code);
  if (description)
    s << " (" << description << ")";
  return s.str();
}

void check_driver(CUresult result, const char *call) {
  if (result == CUDA_SUCCESS)
    return;
  // The error names are static strings inside the driver; ask only if the
  // table is loaded (a failure may be reported before that).
  const char *name = nullptr, *text = nullptr;
  const ProcessDriver &d = process_driver();
  if (d.loaded) {
    if (d.api.cuGetErrorName(result, &name) != CUDA_SUCCESS)
      name = nullptr;
    if (d.api.cuGetErrorString(result, &text) != CUDA_SUCCESS)
      text = nullptr;
  }
  throw CudaError(driver_error_message(call, result, name, text), result);
}

} // namespace moeforge::cuda
