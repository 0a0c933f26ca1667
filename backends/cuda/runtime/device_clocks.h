// What the card ran at while a region was timed: its SM clock, board power
// and the reasons the driver gave for holding the clock down, sampled
// through NVML on a thread of its own.
//
// Why: an H100 under a long bf16 GEMM is held at its power limit, so the SM
// clock, not the instruction schedule alone, sets a kernel's time. Two
// kernels that issue the same cycles can differ by the clock their power
// allows, and a kernel that hides idle phases (a persistent walk hiding a
// tile's setup) may gain no time if the card then runs at a lower clock.
// Reading the clock beside each timed region separates the two: cycles
// (time x clock) from energy (the clock the work allowed).
//
// NVML is the driver's own library (libnvidia-ml.so.1), loaded with dlopen
// as the driver is (driver.cpp): a machine without a GPU has none, and
// everything still builds and runs there without readings. Only reads are
// made; clocks and limits are never set.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

namespace moeforge::cuda {

// Means over the samples of one region.
struct ClockReading {
  int samples = 0;
  double sm_mhz = 0;        // SM clock
  double power_w = 0;       // board power (the driver's running average)
  double power_capped = 0;  // fraction of samples with the software power cap holding the clock
  double thermal = 0;       // fraction with a thermal or hardware slowdown
  double power_limit_w = 0; // the enforced power limit
};

class ClockSampler {
public:
  // The sampler for the GPU at `pci_bus_id` (Device::pci_bus_id), or null
  // with the reason in *why when NVML (`library`) or the device cannot be
  // opened.
  static std::unique_ptr<ClockSampler> open(const std::string &pci_bus_id, std::string *why,
                                            const std::string &library = "libnvidia-ml.so.1");
  ~ClockSampler();
  ClockSampler(const ClockSampler &) = delete;
  ClockSampler &operator=(const ClockSampler &) = delete;

  // Samples every millisecond from start() until stop(); stop() returns
  // the means (at least one sample: stop() reads once more itself).
  void start();
  ClockReading stop();

  struct Nvml; // the NVML entry points (device_clocks.cpp)

private:
  ClockSampler(std::shared_ptr<const Nvml> nvml, void *device);
  void sample();

  std::shared_ptr<const Nvml> nvml_;
  void *device_ = nullptr; // nvmlDevice_t
  std::thread thread_;
  std::atomic<bool> running_{false};
  // Sums over the samples, written by the sampling thread only while it runs.
  int samples_ = 0;
  double mhz_ = 0, watts_ = 0, capped_ = 0, thermal_ = 0;
};

} // namespace moeforge::cuda
