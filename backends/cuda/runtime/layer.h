// A layer compiled for the GPU: algebra + schedule lowered to a kernel
// program, emitted as CUDA C++ and compiled by NVRTC (compile_layer needs no
// GPU, so CI checks it), then bound to device buffers for a token count and
// run without any device-to-host synchronisation (CudaLayer).
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "backends/cuda/codegen/codegen_cuda.h"
#include "backends/cuda/codegen/nvrtc_compiler.h"
#include "backends/cuda/runtime/device.h"
#include "backends/cuda/runtime/module.h"
#include "backends/cuda/runtime/routing_kernels.h"
#include "backends/cuda/runtime/routing_score_check.h"
#include "backends/cuda/runtime/stream.h"
#include "dsl/pipeline.h"
#include "lowering/kernel_program.h"
#include "runtime/layer_checks.h"
#include "runtime/layer_memory.h"
#include "runtime/memory_plan.h"
#include "runtime/program_shapes.h"
#include "runtime/tensor.h"
#include "schedules/schedule.h"

namespace moeforge::cuda {

// Spelled cuda::LayerMemory too, as before both backends had it.
using moeforge::LayerMemory;

struct GridInputs; // launch_grid.h

struct CompiledLayer {
  KernelProgram program;
  CudaModuleSource source;
  // The cubins: one per kernel, compiled side by side and cached each on its
  // own (a schedule that changes one Func's tiling recompiles that kernel
  // alone), or one for the whole module when it carries timeline stamps,
  // which all its kernels write into one global.
  std::vector<CompileResult> units;
  std::vector<size_t> unit_of; // per kernel (source.kernels' order): its unit
  // ptxas' report of `kernel`, or null.
  const ResourceReport *resources_of(const std::string &kernel) const;
  const std::string &arch() const { return units.front().arch; }
};

// Lowers, generates and compiles (for `arch`, sm_90a by default). Works
// without a GPU.
CompiledLayer compile_layer(const Pipeline &pipeline, const Schedule &schedule, const std::string &arch = "sm_90a");
// Generates and compiles an already lowered program (a training program, say).
CompiledLayer compile_program(KernelProgram program, const std::string &arch = "sm_90a");

// A compiled layer bound to device memory for `tokens` tokens.
class CudaLayer {
public:
  // keep_across: tensors written before this step and read at or after it
  // keep their memory to the end (a training program's forward steps: what
  // the backward reads): under reuse_memory in the owned arena, or in the
  // saved region with LayerMemory::caller; 0 for none.
  CudaLayer(const Device &device, const CompiledLayer &layer, int64_t tokens, size_t keep_across = 0,
            LayerMemory memory = LayerMemory::owned);

  // LayerMemory::caller: the memory a step at `tokens` tokens needs.
  using StepMemory = moeforge::StepMemory;
  StepMemory step_memory(int64_t tokens) const;
  // LayerMemory::caller: step_memory().saved over any token count, one
  // SizeTerms a part (size_terms.h), or none where a size is not of that
  // form.
  std::optional<std::vector<SizeTerms>> saved_terms() const;
  // LayerMemory::caller: points every intermediate at the caller's memory
  // for the current token count: `saved` (each of step_memory().saved's
  // parts, in its order) and `workspace` (the part about to run needs, or 0
  // where it needs none), all 256-byte aligned. Cheap when the addresses
  // are the ones placed last. Work already queued keeps the addresses it
  // was queued with.
  void place(const SavedParts &saved, CUdeviceptr workspace);
  LayerMemory memory() const { return memory_; }

