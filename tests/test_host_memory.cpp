// runtime/host_memory.h: host allocations too large for the
// machine are refused with the sizes and the fix, before they are made (the
// reference's intermediates, host tensors, the CPU backend's tensors), not
// ended by std::bad_alloc.
#include <doctest/doctest.h>

#include <sys/resource.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

#include "dsl/error.h"
#include "runtime/host_memory.h"
#include "runtime/tensor.h"
#include "user_error.h"

using namespace moeforge;

namespace {

// The process's mapped bytes now (/proc/self/status VmSize).
size_t mapped_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmSize:", 0) == 0)
      return static_cast<size_t>(std::stoull(line.substr(7))) * 1024;
  return 0;
}

} // namespace

TEST_CASE("host memory: what a machine has is known, and more than it has is refused with both sizes") {
  const size_t have = host_bytes_available();
  CHECK(have > (size_t(64) << 20));
  CHECK(have < SIZE_MAX);
  const std::string m = testing::user_error_of([] { check_host_allocation(size_t(1) << 60, "a test's buffer"); });
  CHECK(m.find("a test's buffer needs 1073741824.0 GiB of host memory, and ") != std::string::npos);
  CHECK(m.find(" GiB is available: lower the token count or the layer's sizes (the CLI's --tokens, --d, --f, "
               "--experts; the Dims' extents and the tokens given from C++ or Python)") != std::string::npos);
  // Small ones pass unchecked; one that fits passes.
  CHECK_NOTHROW(check_host_allocation(size_t(1) << 20, "a small buffer"));
  CHECK_NOTHROW(check_host_allocation(size_t(64) << 20, "a buffer that fits"));
  // All that is free is more than one allocation may take: a sixteenth (at
  // least 512 MiB) stays for the rest of the run.
  const size_t all = host_bytes_available();
  const std::string full = testing::user_error_of([&] { check_host_allocation(all, "everything free"); });
  CHECK(full.find("everything free needs ") != std::string::npos);
}

TEST_CASE("host memory: a host tensor larger than the machine is refused before it is allocated") {
  const std::string m = testing::user_error_of([] { HostTensor t({1 << 20, 1 << 20}); });
  CHECK(m.find("a host tensor of 1048576 x 1048576 values (doubles) needs 8192.0 GiB of host memory") !=
        std::string::npos);
  const std::string u = testing::user_error_of([] { HostTensor::uninitialized({1 << 20, 1 << 20}); });
  CHECK(u.find("needs 8192.0 GiB") != std::string::npos);
}

TEST_CASE("host memory: under an address-space limit, what is left of it counts") {
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer maps terabytes of shadow and maps more as it goes: a
  // limit just past what is mapped could fail its own bookkeeping.
  MESSAGE("SKIPPED under AddressSanitizer: it cannot run under a tight address-space limit");
  return;
#endif
  rlimit before{};
  REQUIRE(getrlimit(RLIMIT_AS, &before) == 0);
  const size_t mapped = mapped_bytes();
  REQUIRE(mapped > 0);
  // 256 MiB past what the process maps: a 1 GiB buffer cannot fit.
  rlimit tight = before;
  tight.rlim_cur = mapped + (size_t(256) << 20);
  if (before.rlim_max != RLIM_INFINITY && tight.rlim_cur > before.rlim_max)
    tight.rlim_cur = before.rlim_max;
  REQUIRE(setrlimit(RLIMIT_AS, &tight) == 0);
  const size_t have = host_bytes_available();
  std::string m;
  try {
    check_host_allocation(size_t(1) << 30, "a 1 GiB buffer");
  } catch (const UserError &e) {
    m = e.what();
  }
  REQUIRE(setrlimit(RLIMIT_AS, &before) == 0);
  // What is left is read after the limit is set, and the process may have
  // unmapped a few pages since `mapped` was read (a finished thread's stack,
  // a freed arena): a little more than 256 MiB can be left. Without the
  // limit counted it would be the machine's whole memory.
  CHECK(have <= (size_t(256) << 20) + (size_t(16) << 20));
  CHECK(have < (size_t(1) << 30));
  CHECK(m.find("a 1 GiB buffer needs 1.00 GiB of host memory") != std::string::npos);
}
