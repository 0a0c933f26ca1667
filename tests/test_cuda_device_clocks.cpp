// The card's clocks through NVML (device_clocks.h): a missing library and an
// unknown device are reported by name, and on a GPU the sampler reads the
// device it was opened for, with its state checked at start and stop.
#include <doctest/doctest.h>

#include <chrono>
#include <regex>
#include <stdexcept>
#include <string>
#include <thread>

#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/device_clocks.h"
#include "tests/gpu_test.h"

using namespace moeforge;
using namespace moeforge::cuda;

TEST_CASE("cuda: the clock sampler names a missing NVML library") {
  std::string why;
  auto sampler = ClockSampler::open("0000:00:00.0", &why, "libnvidia-ml-absent.so.1");
  CHECK(sampler == nullptr);
  CHECK(why.find("libnvidia-ml-absent.so.1 not found") != std::string::npos);
}

TEST_SUITE("gpu") {
  TEST_CASE("cuda gpu: the clock sampler reads the device's SM clock, power cap and limit") {
    MOEFORGE_REQUIRE_GPU();
    Device device;
    // CUDA's form of the address, which NVML's lookup accepts.
    CHECK(std::regex_match(device.pci_bus_id(), std::regex("[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\\.[0-7]")));
    std::string why;
    auto sampler = ClockSampler::open(device.pci_bus_id(), &why);
    REQUIRE_MESSAGE(sampler != nullptr, "NVML ships with the driver on a GPU machine; " << why);
    CHECK_THROWS_AS(sampler->stop(), std::logic_error); // not sampling yet
    sampler->start();
    CHECK_THROWS_AS(sampler->start(), std::logic_error);        // already sampling
    std::this_thread::sleep_for(std::chrono::milliseconds(50)); // a sample a millisecond or so
    const ClockReading r = sampler->stop();
    CHECK(r.samples >= 4); // the thread's samples and stop()'s own
    CHECK(r.sm_mhz > 0);
    CHECK(r.sm_mhz < 5000);
    CHECK(r.power_limit_w > 0);
    CHECK(r.power_limit_w < 5000);
    CHECK(r.power_capped >= 0);
    CHECK(r.power_capped <= 1);
    CHECK(r.thermal >= 0);
    CHECK(r.thermal <= 1);
    // Sampling again after a stop starts from zero: an immediate stop has
    // a sample or two, not the first run's as well.
    sampler->start();
    const ClockReading again = sampler->stop();
    CHECK(again.samples >= 1);
    CHECK(again.samples < r.samples);
  }

  TEST_CASE("cuda gpu: the clock sampler names a device NVML does not know") {
    MOEFORGE_REQUIRE_GPU();
    std::string why;
    auto sampler = ClockSampler::open("ffff:ff:1f.7", &why);
    CHECK(sampler == nullptr);
    CHECK(why.find("nvmlDeviceGetHandleByPciBusId_v2(ffff:ff:1f.7) failed") != std::string::npos);
  }
}
