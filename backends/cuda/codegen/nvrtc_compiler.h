// CUDA C++ source to a cubin, with NVRTC, in process.
//
// compile_cuda() runs NVRTC for one architecture (sm_90a unless told
// otherwise) with ptxas' verbose report turned on, parses that report into
// a ResourceReport per kernel, and keeps the result in the on-disk
// CompileCache. It needs no GPU: CI compiles every kernel it ships.
//
// Generated and hand-written kernels should be extern "C" so that the names
// Module::kernel() and find_report() take are the source names.
#pragma once

#include "backends/cuda/codegen/ptxas_report.h"
#include "dsl/error.h"

#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

namespace moeforge::cuda {

// A header the source #includes by `name`, given from memory (our device
// tile library, generated parameter headers).
struct NamedHeader {
  std::string name;
  std::string content;
};

struct CompileOptions {
  // NVRTC's --gpu-architecture: "sm_90a" for Hopper with wgmma/TMA, or
  // Device::arch() for what the present GPU runs.
  std::string arch = "sm_90a";
  std::vector<NamedHeader> headers;
  // Passed to NVRTC verbatim after moeforge's own (e.g. "-DBLOCK=128").
  std::vector<std::string> extra_options;
  bool fast_math = false; // --use_fast_math
  bool line_info = false; // -lineinfo, for profilers and compute-sanitizer
  bool use_cache = true;
  // Where the cache lives; empty means CompileCache::default_directory().
  std::filesystem::path cache_directory;
};

struct CompileResult {
  std::vector<char> cubin;
  std::string log; // NVRTC's log, including the ptxas report
  std::vector<ResourceReport> resources;
  std::string arch;
  std::string cache_key; // hex; names the cache entry
  bool from_cache = false;
  // The report of `kernel`, or null if ptxas did not list it.
  const ResourceReport *resources_of(const std::string &kernel) const { return find_report(resources, kernel); }
};

// The source did not compile. what() names the program, quotes the first
// error with its source line, and ends with NVRTC's full log.
class CompileError : public UserError {
public:
  CompileError(const std::string &message, std::string log) : UserError(message), log_(std::move(log)) {}
  const std::string &log() const { return log_; }

private:
  std::string log_;
};

// An NVRTC API call failed for a reason other than the source (out of
// memory, a bad option): names the call and NVRTC's reason.
class NvrtcError : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

// Compiles `source`. `program_name` (e.g. "routing_kernels.cu") is the file
// name NVRTC uses in its messages. Throws CompileError or NvrtcError.
CompileResult compile_cuda(const std::string &source, const std::string &program_name,
                           const CompileOptions &options = {});

// The NVRTC options compile_cuda passes for `options`, in order.
std::vector<std::string> nvrtc_options(const CompileOptions &options);

// "13.0": the NVRTC library in use (part of every cache key).
std::string nvrtc_version();

// Where the toolkit's device headers (cuda_bf16.h, ...) are, since NVRTC does
// not carry them: $MOEFORGE_CUDA_INCLUDE, else the include folder next to the
// loaded NVRTC library, else the toolkit found at build time, else
// /usr/local/cuda/include. Empty if none has cuda_bf16.h.
std::string cuda_include_directory();

} // namespace moeforge::cuda
