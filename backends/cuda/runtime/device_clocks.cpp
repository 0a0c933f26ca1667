#include "backends/cuda/runtime/device_clocks.h"

#include <dlfcn.h>

#include <chrono>
#include <map>
#include <mutex>
#include <stdexcept>

namespace moeforge::cuda {

// The few NVML entry points read here, declared from NVML's documented C
// API (the CUDA toolkit ships no nvml.h without its development package).
// nvmlReturn_t is an enum whose success value is 0; the device is an opaque
// handle.
struct ClockSampler::Nvml {
  using Device = void *;
  int (*init)() = nullptr;
  const char *(*error_string)(int) = nullptr;
  int (*by_pci_bus_id)(const char *, Device *) = nullptr;
  int (*clock_info)(Device, int, unsigned *) = nullptr;
  int (*power_usage)(Device, unsigned *) = nullptr;
  int (*power_limit)(Device, unsigned *) = nullptr;
  int (*clock_reasons)(Device, unsigned long long *) = nullptr;

  static constexpr int kSuccess = 0;
  static constexpr int kClockSm = 1; // NVML_CLOCK_SM
  // nvmlClocksEventReasons bits.
  static constexpr unsigned long long kSwPowerCap = 0x4;
  static constexpr unsigned long long kHwSlowdown = 0x8, kSwThermal = 0x20, kHwThermal = 0x40, kPowerBrake = 0x80;

  // Throws with the call's name and NVML's reason for anything but success.
  void check(int result, const char *call) const {
    if (result != kSuccess)
      throw std::runtime_error(std::string(call) + " failed: " + error_string(result) + " (NVML error " +
                               std::to_string(result) + ")");
  }
};

namespace {

// Loaded and initialised once per process and library name; null with the
// reason when NVML is absent. The library stays loaded for the process
// (never dlclose'd or shut down: samplers may outlive any one owner).
std::shared_ptr<const ClockSampler::Nvml> load_nvml(const std::string &library, std::string *why);

} // namespace

std::unique_ptr<ClockSampler> ClockSampler::open(const std::string &pci_bus_id, std::string *why,
                                                 const std::string &library) {
  std::shared_ptr<const Nvml> nvml = load_nvml(library, why);
  if (!nvml)
    return nullptr;
  Nvml::Device device = nullptr;
  const int r = nvml->by_pci_bus_id(pci_bus_id.c_str(), &device);
  if (r != Nvml::kSuccess) {
    if (why)
      *why = "nvmlDeviceGetHandleByPciBusId_v2(" + pci_bus_id + ") failed: " + nvml->error_string(r);
    return nullptr;
  }
  return std::unique_ptr<ClockSampler>(new ClockSampler(std::move(nvml), device));
}

ClockSampler::ClockSampler(std::shared_ptr<const Nvml> nvml, void *device) : nvml_(std::move(nvml)), device_(device) {}

ClockSampler::~ClockSampler() {
  if (thread_.joinable()) {
    running_ = false;
    thread_.join();
  }
}

void ClockSampler::sample() {
  unsigned mhz = 0, mw = 0;
  unsigned long long reasons = 0;
  nvml_->check(nvml_->clock_info(device_, Nvml::kClockSm, &mhz), "nvmlDeviceGetClockInfo(NVML_CLOCK_SM)");
  nvml_->check(nvml_->power_usage(device_, &mw), "nvmlDeviceGetPowerUsage");
  nvml_->check(nvml_->clock_reasons(device_, &reasons), "nvmlDeviceGetCurrentClocksEventReasons");
  ++samples_;
  mhz_ += mhz;
  watts_ += mw * 1e-3;
  capped_ += (reasons & Nvml::kSwPowerCap) ? 1 : 0;
  thermal_ += (reasons & (Nvml::kHwSlowdown | Nvml::kSwThermal | Nvml::kHwThermal | Nvml::kPowerBrake)) ? 1 : 0;
}

void ClockSampler::start() {
  if (thread_.joinable())
    throw std::logic_error("ClockSampler::start: already sampling");
  samples_ = 0;
  mhz_ = watts_ = capped_ = thermal_ = 0;
  running_ = true;
  thread_ = std::thread([this] {
    // An NVML failure ends the sampling; stop() then samples on the
    // calling thread and so raises the same failure where it can be caught.
    try {
      while (running_) {
        sample();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } catch (const std::runtime_error &) {
      running_ = false;
    }
  });
}

ClockReading ClockSampler::stop() {
  if (!thread_.joinable())
    throw std::logic_error("ClockSampler::stop: not sampling");
  running_ = false;
  thread_.join();
  sample(); // the region's end; also re-raises a failure the thread met
  unsigned limit_mw = 0;
  nvml_->check(nvml_->power_limit(device_, &limit_mw), "nvmlDeviceGetEnforcedPowerLimit");
  ClockReading r;
  r.samples = samples_;
  r.sm_mhz = mhz_ / samples_;
  r.power_w = watts_ / samples_;
  r.power_capped = capped_ / samples_;
  r.thermal = thermal_ / samples_;
  r.power_limit_w = limit_mw * 1e-3;
  return r;
}

namespace {

std::shared_ptr<const ClockSampler::Nvml> load_nvml_once(const std::string &library, std::string &why) {
  void *lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char *err = dlerror();
    why = library + " not found (" + (err ? err : "dlopen failed") + ")";
    return nullptr;
  }
  auto nvml = std::make_shared<ClockSampler::Nvml>();
  auto resolve = [&](auto &fn, const char *name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    return fn != nullptr;
  };
  // The clock-reason query was renamed (Throttle -> Event) in newer
  // drivers; both names resolve to the same call where both exist.
  const bool ok = resolve(nvml->init, "nvmlInit_v2") && resolve(nvml->error_string, "nvmlErrorString") &&
                  resolve(nvml->by_pci_bus_id, "nvmlDeviceGetHandleByPciBusId_v2") &&
                  resolve(nvml->clock_info, "nvmlDeviceGetClockInfo") &&
                  resolve(nvml->power_usage, "nvmlDeviceGetPowerUsage") &&
                  resolve(nvml->power_limit, "nvmlDeviceGetEnforcedPowerLimit") &&
                  (resolve(nvml->clock_reasons, "nvmlDeviceGetCurrentClocksEventReasons") ||
                   resolve(nvml->clock_reasons, "nvmlDeviceGetCurrentClocksThrottleReasons"));
  if (!ok) {
    why = library + " lacks an entry point the clock sampler reads";
    return nullptr;
  }
  const int r = nvml->init();
  if (r != ClockSampler::Nvml::kSuccess) {
    why = std::string("nvmlInit_v2 failed: ") + nvml->error_string(r);
    return nullptr;
  }
  return nvml;
}

std::shared_ptr<const ClockSampler::Nvml> load_nvml(const std::string &library, std::string *why) {
  struct Loaded {
    std::shared_ptr<const ClockSampler::Nvml> nvml;
    std::string failure;
  };
  static std::mutex mutex;
  static std::map<std::string, Loaded> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = loaded.find(library);
  if (it == loaded.end()) {
    Loaded l;
    l.nvml = load_nvml_once(library, l.failure);
    it = loaded.emplace(library, std::move(l)).first;
  }
  if (!it->second.nvml && why)
    *why = it->second.failure;
  return it->second.nvml;
}

} // namespace

} // namespace moeforge::cuda
