// The card's clocks as Google Benchmark counters, for every benchmark that
// times the GPU against a roof (backends/cuda/runtime/device_clocks.h says why they are read).
#pragma once

#include <benchmark/benchmark.h>

#include <cstdio>
#include <memory>
#include <string>

#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/device_clocks.h"

namespace moeforge::bench {

// The process's sampler for `device`, or null where NVML cannot be read
// (said once on stderr; the benchmarks then report no clock counters).
inline cuda::ClockSampler *clocks_of(const cuda::Device &device) {
  static std::unique_ptr<cuda::ClockSampler> sampler = [&] {
    std::string why;
    auto s = cuda::ClockSampler::open(device.pci_bus_id(), &why);
    if (!s)
      std::fprintf(stderr, "no clock readings: %s\n", why.c_str());
    return s;
  }();
  return sampler.get();
}

// A region's reading as counters, named with `prefix` ("" for ours, "roof_").
inline void report_clocks(benchmark::State &state, const std::string &prefix, const cuda::ClockReading &r) {
  state.counters[prefix + "sm_MHz"] = r.sm_mhz;
  state.counters[prefix + "power_W"] = r.power_w;
  state.counters[prefix + "pcap_pct"] = 100.0 * r.power_capped;
  state.counters[prefix + "thermal_pct"] = 100.0 * r.thermal;
}

// Counters for ours and the roof timed at the card's steady state
// (moe_shapes.h's steady_seconds): steady_ms, steady_roof_TFLOPs,
// ratio_steady = roof ms / our ms; where the clocks were read, each side's
// and ratio_steady_cycles = (roof ms x roof MHz) / (our ms x our MHz), the
// ratio with the clock difference taken out, so that the part of a gap that
// is cycles shows apart from the part that is the clock the power limit
// allowed each.
inline void report_steady(benchmark::State &state, bool with_clocks, double flops, double ours_ms,
                          const cuda::ClockReading &ours, double roof_ms, const cuda::ClockReading &roof) {
  state.counters["steady_ms"] = ours_ms;
  state.counters["steady_roof_TFLOPs"] = flops / (roof_ms * 1e-3) / 1e12;
  state.counters["ratio_steady"] = roof_ms / ours_ms;
  if (!with_clocks)
    return;
  report_clocks(state, "steady_", ours);
  report_clocks(state, "steady_roof_", roof);
  state.counters["ratio_steady_cycles"] = (roof_ms * roof.sm_mhz) / (ours_ms * ours.sm_mhz);
}

// Means of several readings' means (a benchmark's timed iterations).
struct ClockMeans {
  cuda::ClockReading sum;
  int n = 0;
  void add(const cuda::ClockReading &r) {
    sum.sm_mhz += r.sm_mhz, sum.power_w += r.power_w, sum.power_capped += r.power_capped, sum.thermal += r.thermal;
    sum.power_limit_w = r.power_limit_w;
    ++n;
  }
  cuda::ClockReading mean() const {
    cuda::ClockReading m = sum;
    if (n > 0)
      m.sm_mhz /= n, m.power_w /= n, m.power_capped /= n, m.thermal /= n;
    return m;
  }
};

} // namespace moeforge::bench
