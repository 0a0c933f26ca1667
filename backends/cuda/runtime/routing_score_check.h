// A routing score that is NaN or infinite, caught on the GPU.
//
// On the host, top_k refuses such a score at once (dsl/top_k_select.h): a
// NaN compares false with everything, so any order would choose by it
// silently. The device's top-k kernels cannot throw, and a layer's work is
// queued without the host waiting for it (a framework's step, a replayed
// CUDA graph), so they report it instead: they still choose k experts in
// range for the token, write NaN gates for it, keep the lowest
// (route, token, expert) of such a score in device memory and raise a flag
// in host memory mapped into the device. The host reads that flag for
// free, with no synchronisation, at every entry point of the layer (the
// error then names the call it was seen at, which may come after the one
// that routed), and after the synchronous calls have waited for their
// work; only when it is raised does it wait for the stream, read the key,
// clear both and throw a UserError naming the token and the expert.
#pragma once

#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/stream.h"

#include <cstdint>
#include <string>
#include <vector>

namespace moeforge::cuda {

// The key the kernels keep the lowest of (device/routing_kernels.cuh,
// report_non_finite): route index << 48 | token << 8 | expert (E <= 256).
struct NonFiniteScore {
  int route = 0;
  int64_t token = 0;
  int expert = 0;
};
inline constexpr uint64_t kNoNonFiniteScore = ~uint64_t(0);
uint64_t routing_route_tag(int route);
NonFiniteScore decode_non_finite_score(uint64_t key);
// The UserError's text for `score`, reported at `call` ("forward()"), the
// route named from `routes` (the layer's routes by index).
std::string non_finite_score_message(const NonFiniteScore &score, const std::vector<std::string> &routes,
                                     const std::string &call);

// Where the kernels report, and the host's reading of it. One per layer;
// needs the layer's context current.
class RoutingScoreCheck {
public:
  RoutingScoreCheck();
  ~RoutingScoreCheck();
  RoutingScoreCheck(const RoutingScoreCheck &) = delete;
  RoutingScoreCheck &operator=(const RoutingScoreCheck &) = delete;

  // Kernel arguments: the device key (u64) and the mapped flag (u32).
  void *first_bad_arg() { return key_.arg(); }
  void *seen_arg() { return &seen_device_; }
  CUdeviceptr first_bad() const { return key_.ptr(); }
  CUdeviceptr seen() const { return seen_device_; }

  // Whether a kernel has raised the flag (no synchronisation).
  bool raised() const;
  // When raised: waits for `stream`, reads the key, clears the key and the
  // flag, and throws the UserError (non_finite_score_message). Otherwise
  // returns at once.
  void throw_if_raised(const Stream &stream, const std::vector<std::string> &routes, const std::string &call);

private:
  DeviceBuffer key_;                       // u64, kNoNonFiniteScore when none
  volatile uint32_t *seen_host_ = nullptr; // page-locked, mapped into the device
  CUdeviceptr seen_device_ = 0;
  void clear();
};

} // namespace moeforge::cuda
