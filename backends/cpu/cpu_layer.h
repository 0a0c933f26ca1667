// A layer compiled for the CPU: algebra + schedule lowered to the same kernel
// program the CUDA backend reads, emitted as LLVM IR and JIT-compiled
// (codegen_llvm.h, jit.h), then bound to host buffers for a token count
// (CpuLayer). Numerics follow the GPU: bf16 storage rounded to nearest even,
// fp32 arithmetic; buffers use the device layouts (padded rows included), so
// every schedule's layout, permutation and masking is exercised.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "backends/cpu/jit.h"
#include "dsl/pipeline.h"
#include "lowering/kernel_program.h"
#include "runtime/layer_checks.h"
#include "runtime/layer_memory.h"
#include "runtime/memory_plan.h"
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

// A compiled layer bound to host memory for `tokens` tokens.
//
// Memory, as cuda::CudaLayer's (runtime/layer_memory.h): owned, a buffer of
// its own for every tensor; or LayerMemory::caller, where the caller gives
// the intermediates their memory each call (place(): the saved region,
// which also holds every route's tables, and a workspace, both planned by
// plan_step_memory), binds the tensors it wants read or written in place
// (bind()), and any token count runs (set_tokens) with no compiling. The
// CPU backend runs the same plan the GPU runs, so a plan that let two live
// tensors share bytes shows here as a wrong result.
class CpuLayer {
public:
  // keep_across: tensors written before this step and read at or after it
  // are what a training forward keeps for its backward (the saved region
  // with LayerMemory::caller); 0 for none.
  CpuLayer(const CompiledCpuLayer &layer, int64_t tokens, size_t keep_across = 0,
           LayerMemory memory = LayerMemory::owned);

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

  // A tensor as stored here (runtime/layer_checks.h).
  TensorInfo info(const std::string &name) const { return tensor_info(layer_.program, shapes_, name); }
  // Points tensor `name` (an Input, Param, output or gradient: a tensor the
  // caller reads or writes, not an intermediate placed by the plan) at host
  // memory the caller owns and keeps alive, `bytes` = info(name).bytes, so
  // its values are read or written there with no copy. An Input or Param
  // counts as given from then on.
  void bind(const std::string &name, void *ptr, size_t bytes);

  LayerMemory memory() const { return memory_; }
  // LayerMemory::caller: what a step at `tokens` tokens needs.
  StepMemory step_memory(int64_t tokens) const;
  // LayerMemory::caller: step_memory().saved over any token count, one
  // SizeTerms a part (size_terms.h), or none where a size is not of that
  // form.
  std::optional<std::vector<SizeTerms>> saved_terms() const;
  // LayerMemory::caller: every intermediate and route table at the caller's
  // memory for the current token count: `saved` (the host addresses of
  // step_memory().saved's parts, in its order) and `workspace` (what the
  // steps about to run need, or null where they need none), all 64-byte
  // aligned.
  void place(const SavedParts &saved, uint8_t *workspace);
  // LayerMemory::caller: the saved parts place() was last given (none before).
  const SavedParts &saved_at() const { return saved_at_; }
  // LayerMemory::caller: runs the layer for `tokens` tokens from now on, with
  // no compiling; place() again, and bind or upload again every tensor whose
  // size changed (the others keep their values).
  void set_tokens(int64_t tokens);

  const CompiledCpuLayer &compiled() const { return layer_; }
  int64_t tokens() const { return tokens_; }

private:
  // A tensor's bytes: its own, or the caller's (bound, or placed by the plan).
  struct Buffer {
    std::vector<uint8_t> own;
    uint8_t *at = nullptr; // null: an intermediate not placed yet
    size_t bytes = 0;
    void hold(size_t n) {
      own.assign(n, 0);
      at = own.data();
      bytes = n;
    }
  };
  // A route's shape and its tables, one block (routing_table_offset): the
  // layer's own, or in the saved region on caller memory, so each forward
  // in flight keeps its own routing beside its activations.
  struct RouteState {
    RoutingShape shape;
    std::vector<uint8_t> own;
    uint8_t *block = nullptr;
    bool routed = false;
    int32_t *array(RoutingArray a) const { return reinterpret_cast<int32_t *>(block + routing_table_offset(a, shape)); }
    std::vector<int32_t> copy(RoutingArray a) const {
      const int32_t *p = array(a);
      return std::vector<int32_t>(p, p + routing_array_elements(a, shape));
    }
  };
  void route(const RoutingStep &step);
  // An attention step (lowering/fuse_attention.h) on the host, its softmax
  // online over the key and value rows as the GPU kernel takes it.
  void attend(const AttentionStep &step);
  void *arg(const CpuArg &a);
  // Tensor `name`'s memory now, or the user error saying what to place.
  uint8_t *placed(const std::string &name);
  // One step's function with `args`: once, or for a parallel kernel once per
  // thread, each with its own thread index.
  void call(const CpuKernel &kernel, StepFunction f, std::vector<void *> &args) const;
  const RouteState &routed(const std::string &route, const char *call) const;
  void plan_caller_memory();
  // Input `name`'s new bytes, into its own or its bound memory.
  void store_input(const std::string &name, const std::vector<uint8_t> &bytes);

  const CompiledCpuLayer &layer_;
  // kernel_of_step_[s]: the index into layer_.kernels of step s (routing
  // steps run on the host and have none).
  std::vector<size_t> kernel_of_step_;
  int64_t tokens_;
  ProgramShapes shapes_;
  int64_t threads_; // a parallel step's calls (MOEFORGE_CPU_THREADS, else the cores)
  size_t keep_across_;
  LayerMemory memory_;
  std::map<std::string, Buffer> tensors_;
  std::map<const RoutingNode *, RouteState> routes_;
  // LayerMemory::caller: the current count's plan, each saved tensor's
  // part and offset in it, each route's tables' offset in the last part,
  // each part's bytes, and where place() put them last.
  std::unique_ptr<StepMemoryPlan> step_plan_;
  std::map<std::string, std::pair<size_t, size_t>> saved_at_part_; // (part, offset)
  std::map<const RoutingNode *, size_t> table_offset_;
  std::vector<size_t> saved_bytes_;
  SavedParts saved_at_;
  std::set<std::string> uploaded_; // the Inputs and Params given so far
  // The results a run computed from the inputs as they are now: an upload
  // takes back those made from the input it changed, poison() all.
  std::set<std::string> computed_;
  void forget_results_of(const std::string &input);
};

} // namespace moeforge::cpu
