#include "backends/cuda/runtime/routing_score_check.h"

#include "backends/cuda/runtime/driver.h"
#include "dsl/error.h"

#include <sstream>

namespace moeforge::cuda {

uint64_t routing_route_tag(int route) {
  internal_check(route >= 0 && route < 256) << "route index " << route << " past the key's 8 bits";
  return static_cast<uint64_t>(route) << 48;
}

NonFiniteScore decode_non_finite_score(uint64_t key) {
  return {static_cast<int>(key >> 48), static_cast<int64_t>((key >> 8) & ((uint64_t(1) << 40) - 1)),
          static_cast<int>(key & 0xff)};
}

std::string non_finite_score_message(const NonFiniteScore &score, const std::vector<std::string> &routes,
                                     const std::string &call) {
  std::ostringstream m;
  m << "top_k";
  if (score.route >= 0 && static_cast<size_t>(score.route) < routes.size())
    m << " (route " << routes[static_cast<size_t>(score.route)] << ")";
  m << ": the routing score of token " << score.token << ", expert " << score.expert
    << " is NaN or infinite on the GPU, which chooses no expert by any order (seen at " << call
    << "; the token's gates were made NaN): find where it comes from (the router's inputs or weights, a "
       "selection bias)";
  return m.str();
}

RoutingScoreCheck::RoutingScoreCheck() : key_(sizeof(uint64_t)) {
  void *host = nullptr;
  // Page-locked and mapped: the kernels write the flag where the host reads
  // it without a copy, and the host's read waits for nothing.
  MOEFORGE_CU(cuMemHostAlloc, &host, sizeof(uint32_t), CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE);
  seen_host_ = static_cast<volatile uint32_t *>(host);
  *seen_host_ = 0;
  MOEFORGE_CU(cuMemHostGetDevicePointer, &seen_device_, host, 0);
  key_.memset(0xff);
}

RoutingScoreCheck::~RoutingScoreCheck() {
  if (seen_host_)
    cuda::driver().cuMemFreeHost(const_cast<uint32_t *>(seen_host_)); // a destructor cannot throw
}

bool RoutingScoreCheck::raised() const { return *seen_host_ != 0; }

void RoutingScoreCheck::clear() {
  key_.memset(0xff);
  *seen_host_ = 0;
}

void RoutingScoreCheck::throw_if_raised(const Stream &stream, const std::vector<std::string> &routes,
                                        const std::string &call) {
  if (!raised())
    return;
  stream.synchronize(); // the kernels that raised it have finished their atomics
  const uint64_t key = key_.download<uint64_t>(1).at(0);
  clear();
  throw UserError(non_finite_score_message(decode_non_finite_score(key), routes, call));
}

} // namespace moeforge::cuda
