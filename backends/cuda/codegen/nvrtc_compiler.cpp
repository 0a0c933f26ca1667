#include "backends/cuda/codegen/nvrtc_compiler.h"

#include "backends/cuda/codegen/compile_cache.h"

#include <dlfcn.h>
#include <nvrtc.h>

#include <cstdlib>
#include <regex>
#include <sstream>

namespace moeforge::cuda {

namespace {

void check_nvrtc(nvrtcResult result, const char *call) {
  if (result != NVRTC_SUCCESS)
    throw NvrtcError(std::string(call) + " failed: " + nvrtcGetErrorString(result));
}

// Owns an nvrtcProgram so every exit path destroys it.
class Program {
public:
  Program(const std::string &source, const std::string &name, const std::vector<NamedHeader> &headers) {
    std::vector<const char *> contents, names;
    for (const NamedHeader &h : headers) {
      contents.push_back(h.content.c_str());
      names.push_back(h.name.c_str());
    }
    check_nvrtc(nvrtcCreateProgram(&program_, source.c_str(), name.c_str(), static_cast<int>(headers.size()),
                                   contents.data(), names.data()),
                "nvrtcCreateProgram");
  }
  ~Program() { nvrtcDestroyProgram(&program_); }
  Program(const Program &) = delete;
  Program &operator=(const Program &) = delete;
  nvrtcProgram get() const { return program_; }

private:
  nvrtcProgram program_ = nullptr;
};

std::string program_log(nvrtcProgram program) {
  size_t size = 0;
  check_nvrtc(nvrtcGetProgramLogSize(program, &size), "nvrtcGetProgramLogSize");
  std::string log(size, '\0');
  check_nvrtc(nvrtcGetProgramLog(program, log.data()), "nvrtcGetProgramLog");
  while (!log.empty() && (log.back() == '\0' || log.back() == '\n'))
    log.pop_back();
  return log;
}

bool has_bf16_header(const std::filesystem::path &dir) {
  std::error_code ec;
  return !dir.empty() && std::filesystem::exists(dir / "cuda_bf16.h", ec);
}

// The folder of the NVRTC library this process actually loaded, so the
// headers match the compiler even when several toolkits are installed.
std::filesystem::path nvrtc_library_folder() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void *>(&nvrtcVersion), &info) == 0 || !info.dli_fname)
    return {};
  std::error_code ec;
  std::filesystem::path lib = std::filesystem::canonical(info.dli_fname, ec);
  return ec ? std::filesystem::path() : lib.parent_path();
}

// Line `line` (1-based) of `text`, or empty.
std::string line_of(const std::string &text, int line) {
  std::istringstream in(text);
  std::string s;
  for (int i = 1; std::getline(in, s); ++i)
    if (i == line)
      return s;
  return {};
}

// NVRTC reports errors as "name(12): error: ..." (or "catastrophic error").
// Build the message around the first one, quoting the line it points at from
// the program or the in-memory header it names.
std::string compile_error_message(const std::string &source, const std::string &program_name,
                                  const CompileOptions &options, nvrtcResult result, const std::string &log) {
  std::ostringstream msg;
  msg << "NVRTC could not compile '" << program_name << "' for " << options.arch << " (" << nvrtcGetErrorString(result)
      << ")";
  static const std::regex error_line(R"(^(.*)\((\d+)\): (catastrophic )?error.*$)");
  std::istringstream lines(log);
  std::string l;
  std::smatch m;
  while (std::getline(lines, l)) {
    if (!std::regex_match(l, m, error_line))
      continue;
    std::string file = m[1];
    int line = std::stoi(m[2]);
    std::string quoted;
    if (file == program_name)
      quoted = line_of(source, line);
    for (const NamedHeader &h : options.headers)
      if (file == h.name)
        quoted = line_of(h.content, line);
    msg << "\nfirst error: " << l;
    if (!quoted.empty())
      msg << "\n  " << line << " | " << quoted;
    break;
  }
  msg << "\nNVRTC log:\n" << log;
  return msg.str();
}

} // namespace

std::string nvrtc_version() {
  int major = 0, minor = 0;
  check_nvrtc(nvrtcVersion(&major, &minor), "nvrtcVersion");
  return std::to_string(major) + "." + std::to_string(minor);
}

