#include "backends/cuda/codegen/ptxas_report.h"

#include <cxxabi.h>

#include <cstdlib>
#include <memory>
#include <regex>
#include <sstream>

namespace moeforge::cuda {

namespace {

std::string demangle(const std::string &name) {
  int status = 0;
  std::unique_ptr<char, void (*)(void *)> out(abi::__cxa_demangle(name.c_str(), nullptr, nullptr, &status), std::free);
  return status == 0 && out ? std::string(out.get()) : name;
}

// The lines of a ptxas -v report (CUDA 12 and 13 print them this way):
//   ptxas info    : Compiling entry function '_Z2k2Pfi' for 'sm_90a'
//   ptxas info    : Function properties for _Z2k2Pfi
//   ptxas         .     400 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
//   ptxas info    : Used 32 registers, used 1 barriers, 256 bytes smem, 360 bytes cmem[0]
const std::regex kEntry(R"(Compiling entry function '([^']+)')");
const std::regex kProperties(R"(Function properties for (\S+))");
const std::regex kFrame(R"((\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads)");
const std::regex kUsed(R"(Used (\d+) registers)");
const std::regex kBarriers(R"(used (\d+) barriers)");
const std::regex kShared(R"((\d+) bytes smem)");
const std::regex kConstant(R"((\d+) bytes cmem\[\d+\])");
//   ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to
//                   ... in the function 'gemm_h'   (one line, before the entries)
const std::regex kSerialized(R"(wgmma\.mma_async instructions are serialized.* in the function '([^']+)')");

} // namespace

std::vector<ResourceReport> parse_ptxas_report(const std::string &log) {
  std::vector<ResourceReport> reports;
  // "Function properties" also appear for non-inlined device functions;
  // only the entry function's own properties belong in its report.
  std::string properties_of;
  std::istringstream lines(log);
  std::string line;
  std::smatch m;
  std::vector<std::string> serialized;
  while (std::getline(lines, line)) {
    if (std::regex_search(line, m, kSerialized)) {
      serialized.push_back(m[1]);
      continue;
    }
    if (std::regex_search(line, m, kEntry)) {
      ResourceReport r;
      r.kernel = m[1];
      r.demangled = demangle(r.kernel);
      reports.push_back(std::move(r));
      properties_of.clear();
      continue;
    }
    if (std::regex_search(line, m, kProperties)) {
      properties_of = m[1];
      continue;
    }
    if (reports.empty())
      continue;
    ResourceReport &r = reports.back();
    if (std::regex_search(line, m, kFrame)) {
      if (properties_of == r.kernel) {
        r.stack_frame_bytes = std::stoi(m[1]);
        r.spill_store_bytes = std::stoi(m[2]);
        r.spill_load_bytes = std::stoi(m[3]);
      }
      continue;
    }
    if (std::regex_search(line, m, kUsed)) {
      r.registers = std::stoi(m[1]);
      if (std::regex_search(line, m, kBarriers))
        r.barriers = std::stoi(m[1]);
      if (std::regex_search(line, m, kShared))
        r.shared_bytes = std::stoi(m[1]);
      for (std::sregex_iterator it(line.begin(), line.end(), kConstant), end; it != end; ++it)
        r.constant_bytes += std::stoi((*it)[1]);
    }
  }
  for (ResourceReport &r : reports)
    for (const std::string &name : serialized)
      r.wgmma_serialized |= name == r.kernel;
  return reports;
}

const ResourceReport *find_report(const std::vector<ResourceReport> &reports, const std::string &kernel) {
  for (const ResourceReport &r : reports)
    if (r.kernel == kernel || r.demangled == kernel)
      return &r;
  return nullptr;
}

std::string to_string(const ResourceReport &r) {
  std::ostringstream s;
  s << r.demangled << ": " << r.registers << " registers, " << r.spill_store_bytes << " B spill stores, "
    << r.spill_load_bytes << " B spill loads, " << r.stack_frame_bytes << " B stack, " << r.shared_bytes << " B smem, "
    << r.constant_bytes << " B cmem";
  return s.str();
}

} // namespace moeforge::cuda
