// What the CLI needs from a compiled backend (CUDA or LLVM CPU): run an
// example once under a schedule and hand back what it computed. cli.cpp does
// the printing and the --check against the reference, the same for both.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "backends/reference/evaluate.h"
#include "examples/examples.h"
#include "lowering/kernel_program.h"
#include "lowering/training.h"
#include "schedules/schedule.h"

namespace moeforge {

struct BackendRun {
  std::string backend;                         // e.g. "cuda on NVIDIA H200 (sm_90a)"
  double ms = 0;                               // one forward, after a warm-up
  std::map<std::string, RoutingResult> routes; // the experts each route chose
  TensorMap values;                            // every Func the schedule materialises, pair order
};

// One training step on a compiled backend: the forward, then the backward.
struct BackendTraining {
  std::string backend;
  double forward_ms = 0, backward_ms = 0;      // one step, after a warm-up step
  TrainingProgram training;                    // what was compiled (saved and recomputed tensors)
  int64_t saved_bytes = 0;                     // the activation memory kept for the backward
  std::map<std::string, RoutingResult> routes; // the experts each route chose
  TensorMap values;                            // every output and gradient, by their Funcs' names
};

// What one training step trains: the example's forward outputs (its own, and
// with --aux its auxiliary losses) and each one's upstream gradient, by the
// output's name.
struct TrainingTask {
  Example example;
  std::vector<Func> outputs;
  TensorMap upstream; // output name -> d(loss)/d(output), shaped like it
};

// The routing statistics' input from a backend's expert ids and the pairs
// it kept at capacity (pair order).
RoutingResult routing_from_experts(const RoutingNode &route, int64_t tokens, std::vector<int32_t> experts,
                                   std::vector<uint8_t> kept);

// `run` and `train` on compiled backend `backend` ("cpu", "cuda"; built
// with it), through the backend interface (backend_run.cpp). every_func:
// download every Func the layer materialises (for --check), else the output
// alone. inputs: the host's, or null for the example's random inputs of
// `seed` made straight in the backend's storage type (the same values,
// without the doubles).
BackendRun run_on_backend(const std::string &backend, const Example &ex, const ExampleShape &shape,
                          const TensorMap *inputs, uint64_t seed, const Schedule &schedule, bool every_func);
BackendTraining train_on_backend(const std::string &backend, const TrainingTask &task, const ExampleShape &shape,
                                 const TensorMap &inputs, const Schedule &schedule);

// Each is built only with its backend (MOEFORGE_HAVE_CUDA, MOEFORGE_HAVE_CPU_BACKEND).
bool cli_gpu_available(std::string *why);
// The schedule `moeforge tune` cached for this layer, token bucket, GPU and
// compiler (`--schedule auto`), or nothing; `where` gets the entry's path
// and device, or why there is none.
std::optional<Schedule> cli_cached_schedule_on_gpu(const Example &ex, const ExampleShape &shape, bool training,
                                                   std::string *where);
// `train --ranks N` (a schedule with expert_parallel(N)): one training step
// with the experts spread over GPUs 0..N-1 of this machine (backends/cuda/parallel/expert_parallel_layer.h), each rank
// training on its share of the tokens. The values are assembled as the
// unsplit layer's (outputs and token gradients in token order, each
// expert's gradient from its owner, the replicated weights' gradients
// summed over the ranks), so that --check compares them with the
// reference; `rank_lines` gets a line per rank (its tokens, the rows its
// experts computed, its times). Built with NCCL (MOEFORGE_HAVE_NCCL).
// `run --ranks N`: the forward alone, likewise (the output in token order).
BackendRun cli_run_on_gpus(const Example &ex, const ExampleShape &shape, const TensorMap &inputs,
                           const Schedule &schedule, std::vector<std::string> *rank_lines);
BackendTraining cli_train_on_gpus(const TrainingTask &task, const ExampleShape &shape, const TensorMap &inputs,
                                  const Schedule &schedule, std::vector<std::string> *rank_lines);
std::string cli_cuda_source(const Example &ex, const Schedule &schedule, bool training);
// Each GEMM's plan on the CUDA backend (gemm_plan.h): of the forward, or
// with `training` of the training step's forward and backward.
std::string cli_cuda_plans(const Example &ex, const Schedule &schedule, bool training);
// `moeforge tune`: the search on the GPU (backends/cuda/tune/tuner.h), its winner
// stored in the tuned-schedule cache.
struct TuneOutcome {
  std::string device, best_text, cached; // cached: the entry's path, empty when not written
  double base_ms = 0, best_ms = 0;
  int timed = 0, pruned = 0, failed = 0, left = 0;
};
TuneOutcome cli_tune_on_gpu(const Example &ex, const ExampleShape &shape, const TensorMap &inputs,
                            const TensorMap &skewed_inputs, bool training, const HostTensor &upstream,
                            const Schedule &base, double budget_seconds,
                            const std::function<void(const std::string &)> &progress);
std::string cli_llvm_ir(const Pipeline &pipeline, const Schedule &schedule);

} // namespace moeforge