  // Uploads every Input and Param (rounded to its dtype). Shapes must match
  // the declared Dims with the token Dim = tokens.
  void upload(const TensorMap &inputs);
  // Uploads one Input or Param (shape checked, rounded to its dtype).
  void upload(const std::string &name, const HostTensor &value);
  // Uploads Input or Param `name` already in its storage type and layout
  // (info(name).bytes bytes, what encode_values makes of its values): for a
  // caller that makes the bytes itself (the CLI's real-size runs, whose
  // weights as doubles would be four times larger).
  void upload_bytes(const std::string &name, const std::vector<uint8_t> &bytes);
  // Fills Input/Param `name` with `pattern`'s values repeated to its size:
  // for benchmarks, whose large weights need realistic values but not
  // gigabytes of host-side random numbers.
  void upload_repeated(const std::string &name, const HostTensor &pattern);
  // Fills every intermediate and output with a NaN pattern, so an element a
  // kernel fails to write shows up in any comparison.
  void poison();
  // Enqueues the whole forward on `stream`: routing and every kernel. No host
  // synchronisation, so it can be captured in a CUDA graph.
  void enqueue(const Stream &stream);
  // Enqueues the program's steps [begin, end) only (a training program's
  // forward or backward). A user error until every Input and Param these
  // steps read has been uploaded (they would compute on whatever memory held);
  // `entry` names the caller's entry point in that error (the backend
  // interface's run(), a training layer's forward()).
  void enqueue(const Stream &stream, size_t begin, size_t end, const char *entry = "enqueue()");
  // Runs the forward once with an event around every step and returns each
  // step's name and milliseconds, in program order (for benchmarks' notes).
  std::vector<std::pair<std::string, double>> profile(const Stream &stream);
  std::vector<std::pair<std::string, double>> profile(const Stream &stream, size_t begin, size_t end);
  // With a timeline build (MOEFORGE_TIMELINE=1 when the layer was compiled):
  // runs the forward once, step by step, and returns for each GEMM a line
  // saying what its blocks spent their time on (timeline.h). Empty otherwise.
  std::vector<std::string> timeline(const Stream &stream);
  // Downloads a Func's values as the reference lays them out (routed rows in
  // pair order, whatever the device layout). Synchronises. Under
  // reuse_memory, only tensors whose values outlive the run (outputs,
  // gradients, what the forward keeps): UserError for the others, and for a
  // name the layer does not hold.
  HostTensor download(const std::string &func) const;
  // A tensor as the user sees it: its storage type and shape (routed rows:
  // T * k), and whether its device bytes are exactly that, row-major and
  // unpadded, so another framework's tensor can be copied in or out as is.
  using TensorInfo = moeforge::TensorInfo;
  // UserError naming the layer's tensors for an unknown name.
  TensorInfo info(const std::string &name) const;
  // Device-to-device, enqueued on `stream` without host synchronisation (and
  // so capturable in a CUDA graph): another framework's tensors in and out,
  // already in the layer's storage type and layout (info()). copy_in takes
  // an Input or Param, copy_out any contiguous tensor whose value outlives
  // the run (outputs, gradients, what a training forward keeps). `bytes`
  // must be info(name).bytes: a UserError otherwise, naming both.
  void copy_in(const std::string &name, CUdeviceptr src, size_t bytes, const Stream &stream);
  void copy_out(const std::string &name, CUdeviceptr dst, size_t bytes, const Stream &stream) const;
  // Points tensor `name` at memory the caller owns (another framework's
  // tensor, `bytes` = info(name).bytes, contiguous) instead of the layer's
  // own, so its values are read or written there with no copy: Inputs and
  // Params, and tensors whose values outlive the run (outputs, gradients).
  // The layer's own memory for it is freed at the first bind. Kernels
  // launched afterwards use the new address; a CUDA graph captured before
  // keeps the old one, so bind before capturing. The caller keeps the memory
  // alive while work that reads or writes it may run.
  void bind(const std::string &name, CUdeviceptr ptr, size_t bytes);
  // Counts the binds that moved a tensor (binding the address it already
  // has changes nothing): a graph captured at one count holds the addresses
  // (in TMA descriptors, by value) that are still right at that count.
  uint64_t bind_epoch() const { return bind_epoch_; }
  // A hash of what the launches of steps [begin, end) hold by value: the
  // token count and the address of every tensor and routing table they
  // touch. Equal signatures: a CUDA graph captured of those steps at one
  // replays them right at the other (the memory a framework's allocator
  // hands a step recurs step after step, though other steps' memory moves).
  uint64_t signature(size_t begin, size_t end) const;
  // The experts the device chose, pair order (r = t * k + slot).
  std::vector<int32_t> routed_experts(const std::string &route) const;
  // The same into device memory (int32 [T * k], `bytes` its size) on
  // `stream`, with no host synchronisation: a copy that outlives memory the
  // caller gave (the routing tables live with the saved activations).
  void copy_routed_experts(const std::string &route, CUdeviceptr dst, size_t bytes, const Stream &stream) const;
  // The (token, expert) pairs the route dropped at its expert capacity in
  // the last run, 0 when dropless (synchronous: copies the counts back).
  int64_t dropped_pairs(const std::string &route) const;
  // kept[r] = 0 for each pair the route dropped at capacity (pair order;
  // synchronous).
  std::vector<uint8_t> kept_pairs(const std::string &route) const;

