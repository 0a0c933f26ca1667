// The calling convention between generated CPU code and the runtime. Every
// step becomes one function `void f(void **args)`; args[i] points at what
// the i-th CpuArg names. One pointer array keeps the generated signatures
// uniform, so the runtime calls every step the same way.
#pragma once

#include <string>
#include <vector>

#include "dsl/ir.h"
#include "runtime/routing_format.h"

namespace moeforge::cpu {

struct CpuArg {
  enum class Kind {
    tensor, // the tensor's storage (float or bf16 bits as uint16)
    extent, // an int64_t: a dynamic Dim's extent (by the Dim's name)
    route,  // an int32_t array of the route's tables (`array`; num_tiles and
            // padded_rows are one int32_t each)
    thread, // an int64_t: "index" (this call's) or "count" (the calls of a step)
  };
  Kind kind;
  std::string name; // a tensor's or Dim's; for a route, routing_array_name(array)
  const RoutingNode *route = nullptr;
  RoutingArray array = RoutingArray::expert; // Kind::route
  bool operator==(const CpuArg &) const = default;
};

using StepFunction = void (*)(void **args);

struct CpuKernel {
  std::string symbol; // the LLVM function's name
  std::string step;   // the kernel program step it runs
  std::vector<CpuArg> args;
  // The function takes thread "index" and "count" arguments and does the
  // index-th of `count` equal parts of its outermost loop, whose iterations
  // write disjoint outputs: the runtime calls it once per thread.
  bool parallel = false;
};

} // namespace moeforge::cpu