std::string cuda_include_directory() {
  if (const char *env = std::getenv("MOEFORGE_CUDA_INCLUDE"); env && *env)
    return env; // the user's word, even if it looks wrong: NVRTC will say so
  std::filesystem::path lib = nvrtc_library_folder();
  std::vector<std::filesystem::path> candidates;
  if (!lib.empty()) {
    candidates.push_back(lib.parent_path() / "include"); // <toolkit>/lib64 -> <toolkit>/include
    candidates.push_back(lib.parent_path().parent_path() / "include");
  }
#ifdef MOEFORGE_CUDA_TOOLKIT_INCLUDE
  candidates.push_back(MOEFORGE_CUDA_TOOLKIT_INCLUDE);
#endif
  candidates.push_back("/usr/local/cuda/include");
  for (const std::filesystem::path &c : candidates)
    if (has_bf16_header(c))
      return c.string();
  return {};
}

std::vector<std::string> nvrtc_options(const CompileOptions &options) {
  std::vector<std::string> opts = {
      "--gpu-architecture=" + options.arch,
      "-std=c++17",
      // Unqualified functions are device functions: generated code need not
      // mark every helper __device__.
      "-default-device",
      // ptxas' per-kernel resource report (registers, spills, smem) into the
      // log; "-Xptxas=-v" works too with NVRTC 13.0.
      "--ptxas-options=-v",
  };
  if (std::string inc = cuda_include_directory(); !inc.empty())
    opts.push_back("-I" + inc);
  if (options.fast_math)
    opts.push_back("--use_fast_math");
  if (options.line_info)
    opts.push_back("-lineinfo");
  opts.insert(opts.end(), options.extra_options.begin(), options.extra_options.end());
  return opts;
}

CompileResult compile_cuda(const std::string &source, const std::string &program_name, const CompileOptions &options) {
  std::vector<std::string> opts = nvrtc_options(options);
  CompileResult result;
  result.arch = options.arch;

  // Everything the cubin depends on goes into the key.
  std::string version = nvrtc_version();
  std::vector<std::string_view> fields = {"moeforge-nvrtc-entry-1", version, program_name, source};
  for (const std::string &o : opts)
    fields.push_back(o);
  for (const NamedHeader &h : options.headers) {
    fields.push_back(h.name);
    fields.push_back(h.content);
  }
  CacheKey key = CacheKey::of(fields);
  result.cache_key = key.hex();

  std::filesystem::path cache_dir =
      options.cache_directory.empty() ? CompileCache::default_directory() : options.cache_directory;
  bool caching = options.use_cache && !cache_dir.empty();
  CompileCache cache(cache_dir);
  if (caching) {
    if (std::optional<CacheEntry> hit = cache.load(key)) {
      result.cubin = std::move(hit->cubin);
      result.log = std::move(hit->log);
      result.resources = parse_ptxas_report(result.log);
      result.from_cache = true;
      return result;
    }
  }

  Program program(source, program_name, options.headers);
  std::vector<const char *> argv;
  for (const std::string &o : opts)
    argv.push_back(o.c_str());
  nvrtcResult compiled = nvrtcCompileProgram(program.get(), static_cast<int>(argv.size()), argv.data());
  result.log = program_log(program.get());
  if (compiled != NVRTC_SUCCESS)
    throw CompileError(compile_error_message(source, program_name, options, compiled, result.log), result.log);

  size_t size = 0;
  check_nvrtc(nvrtcGetCUBINSize(program.get(), &size), "nvrtcGetCUBINSize");
  // A virtual architecture (compute_90) yields PTX and no cubin.
  user_check(size > 0) << "NVRTC produced no cubin for '" << program_name
                       << "' with --gpu-architecture=" << options.arch
                       << ": use a real architecture such as sm_90a, not compute_90";
  result.cubin.resize(size);
  check_nvrtc(nvrtcGetCUBIN(program.get(), result.cubin.data()), "nvrtcGetCUBIN");
  result.resources = parse_ptxas_report(result.log);
  if (caching)
    cache.store(key, CacheEntry{result.cubin, result.log});
  return result;
}

} // namespace moeforge::cuda