  // A routing score that was NaN or infinite in work queued before
  // (routing_score_check.h): a UserError naming the route, token, expert
  // and `call`, after waiting for `stream`; otherwise returns at once,
  // waiting for nothing. Every entry point that queues work calls it first;
  // a synchronous caller calls it again once its work is done.
  void check_routing_scores(const Stream &stream, const std::string &call);

  // Runs the layer for `tokens` tokens from now on, with no allocation and
  // no compiling. Owned memory: in the memory it was made with (an
  // expert-parallel rank's received rows), so at most the count the layer
  // was made for, and a UserError after a bind() moved a tensor (that
  // memory was sized for the old count); Inputs over the tokens must be
  // written again. Caller memory: any count of at least 1; place() again,
  // and bind again every tensor whose size changed.
  void set_tokens(int64_t tokens);
  int64_t capacity_tokens() const { return capacity_tokens_; }
  // The device address of tensor `name`, for a runtime that moves rows in
  // and out of the layer's tensors with kernels of its own (valid until the
  // next set_tokens or bind). An Input or Param counts as given from then on:
  // the caller writes it on the device.
  CUdeviceptr address(const std::string &name);
  // Route `route`'s device tables, as the last run left them.
  const RoutingPlan &routing_plan(const std::string &route) const;

  // Tile windows (GemmStep::windowed): each a list of tile ids of route
  // `route` (its pair-aligned order, runtime/routing_host.h), which the
  // windowed GEMMs run over one at a time: an expert-parallel rank's
  // forward over the experts whose rows have arrived. Copies the lists to
  // the device (synchronously: it is called where the host has just waited
  // for the route's counts anyway).
  void set_tile_windows(const std::string &route, const std::vector<std::vector<int32_t>> &windows);
  // Enqueues steps [begin, end) with every windowed GEMM over window
  // `window`'s tiles (its grid sized by them); the other steps as enqueue().
  // A UserError unless set_tile_windows() listed that window since the last
  // set_tokens() that changed the count.
  void enqueue_window(const Stream &stream, size_t begin, size_t end, size_t window);

