#include "backends/cuda/codegen/compile_cache.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>

namespace moeforge::cuda {

void Fnv1a64::add(std::string_view bytes) {
  for (unsigned char c : bytes) {
    state_ ^= c;
    state_ *= 0x100000001b3ull; // the 64-bit FNV prime
  }
}

void Fnv1a64::add_field(std::string_view bytes) {
  uint64_t n = bytes.size();
  add(std::string_view(reinterpret_cast<const char *>(&n), sizeof(n)));
  add(bytes);
}

CacheKey CacheKey::of(const std::vector<std::string_view> &fields) {
  // Any fixed basis different from the standard one gives a second hash.
  Fnv1a64 name, check(0x84222325cbf29ce4ull);
  for (std::string_view f : fields) {
    name.add_field(f);
    check.add_field(f);
  }
  return {name.value(), check.value()};
}

std::string CacheKey::hex() const {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(name));
  return buf;
}

namespace {

// Entry layout: magic, then five little-endian u64 (key.name, key.check,
// cubin bytes, log bytes, payload checksum), then the cubin, then the log.
constexpr char kMagic[16] = {'M', 'O', 'E', 'F', 'O', 'R', 'G', 'E', '-', 'N', 'V', 'R', 'T', 'C', '1', '\n'};
constexpr size_t kHeaderBytes = sizeof(kMagic) + 5 * sizeof(uint64_t);

uint64_t payload_checksum(const std::vector<char> &cubin, const std::string &log) {
  Fnv1a64 h;
  h.add_field(std::string_view(cubin.data(), cubin.size()));
  h.add_field(log);
  return h.value();
}

std::filesystem::path env_path(const char *name) {
  const char *v = std::getenv(name);
  return v && *v ? std::filesystem::path(v) : std::filesystem::path();
}

} // namespace

CompileCache::CompileCache(std::filesystem::path directory) : directory_(std::move(directory)) {}

std::filesystem::path CompileCache::default_directory() {
  if (auto p = env_path("MOEFORGE_CACHE_DIR"); !p.empty())
    return p;
  if (auto p = env_path("XDG_CACHE_HOME"); !p.empty())
    return p / "moeforge";
  if (auto p = env_path("HOME"); !p.empty())
    return p / ".cache" / "moeforge";
  return {};
}

std::filesystem::path CompileCache::entry_path(const CacheKey &key) const {
  return directory_ / "nvrtc" / (key.hex() + ".cubin-entry");
}

std::optional<CacheEntry> CompileCache::load(const CacheKey &key) const {
  std::ifstream in(entry_path(key), std::ios::binary);
  if (!in)
    return std::nullopt;
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.size() < kHeaderBytes || std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0)
    return std::nullopt;
  uint64_t header[5];
  std::memcpy(header, bytes.data() + sizeof(kMagic), sizeof(header));
  auto [name, check, cubin_bytes, log_bytes, checksum] = header;
  if (name != key.name || check != key.check)
    return std::nullopt;
  // Compare as sizes first: huge garbage values must not overflow the sum.
  if (cubin_bytes > bytes.size() || log_bytes > bytes.size() || kHeaderBytes + cubin_bytes + log_bytes != bytes.size())
    return std::nullopt;
  CacheEntry e;
  e.cubin.assign(bytes.data() + kHeaderBytes, bytes.data() + kHeaderBytes + cubin_bytes);
  e.log.assign(bytes.data() + kHeaderBytes + cubin_bytes, log_bytes);
  if (payload_checksum(e.cubin, e.log) != checksum)
    return std::nullopt;
  // A cubin is an ELF image; anything else would only fail later, in the driver.
  if (e.cubin.size() < 4 || std::memcmp(e.cubin.data(),
                                        "\x7f"
                                        "ELF",
                                        4) != 0)
    return std::nullopt;
  return e;
}

bool CompileCache::store(const CacheKey &key, const CacheEntry &entry) const {
  std::filesystem::path final_path = entry_path(key);
  std::error_code ec;
  std::filesystem::create_directories(final_path.parent_path(), ec);
  if (ec)
    return false;
  // A name no other writer uses (process id, and a counter for threads), in
  // the same directory so that rename() is atomic.
  static std::atomic<uint64_t> counter{0};
  std::filesystem::path temp = final_path;
  temp += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    if (!out)
      return false;
    uint64_t header[5] = {key.name, key.check, entry.cubin.size(), entry.log.size(),
                          payload_checksum(entry.cubin, entry.log)};
    out.write(kMagic, sizeof(kMagic));
    out.write(reinterpret_cast<const char *>(header), sizeof(header));
    out.write(entry.cubin.data(), static_cast<std::streamsize>(entry.cubin.size()));
    out.write(entry.log.data(), static_cast<std::streamsize>(entry.log.size()));
    out.close();
    if (!out) {
      std::filesystem::remove(temp, ec);
      return false;
    }
  }
  std::filesystem::rename(temp, final_path, ec);
  if (ec) {
    std::filesystem::remove(temp, ec);
    return false;
  }
  return true;
}

} // namespace moeforge::cuda
