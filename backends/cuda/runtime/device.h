// A GPU and its memory.
//
// `Device` retains the device's *primary* context and makes it current on the
// calling thread. The primary context is the one the CUDA runtime uses too,
// so libraries built on the runtime (cuBLAS) share it, and its memory, with
// moeforge. `DeviceBuffer` owns one allocation in it.
#pragma once

#include "backends/cuda/runtime/driver.h"
#include "backends/cuda/runtime/stream.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moeforge::cuda {

class Device {
public:
  // Retains the primary context of device `ordinal` and makes it current on
  // this thread. Throws CudaError when there is no GPU (see gpu_available).
  explicit Device(int ordinal = 0);
  ~Device();
  Device(const Device &) = delete;
  Device &operator=(const Device &) = delete;

  // For use from another thread: contexts are current per thread.
  void make_current() const;
  // Waits for all work on the device (every stream).
  void synchronize() const;

  int ordinal() const { return ordinal_; }
  CUdevice handle() const { return device_; }
  CUcontext context() const { return context_; }
  const std::string &name() const { return name_; }
  // "0000:19:00.0": the device's PCI address, by which tools outside CUDA
  // (NVML) find the same card whatever their own numbering.
  const std::string &pci_bus_id() const { return pci_bus_id_; }
  int sm_count() const { return sm_count_; }
  int cc_major() const { return cc_major_; }
  int cc_minor() const { return cc_minor_; }
  // Shared memory a block may use after opting in (Kernel::set_max_dynamic_shared_memory).
  int max_shared_memory_optin() const { return max_smem_optin_; }
  int l2_bytes() const { return l2_bytes_; }
  // NVRTC's name for the architecture: "sm_90".
  std::string arch() const;
  // The architecture with its arch-specific features (wgmma, setmaxnreg):
  // "sm_90a" on compute capability 9.0 and later. Such a cubin runs only on
  // exactly that compute capability.
  std::string arch_specific() const;

private:
  int ordinal_ = 0;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  std::string name_, pci_bus_id_;
  int sm_count_ = 0, cc_major_ = 0, cc_minor_ = 0, max_smem_optin_ = 0, l2_bytes_ = 0;
};

// A 32-bit pattern that is a NaN as a float and a huge positive number as an
// int32: written over outputs before a kernel runs, so a value the kernel
// failed to write cannot pass for a right one.
inline constexpr uint32_t kPoisonNaN = 0x7FBFDEADu;
// All ones: -1 as int32, a NaN as float. Use together with kPoisonNaN, since
// -1 is a legitimate value of some outputs.
inline constexpr uint32_t kPoisonOnes = 0xFFFFFFFFu;

// One device allocation (in the context current at construction).
//
// The synchronous copies and fills are for setup, tests and debugging: they
// first wait for all work queued on the device (so a download sees what the
// kernels wrote, and an upload does not overwrite data a kernel still
// reads), and they have completed when they return (so work queued on any
// stream afterwards sees them). Plain driver calls would not give that: they
// run on the legacy default stream, which moeforge's non-blocking streams do
// not wait for. Inside a step use the *_async ones, queued on its stream.
class DeviceBuffer {
public:
  DeviceBuffer() = default;
  // Zero bytes is allowed: no allocation, ptr() is 0.
  explicit DeviceBuffer(size_t bytes);
  // `bytes` at `ptr` inside another buffer, which must outlive this one; not
  // freed by it.
  static DeviceBuffer view(CUdeviceptr ptr, size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer &&other) noexcept;
  DeviceBuffer &operator=(DeviceBuffer &&other) noexcept;
  DeviceBuffer(const DeviceBuffer &) = delete;
  DeviceBuffer &operator=(const DeviceBuffer &) = delete;

  // A buffer holding a copy of `host`.
  template <typename T> static DeviceBuffer from(const std::vector<T> &host) {
    DeviceBuffer b(host.size() * sizeof(T));
    b.upload(host);
    return b;
  }

  CUdeviceptr ptr() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  // False for a view (memory someone else owns).
  bool owned() const { return owned_; }
  // The address of the device pointer, as a kernel argument wants it.
  void *arg() { return &ptr_; }

  // Copies `host` to the start of the buffer (it must fit).
  template <typename T> void upload(const std::vector<T> &host) { upload_bytes(host.data(), host.size() * sizeof(T)); }
  // Copies the first `count` elements (default: as many as fit) back.
  template <typename T> std::vector<T> download(size_t count = SIZE_MAX) const {
    if (count == SIZE_MAX)
      count = bytes_ / sizeof(T);
    std::vector<T> host(count);
    download_bytes(host.data(), count * sizeof(T));
    return host;
  }
  template <typename T> void upload_async(const std::vector<T> &host, const Stream &stream) {
    upload_bytes_async(host.data(), host.size() * sizeof(T), stream);
  }

  void upload_bytes(const void *host, size_t bytes);
  void download_bytes(void *host, size_t bytes) const;
  // `host` must stay alive (and, to overlap, be pinned) until the stream gets there.
  void upload_bytes_async(const void *host, size_t bytes, const Stream &stream);
  void download_bytes_async(void *host, size_t bytes, const Stream &stream) const;
  // Device-to-device copy of min(bytes(), source.bytes()) bytes.
  void copy_from(const DeviceBuffer &source);

  // Every byte set to `value`.
  void memset(uint8_t value);
  void memset_async(uint8_t value, const Stream &stream);
  // Every 32-bit word set to `pattern` (poisoning outputs; bytes() must be a
  // multiple of 4).
  void fill32(uint32_t pattern);
  // fill32 of `rows` runs of `row_bytes`, each `pitch` bytes after the last
  // (a tensor stored inside a larger one: the bytes between are another's).
  void fill32_rows(uint32_t pattern, size_t pitch, size_t row_bytes, size_t rows);
  void fill32_async(uint32_t pattern, const Stream &stream);

private:
  void check_fits(size_t bytes, const char *what) const;
  CUdeviceptr ptr_ = 0;
  size_t bytes_ = 0;
  bool owned_ = true;
};

} // namespace moeforge::cuda
