// A layer compiled for the CPU: algebra + schedule lowered to the same kernel
// program the CUDA backend reads, emitted as LLVM IR and JIT-compiled
// (codegen_llvm.h, jit.h), then bound to host buffers for a token count
// (CpuLayer). Numerics follow the GPU: bf16 storage rounded to nearest even,
// fp32 arithmetic; buffers use the device layouts (padded rows included), so
// every schedule's layout, permutation and masking is exercised.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "backends/cpu/jit.h"
#include "dsl/pipeline.h"
#include "lowering/kernel_program.h"
#include "runtime/program_shapes.h"
#include "runtime/routing_host.h"
#include "runtime/tensor.h"
#include "schedules/schedule.h"

namespace moeforge::cpu {

struct CompiledCpuLayer {
  KernelProgram program;
  // This program's kernels and their arguments. The JIT's functions may come
  // from the cache, compiled for an identical program whose arguments name
  // other (possibly freed) RoutingNodes: bind arguments from here, never from
  // jit->kernels.
  std::vector<CpuKernel> kernels;
  std::shared_ptr<const JitProgram> jit;
};

// Lowers, generates and JIT-compiles (cached within the process).
CompiledCpuLayer compile_cpu_layer(const Pipeline &pipeline, const Schedule &schedule);

// Generates and JIT-compiles an already lowered program (a training program,
// lowering/training.h); `what` names it in LLVM errors.
CompiledCpuLayer compile_cpu_program(KernelProgram program, const std::string &what);

// The layer's generated LLVM IR as text, before or after the O2 pipeline
// (for `moeforge emit --llvm`).
std::string cpu_llvm_ir(const Pipeline &pipeline, const Schedule &schedule, bool optimised = false);

// Threads a parallel step runs on: MOEFORGE_CPU_THREADS (1 to 1024; a
// UserError otherwise), else every core.
int64_t cpu_threads();

// A compiled layer bound to host memory for `tokens` tokens. The pipeline
// and the CompiledCpuLayer must outlive it.
class CpuLayer {
public:
  CpuLayer(const CompiledCpuLayer &layer, int64_t tokens);

  // Copies every Input and Param in (rounded to its dtype). Shapes must match
  // the declared Dims with the token Dim = tokens.
  void upload(const TensorMap &inputs);
  // Copies one Input or Param in (UserError naming it when it is not one).
  void upload(const std::string &name, const HostTensor &value);
  // One Input or Param already in its storage type (encode_values): its
  // elements' bytes, a UserError for another size.
  void upload_bytes(const std::string &name, const std::vector<uint8_t> &bytes);
  // Fills every intermediate and output with NaN, so an element no step
  // writes shows up in any comparison.
  void poison();
  // The whole forward: routing on the host, then every step in order.
  void run() { run(0, layer_.program.steps.size()); }
  // Steps [begin, end) of the program in order, routing steps included (a
  // training program's forward or backward). Later steps read what earlier
  // runs left in the buffers and the routing tables. A user error until
  // every Input and Param these steps read has been uploaded (they would
  // compute on zeros); `entry` names the caller's entry point in that error
  // (a training layer's forward() or backward(), not run()).
  void run(size_t begin, size_t end, const char *entry = "run()");
  // Steps [begin, end) as run() runs them, each timed: its name and
  // milliseconds, in program order (for benchmarks and `train --profile`);
  // `entry` as for run().
  std::vector<std::pair<std::string, double>> profile(size_t begin, size_t end, const char *entry = "profile()");
  // A Func's values as the reference lays them out (routed rows in pair
  // order, whatever the layout here). A user error for a name the layer
  // does not hold, and for a result no run computed since the inputs it is
  // made from last changed (never the zeros or the last step's values).
  HostTensor download(const std::string &func) const;
  // The experts chosen, pair order (r = t * k + slot). After run().
  std::vector<int32_t> routed_experts(const std::string &route) const;
  // The (token, expert) pairs the route dropped at its expert capacity in
  // the last run (0 when dropless). A user error for an unknown route.
  int64_t dropped_pairs(const std::string &route) const;
  // kept[r] = 0 for each pair the route dropped at capacity (pair order).
  std::vector<uint8_t> kept_pairs(const std::string &route) const;

  const CompiledCpuLayer &compiled() const { return layer_; }
  int64_t tokens() const { return tokens_; }

private:
  struct RouteState {
    RoutingShape shape;
    RoutingTables tables;
    int32_t padded_rows = 0;
  };
  void route(const RoutingStep &step);
  void *arg(const CpuArg &a);
  // One step's function with `args`: once, or for a parallel kernel once per
  // thread, each with its own thread index.
  void call(const CpuKernel &kernel, StepFunction f, std::vector<void *> &args) const;

  const CompiledCpuLayer &layer_;
  // kernel_of_step_[s]: the index into layer_.kernels of step s (routing
  // steps run on the host and have none).
  std::vector<size_t> kernel_of_step_;
  int64_t tokens_;
  ProgramShapes shapes_;
  int64_t threads_; // a parallel step's calls (MOEFORGE_CPU_THREADS, else the cores)
  std::map<std::string, std::vector<uint8_t>> tensors_;
  std::map<const RoutingNode *, RouteState> routes_;
  std::set<std::string> uploaded_; // the Inputs and Params given so far
  // The results a run computed from the inputs as they are now: an upload
  // takes back those made from the input it changed, poison() all.
  std::set<std::string> computed_;
  void forget_results_of(const std::string &input);
};

} // namespace moeforge::cpu
