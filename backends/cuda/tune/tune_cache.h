// Tuned schedules on disk: the winner of `moeforge tune` for a pipeline, a
// token count (bucketed to the next power of two), a device and a compiler,
// as a schedule file whose first line records that key in full. A file
// whose key differs (a hash collision, or an entry written by another
// compiler or moeforge version) or that does not parse is a miss, never an
// error: the cache only ever saves a search.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "dsl/pipeline.h"
#include "schedules/schedule.h"

namespace moeforge::cuda {

struct TuneKey {
  std::string pipeline;     // the algebra as printed (every Func, Input, Param and shape)
  int64_t token_bucket = 0; // the token count rounded up to a power of two
  std::string device;       // e.g. "NVIDIA H200"
  std::string compiler;     // moeforge's version and NVRTC's
  bool training = false;    // the forward alone, or the training step

  // The key as one line (the file's first line, after "# tuned for: ").
  std::string text() const;
  std::string file_name() const; // a hash of text(), hex, ".sched"
};

// token_bucket's rounding: 1, 2, 4, ...
int64_t token_bucket(int64_t tokens);

// The key `moeforge tune` stores its winner under and `--schedule auto`
// (the CLI's, and moeforge.torch's) looks up: the pipeline as printed, the
// token count's bucket, the device's name, and moeforge's version
// (`moeforge_version`, e.g. "0.11.0") with NVRTC's.
TuneKey tune_key(const Pipeline &pipeline, int64_t tokens, const std::string &device, bool training,
                 const std::string &moeforge_version);

class TuneCache {
public:
  // Entries live in `directory`/tune/.
  explicit TuneCache(std::filesystem::path directory);

  // The schedule tuned for `key`, or nothing (no entry, another key's, a
  // file that does not parse); `why` says which when given.
  std::optional<Schedule> load(const TuneKey &key, std::string *why = nullptr) const;
  // Writes the entry; false (not an exception) where it cannot.
  bool store(const TuneKey &key, const Schedule &schedule) const;
  std::filesystem::path entry_path(const TuneKey &key) const;

private:
  std::filesystem::path directory_;
};

} // namespace moeforge::cuda
