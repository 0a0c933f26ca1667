#include "backends/cuda/runtime/device.h"

#include "dsl/error.h"

#include <algorithm>
#include <utility>

namespace moeforge::cuda {

namespace {
int attribute(CUdevice device, CUdevice_attribute which) {
  int value = 0;
  MOEFORGE_CU(cuDeviceGetAttribute, &value, which, device);
  return value;
}
// Runs a synchronous buffer operation with the device idle on both sides:
// all work queued before it is done first, and it is done when this returns
// (see DeviceBuffer for why plain driver calls are not enough).
template <typename Op> void synchronously(Op op) {
  MOEFORGE_CU(cuCtxSynchronize);
  op();
  MOEFORGE_CU(cuCtxSynchronize);
}
} // namespace

Device::Device(int ordinal) : ordinal_(ordinal) {
  int count = 0;
  MOEFORGE_CU(cuDeviceGetCount, &count);
  user_check(ordinal >= 0 && ordinal < count)
      << "there is no CUDA device " << ordinal << ": this machine has " << count;
  MOEFORGE_CU(cuDeviceGet, &device_, ordinal);
  MOEFORGE_CU(cuDevicePrimaryCtxRetain, &context_, device_);
  MOEFORGE_CU(cuCtxSetCurrent, context_);

  char name[256] = {};
  MOEFORGE_CU(cuDeviceGetName, name, static_cast<int>(sizeof(name)), device_);
  name_ = name;
  char bus[32] = {}; // "dddd:bb:dd.f" and its terminator fit 13 bytes
  MOEFORGE_CU(cuDeviceGetPCIBusId, bus, static_cast<int>(sizeof(bus)), device_);
  pci_bus_id_ = bus;
  sm_count_ = attribute(device_, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  cc_major_ = attribute(device_, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  cc_minor_ = attribute(device_, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  max_smem_optin_ = attribute(device_, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
  l2_bytes_ = attribute(device_, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
}

Device::~Device() {
  // Releasing the last reference resets the primary context (and frees what
  // is still allocated in it), so Devices should outlive their buffers.
  if (context_)
    driver().cuDevicePrimaryCtxRelease(device_);
}

void Device::make_current() const { MOEFORGE_CU(cuCtxSetCurrent, context_); }

void Device::synchronize() const {
  make_current();
  MOEFORGE_CU(cuCtxSynchronize);
}

std::string Device::arch() const { return "sm_" + std::to_string(cc_major_ * 10 + cc_minor_); }

std::string Device::arch_specific() const { return cc_major_ >= 9 ? arch() + "a" : arch(); }

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  // cuMemAlloc rejects zero bytes; an empty buffer is still a valid object
  // (an empty expert, a zero-token batch).
  if (bytes > 0)
    MOEFORGE_CU(cuMemAlloc, &ptr_, bytes);
}

DeviceBuffer DeviceBuffer::view(CUdeviceptr ptr, size_t bytes) {
  DeviceBuffer b;
  b.ptr_ = ptr;
  b.bytes_ = bytes;
  b.owned_ = false;
  return b;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ && owned_)
    driver().cuMemFree(ptr_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer &&other) noexcept
    : ptr_(std::exchange(other.ptr_, 0)), bytes_(std::exchange(other.bytes_, 0)),
      owned_(std::exchange(other.owned_, true)) {}

DeviceBuffer &DeviceBuffer::operator=(DeviceBuffer &&other) noexcept {
  std::swap(ptr_, other.ptr_);
  std::swap(bytes_, other.bytes_);
  std::swap(owned_, other.owned_);
  return *this;
}

void DeviceBuffer::check_fits(size_t bytes, const char *what) const {
  user_check(bytes <= bytes_) << what << " of " << bytes << " bytes does not fit a device buffer of " << bytes_
                              << " bytes";
}

void DeviceBuffer::upload_bytes(const void *host, size_t bytes) {
  check_fits(bytes, "upload");
  if (bytes)
    synchronously([&] { MOEFORGE_CU(cuMemcpyHtoD, ptr_, host, bytes); });
}

void DeviceBuffer::download_bytes(void *host, size_t bytes) const {
  check_fits(bytes, "download");
  if (bytes)
    synchronously([&] { MOEFORGE_CU(cuMemcpyDtoH, host, ptr_, bytes); });
}

void DeviceBuffer::upload_bytes_async(const void *host, size_t bytes, const Stream &stream) {
  check_fits(bytes, "upload");
  if (bytes)
    MOEFORGE_CU(cuMemcpyHtoDAsync, ptr_, host, bytes, stream.handle());
}

void DeviceBuffer::download_bytes_async(void *host, size_t bytes, const Stream &stream) const {
  check_fits(bytes, "download");
  if (bytes)
    MOEFORGE_CU(cuMemcpyDtoHAsync, host, ptr_, bytes, stream.handle());
}

void DeviceBuffer::copy_from(const DeviceBuffer &source) {
  size_t bytes = std::min(bytes_, source.bytes_);
  if (bytes)
    synchronously([&] { MOEFORGE_CU(cuMemcpyDtoD, ptr_, source.ptr_, bytes); });
}

void DeviceBuffer::memset(uint8_t value) {
  if (bytes_)
    synchronously([&] { MOEFORGE_CU(cuMemsetD8, ptr_, value, bytes_); });
}

void DeviceBuffer::memset_async(uint8_t value, const Stream &stream) {
  if (bytes_)
    MOEFORGE_CU(cuMemsetD8Async, ptr_, value, bytes_, stream.handle());
}

void DeviceBuffer::fill32(uint32_t pattern) {
  user_check(bytes_ % 4 == 0) << "fill32 on a buffer of " << bytes_ << " bytes: not a whole number of 32-bit words";
  if (bytes_)
    synchronously([&] { MOEFORGE_CU(cuMemsetD32, ptr_, pattern, bytes_ / 4); });
}

void DeviceBuffer::fill32_rows(uint32_t pattern, size_t pitch, size_t row_bytes, size_t rows) {
  user_check(row_bytes % 4 == 0 && pitch % 4 == 0 && ptr_ % 4 == 0)
      << "fill32_rows: rows of " << row_bytes << " bytes every " << pitch << " bytes are not whole 32-bit words";
  internal_check(rows == 0 || (rows - 1) * pitch + row_bytes <= bytes_)
      << "fill32_rows: " << rows << " rows every " << pitch << " bytes pass the buffer's " << bytes_;
  if (rows && row_bytes)
    synchronously([&] { MOEFORGE_CU(cuMemsetD2D32, ptr_, pitch, pattern, row_bytes / 4, rows); });
}

void DeviceBuffer::fill32_async(uint32_t pattern, const Stream &stream) {
  user_check(bytes_ % 4 == 0) << "fill32 on a buffer of " << bytes_ << " bytes: not a whole number of 32-bit words";
  if (bytes_)
    MOEFORGE_CU(cuMemsetD32Async, ptr_, pattern, bytes_ / 4, stream.handle());
}

} // namespace moeforge::cuda
