#include "backends/cuda/tune/tune_cache.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "backends/cuda/codegen/nvrtc_compiler.h"
#include "dsl/error.h"

namespace moeforge::cuda {

namespace {

const char *kHeader = "# tuned for: ";

// One line: the pipeline's text has newlines, which the header cannot.
std::string one_line(const std::string &s) {
  std::string out;
  for (char c : s)
    out += c == '\n' ? std::string("\\n") : std::string(1, c);
  return out;
}

uint64_t fnv1a(const std::string &s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

} // namespace

TuneKey tune_key(const Pipeline &pipeline, int64_t tokens, const std::string &device, bool training,
                 const std::string &moeforge_version) {
  std::ostringstream algebra;
  algebra << pipeline;
  return TuneKey{algebra.str(), token_bucket(tokens), device,
                 "moeforge " + moeforge_version + ", NVRTC " + nvrtc_version(), training};
}

std::string TuneKey::text() const {
  std::ostringstream o;
  o << (training ? "training" : "forward") << " | tokens <= " << token_bucket << " | " << device << " | " << compiler
    << " | " << one_line(pipeline);
  return o.str();
}

std::string TuneKey::file_name() const {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(fnv1a(text())));
  return std::string(hex) + ".sched";
}

int64_t token_bucket(int64_t tokens) {
  int64_t b = 1;
  while (b < tokens && b < (int64_t(1) << 62))
    b *= 2;
  return b;
}

TuneCache::TuneCache(std::filesystem::path directory) : directory_(std::move(directory)) {}

std::filesystem::path TuneCache::entry_path(const TuneKey &key) const { return directory_ / "tune" / key.file_name(); }

std::optional<Schedule> TuneCache::load(const TuneKey &key, std::string *why) const {
  auto say = [&](const std::string &w) {
    if (why)
      *why = w;
    return std::nullopt;
  };
  std::ifstream in(entry_path(key));
  if (!in)
    return say("no tuned schedule cached for this pipeline, token count, device and compiler");
  std::string first;
  std::getline(in, first);
  if (first != kHeader + key.text())
    return say("the cached entry " + entry_path(key).string() + " was tuned for something else (" +
               first.substr(0, 80) + "...): ignored");
  std::stringstream rest;
  rest << in.rdbuf();
  try {
    return Schedule::from_text(rest.str(), entry_path(key).string());
  } catch (const UserError &e) {
    return say("the cached entry " + entry_path(key).string() + " does not parse (" + e.what() + "): ignored");
  }
}

bool TuneCache::store(const TuneKey &key, const Schedule &schedule) const {
  std::error_code ec;
  std::filesystem::create_directories(directory_ / "tune", ec);
  if (ec)
    return false;
  // Written whole to a temporary name, then renamed: a reader never sees
  // half an entry.
  const std::filesystem::path path = entry_path(key), tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp);
    out << kHeader << key.text() << "\n" << schedule.to_text();
    if (!out.good())
      return false;
  }
  std::filesystem::rename(tmp, path, ec);
  return !ec;
}

} // namespace moeforge::cuda
