// What ptxas says each kernel costs: registers, spills, stack, shared and
// constant memory. NVRTC prints this when compiling with
// --ptxas-options=-v; parsing it lets tests and the autotuner reject a
// schedule that spills before it ever runs.
#pragma once

#include <string>
#include <vector>

namespace moeforge::cuda {

struct ResourceReport {
  std::string kernel;    // the name ptxas prints: mangled for C++ kernels
  std::string demangled; // readable form (same as `kernel` for extern "C")
  int registers = 0;     // per thread
  int barriers = 0;      // named barriers used
  int spill_store_bytes = 0;
  int spill_load_bytes = 0;
  int stack_frame_bytes = 0; // per thread, local memory for arrays and spills
  int shared_bytes = 0;      // static __shared__ per block
  int constant_bytes = 0;    // summed over the constant banks listed for the kernel
  // ptxas serialised the kernel's wgmmas (warning C7520: a wgmma under a
  // branch, say), which costs most of their throughput.
  bool wgmma_serialized = false;
};

// One report per entry function ("Compiling entry function 'k' for 'sm_90a'"),
// in the order ptxas printed them. Lines it does not know are skipped, so a
// log without the verbose report gives an empty vector.
std::vector<ResourceReport> parse_ptxas_report(const std::string &log);

// The report for `kernel` (mangled or demangled name), or null.
const ResourceReport *find_report(const std::vector<ResourceReport> &reports, const std::string &kernel);

// One line: "topk_kernel: 40 registers, 0 B spill stores, 0 B spill loads, 0 B stack, 1024 B smem, 0 B cmem".
std::string to_string(const ResourceReport &r);

} // namespace moeforge::cuda