  const CompiledLayer &compiled() const { return layer_; }
  int64_t tokens() const { return tokens_; }
  // LayerMemory::caller: the saved parts place() was last given (none before).
  const SavedParts &saved_at() const { return saved_at_; }
  // Bytes of device memory held for intermediates and outputs (not inputs):
  // under reuse_memory, the shared arena's.
  size_t activation_bytes() const;

private:
  struct Launch {
    Kernel kernel;
    const GeneratedKernel *gen;
    std::vector<void *> args;
    Dim3 grid, block;
    CUdeviceptr zero = 0; // zeroed before each launch (GeneratedKernel::zero_first)
    size_t zero_words = 0;
  };
  // The route of that name (a UserError naming it otherwise).
  const RoutingNode *route_named(const std::string &route) const;
  // window: the tile window the step's windowed GEMM runs over, or -1.
  void run_step(size_t step, const Stream &stream, int64_t window = -1);
  // Every kernel's launch: its arguments, grid and what it zeroes first.
  void build_launches();
  // The extents launch_grid reads, at the current token count.
  GridInputs grid_inputs() const;
  // What holds an address by value (TMA descriptors, the zeroed outputs),
  // encoded again from the tensors' current memory.
  void refresh_addresses();
  // Where an intermediate that lives in an output's memory is now
  // (StepMemoryPlan::in_output), from the output's address.
  CUdeviceptr in_output_address(const InOutput &where) const;
  // Before steps [begin, end) run: every Input they read given, and with
  // caller memory every output they write bound, the memory placed, and
  // the launches built for the current count. `call` names the caller.
  void prepare(size_t begin, size_t end, const std::string &call);
  // LayerMemory::caller: the plan for the current count (step_plan_,
  // table_offset_).
  void plan_caller_memory();
  // Refused where a tensor has no value to read: in the caller's workspace
  // (gone once the steps that use it ran), or not yet given any memory.
  void check_readable(const std::string &name, const char *what) const;
  // An Input or Param written from the host: with caller memory, only once
  // bound.
  void check_writable_input(const std::string &name, const char *what) const;

  const CompiledLayer &layer_;
  int64_t tokens_, capacity_tokens_;
  ProgramShapes shapes_;
  std::vector<Module> modules_; // one per compiled unit
  DeviceRouting routing_;
  std::unique_ptr<RoutingScoreCheck> score_check_;
  std::vector<std::string> route_names_; // by the index the score check's key holds: plans_'s order
  std::unique_ptr<MemoryPlan> plan_;     // reuse_memory: where each tensor sits in arena_
  DeviceBuffer arena_;
  std::map<std::string, DeviceBuffer> tensors_; // views into arena_ for planned tensors
  // After set_tokens: each tensor's memory for capacity_tokens_, of which
  // tensors_ holds views the size of the current count.
  std::map<std::string, DeviceBuffer> storage_;
  std::set<std::string> uploaded_; // the Inputs and Params given so far
  uint64_t bind_epoch_ = 0;
  std::map<const RoutingNode *, std::unique_ptr<RoutingPlan>> plans_;
  std::map<const RoutingNode *, CUdeviceptr> padded_rows_; // &offsets[E]: total padded rows
  // A route's tile windows: every window's [count, ids...] in `all` (rows of
  // `stride` int32), the one in use copied to `active`, the windowed
  // kernels' argument.
  struct TileWindows {
    DeviceBuffer active, all;
    size_t stride = 0;
    std::vector<int64_t> tiles; // per window
  };
  std::map<const RoutingNode *, TileWindows> windows_;
  std::deque<CUtensorMap> tensor_maps_; // TMA arguments (a deque: their addresses stay put)
  struct TmaArg {
    std::string tensor;
    long long rows, cols, matrix_stride; // matrix_stride: elements apart, 0 packed
    CUtensorMap *map;
  };
  std::vector<TmaArg> tma_args_; // what each tensor map describes, to encode it again after bind()
  // Persistent GEMMs' tile counters, one per launch in launch order, kept
  // when the launches are built again (freeing device memory would wait
  // for the whole device).
  std::deque<DeviceBuffer> counters_;
  std::vector<Launch> launches_;
  std::vector<int> launch_of_; // step -> its launch (-1 for routing)
  int sm_count_;               // persistent GEMMs launch at most one block per SM

  LayerMemory memory_;
  size_t keep_across_;
  // LayerMemory::caller: where each intermediate sits (the workspace, or
  // a saved part), and each route's tables in the last saved part.
  std::unique_ptr<StepMemoryPlan> step_plan_;
  std::map<std::string, std::pair<size_t, size_t>> saved_at_part_; // (part, offset)
  std::map<const RoutingNode *, size_t> table_offset_;
  std::vector<size_t> saved_bytes_; // each part's, at the current count
  bool placed_ = false;             // place() since the count last changed
  bool launches_stale_ = true;      // the count changed since the launches were built
  SavedParts saved_at_;
  CUdeviceptr workspace_at_ = 0;
};

} // namespace moeforge::cuda
