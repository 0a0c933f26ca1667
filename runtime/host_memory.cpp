#include "runtime/host_memory.h"

#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <string>

#include "dsl/error.h"

namespace moeforge {

namespace {

// A "Name:   123 kB" line's value in bytes from a /proc file, or SIZE_MAX.
size_t proc_kib_field(const char *file, const std::string &name) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(name + ":", 0) == 0) {
      std::istringstream fields(line.substr(name.size() + 1));
      unsigned long long kib = 0;
      if (fields >> kib)
        return static_cast<size_t>(kib) * 1024;
    }
  return SIZE_MAX;
}

std::string gib(size_t bytes) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(bytes < (size_t(10) << 30) ? 2 : 1) << double(bytes) / double(1 << 30);
  return s.str();
}

} // namespace

size_t host_bytes_available() {
  size_t have = proc_kib_field("/proc/meminfo", "MemAvailable");
  rlimit limit{};
  if (getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    const size_t mapped = proc_kib_field("/proc/self/status", "VmSize");
    const size_t cap = static_cast<size_t>(limit.rlim_cur);
    const size_t left = mapped == SIZE_MAX ? cap : (mapped < cap ? cap - mapped : 0);
    have = left < have ? left : have;
  }
  return have;
}

namespace {
constexpr size_t kUnchecked = size_t(64) << 20; // below this, reading the limits costs more than it risks
} // namespace

void check_host_allocation(size_t bytes, const std::string &what) {
  if (bytes < kUnchecked)
    return;
  // A sixteenth of what is free (at least 512 MiB) stays free: each
  // allocation is checked on its own, and a layer whose tensors each fit
  // could otherwise fill the machine to the last few hundred MiB, where the
  // OOM killer, not this message, ends the run.
  size_t have = host_bytes_available();
  if (have != SIZE_MAX)
    have -= std::min(have, std::max(size_t(512) << 20, have / 16));
  user_check(bytes <= have) << what << " needs " << gib(bytes) << " GiB of host memory, and " << gib(have)
                            << " GiB is available: lower the token count or the layer's sizes (the CLI's "
                            << "--tokens, --d, --f, --experts; the Dims' extents and the tokens given from C++ "
                            << "or Python)";
}

void check_host_array(const std::vector<int64_t> &shape, size_t value_bytes, const std::string &what,
                      const std::string &after) {
  size_t n = 1;
  for (int64_t e : shape)
    n *= static_cast<size_t>(e);
  if (n * value_bytes < kUnchecked)
    return;
  std::string dims;
  for (int64_t e : shape)
    dims += (dims.empty() ? "" : " x ") + std::to_string(e);
  check_host_allocation(n * value_bytes, what + " of " + dims + " values" + after);
}

} // namespace moeforge
