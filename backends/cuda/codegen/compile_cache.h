// The on-disk cache of NVRTC output, so a process that compiles the same
// kernel source again (every test run, every benchmark start) loads the
// cubin instead of spending seconds in NVRTC.
//
// An entry is keyed by a hash of everything that determines the cubin:
// source, headers, options, architecture, NVRTC version. Each entry is one
// file holding the cubin and the compile log, written to a temporary name
// and renamed into place, so readers never see half an entry. An entry that
// fails any check (truncated, wrong key, bad checksum, not an ELF image) is a
// miss: the caller recompiles and overwrites it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moeforge::cuda {

// 64-bit FNV-1a, fed piece by piece. Not cryptographic: it guards against
// accidents (stale entries), not adversaries.
class Fnv1a64 {
public:
  static constexpr uint64_t kOffsetBasis = 0xcbf29ce484222325ull;
  explicit Fnv1a64(uint64_t basis = kOffsetBasis) : state_(basis) {}
  void add(std::string_view bytes);
  // Adds the length first, so ("ab", "c") and ("a", "bc") hash differently.
  void add_field(std::string_view bytes);
  uint64_t value() const { return state_; }

private:
  uint64_t state_;
};

// Two FNV-1a hashes of the same fields from different starting points: the
// first names the file, the second is stored inside it and must match, which
// makes an undetected collision need both to collide.
struct CacheKey {
  uint64_t name = 0;
  uint64_t check = 0;
  static CacheKey of(const std::vector<std::string_view> &fields);
  std::string hex() const; // 16 hex digits of `name`
  bool operator==(const CacheKey &) const = default;
};

struct CacheEntry {
  std::vector<char> cubin;
  std::string log;
};

class CompileCache {
public:
  // Entries live in `directory`/nvrtc/.
  explicit CompileCache(std::filesystem::path directory);

  // $MOEFORGE_CACHE_DIR, else $XDG_CACHE_HOME/moeforge, else
  // $HOME/.cache/moeforge; empty when none of them is set.
  static std::filesystem::path default_directory();

  // The entry for `key`, or nothing on a miss or a corrupt entry.
  std::optional<CacheEntry> load(const CacheKey &key) const;
  // Best effort: a cache that cannot be written (read-only home, full disk)
  // must not fail a compile, so failures return false instead of throwing.
  bool store(const CacheKey &key, const CacheEntry &entry) const;

  std::filesystem::path entry_path(const CacheKey &key) const;

private:
  std::filesystem::path directory_;
};

} // namespace moeforge::cuda
