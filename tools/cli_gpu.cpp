// The CLI's CUDA backend (built with MOEFORGE_HAVE_CUDA).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "backends/cuda/codegen/codegen_cuda.h"
#include "backends/cuda/codegen/compile_cache.h"
#if MOEFORGE_HAVE_NCCL
#include "backends/cuda/parallel/expert_parallel_layer.h"
#endif
#include "backends/cuda/codegen/nvrtc_compiler.h"
#include "backends/cuda/runtime/layer.h"
#include "backends/cuda/runtime/training_layer.h"
#include "backends/cuda/tune/tune_cache.h"
#include "backends/cuda/tune/tune_layer.h"
#include "lowering/gemm_plan.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "tools/cli_backend.h"

namespace moeforge {

bool cli_gpu_available(std::string *why) { return cuda::gpu_available(why); }

std::string cli_cuda_source(const Example &ex, const Schedule &schedule, bool training) {
  check_vector_alignment(ex.pipeline);
  return generate_cuda(training ? lower_training(ex.pipeline, ex.pipeline.func(ex.output), schedule).program
                                : lower(ex.pipeline, schedule))
      .source;
}

std::string cli_cuda_plans(const Example &ex, const Schedule &schedule, bool training) {
  check_vector_alignment(ex.pipeline);
  return describe_gemm_plans(training ? lower_training(ex.pipeline, ex.pipeline.func(ex.output), schedule).program
                                      : lower(ex.pipeline, schedule));
}

namespace {
// What `tune` stores its winner under and `--schedule auto` looks up.
cuda::TuneKey tune_key(const Example &ex, const ExampleShape &shape, const cuda::Device &device, bool training) {
  return cuda::tune_key(ex.pipeline, shape.tokens, device.name(), training, MOEFORGE_VERSION);
}
} // namespace

std::optional<Schedule> cli_cached_schedule_on_gpu(const Example &ex, const ExampleShape &shape, bool training,
                                                   std::string *where) {
  cuda::Device device;
  const std::filesystem::path dir = cuda::CompileCache::default_directory();
  if (dir.empty()) {
    *where = "no cache directory (MOEFORGE_CACHE_DIR or HOME)";
    return std::nullopt;
  }
  const cuda::TuneKey key = tune_key(ex, shape, device, training);
  cuda::TuneCache cache(dir);
  std::string why;
  std::optional<Schedule> s = cache.load(key, &why);
  *where = s ? cache.entry_path(key).string() + ", tuned on " + device.name() : why;
  return s;
}

TuneOutcome cli_tune_on_gpu(const Example &ex, const ExampleShape &shape, const TensorMap &inputs,
                            const TensorMap &skewed_inputs, bool training, const HostTensor &upstream,
                            const Schedule &base, double budget_seconds,
                            const std::function<void(const std::string &)> &progress) {
  check_vector_alignment(ex.pipeline);
  cuda::Device device;
  cuda::TuneRequest r;
  r.pipeline = &ex.pipeline;
  r.output = ex.output;
  r.tokens = shape.tokens;
  r.inputs = inputs;
  r.skewed_inputs = skewed_inputs;
  r.training = training;
  r.upstream = upstream;
  r.base = base;
  r.budget_seconds = budget_seconds;
  const cuda::StoredTune stored = cuda::tune_and_store(device, r, progress);
  const cuda::TuneResult &res = stored.result;
  TuneOutcome t;
  t.device = device.name();
  t.base_ms = res.base_ms;
  t.best_ms = res.best_ms;
  t.timed = res.timed;
  t.pruned = res.pruned;
  t.failed = res.failed;
  t.left = res.left;
  t.best_text = res.best.to_text();
  t.cached = stored.cached;
  return t;
}

#if MOEFORGE_HAVE_NCCL
namespace {
// Rows [begin, end) of a [rows, ...] tensor.
HostTensor rows_of(const HostTensor &t, int64_t begin, int64_t end) {
  HostTensor s = t;
  s.shape[0] = end - begin;
  const int64_t w = t.size() / t.shape[0];
  s.data.assign(t.data.begin() + begin * w, t.data.begin() + end * w);
  return s;
}

HostTensor concat_rows(const std::vector<HostTensor> &parts) {
  HostTensor out = parts.front();
  for (size_t i = 1; i < parts.size(); ++i) {
    out.shape[0] += parts[i].shape[0];
    out.data.insert(out.data.end(), parts[i].data.begin(), parts[i].data.end());
  }
  return out;
}

bool per_token(const BufferNode &b) { return !b.dims.empty() && b.dims[0].is_dynamic() && !b.dims[0].get()->base; }

// What each rank of a step on several GPUs left (train and run --ranks).
struct RankStep {
  HostTensor y;
  TensorMap grads;
  std::vector<int32_t> experts;
  int64_t received = 0;
  double forward_ms = 0, backward_ms = 0, exchange_ms = 0;
};

struct RankedRun {
  std::string backend;
  std::vector<RankStep> ranks;
  cuda::CompiledExpertParallel compiled;
};

// One step (the forward, and with `upstream` the backward) of `ex` with its
// experts spread over the schedule's ranks, GPUs 0..R-1, each rank on its
// share of the tokens; `grads_of`: the Inputs and Params whose gradients
// each rank returns.
RankedRun step_on_gpus(const Example &ex, const ExampleShape &shape, const TensorMap &inputs,
                       const HostTensor *upstream, const Schedule &schedule, const std::vector<std::string> &grads_of) {
  const int ranks = schedule.expert_parallel_ranks();
  int count = 0;
  MOEFORGE_CU(cuDeviceGetCount, &count);
  user_check(count >= ranks) << "--ranks " << ranks << ": this machine has " << count
                             << " GPU(s); give at most that many ranks";
  user_check(shape.tokens % ranks == 0) << "--ranks " << ranks << ": --tokens " << shape.tokens
                                        << " do not split evenly over the ranks; give a multiple of " << ranks;
  RankedRun out;
  std::string arch, name;
  {
    cuda::Device d(0);
    arch = d.arch_specific();
    name = d.name();
  }
  out.compiled = cuda::compile_expert_parallel(ex.pipeline, schedule, arch);
  out.backend = "cuda on " + std::to_string(ranks) + " x " + name + " (" + arch + "), experts spread over " +
                std::to_string(ranks) + " ranks (E / R = " + std::to_string(out.compiled.split.local_experts) +
                " each)";
  const int64_t per = shape.tokens / ranks;
  std::vector<int> devices(ranks);
  for (int q = 0; q < ranks; ++q)
    devices[q] = q;
  std::vector<cuda::Communicator> comms = cuda::Communicator::for_devices(devices);
  out.ranks.resize(ranks);
  cuda::on_each_rank(devices, [&](int q) {
    cuda::Device device(q);
    cuda::Stream stream;
    cuda::ExpertParallelLayer layer(device, out.compiled, comms[q], per);
    TensorMap mine;
    for (const BufferPtr &b : ex.pipeline.buffers())
      mine[b->name] = per_token(*b) ? rows_of(inputs.at(b->name), q * per, (q + 1) * per) : inputs.at(b->name);
    layer.upload(mine);
    if (upstream)
      layer.upload_upstream_gradient(ex.output, rows_of(*upstream, q * per, (q + 1) * per));
    layer.poison();
    layer.time_phases(true);
    for (int step = 0; step < 2; ++step) { // a warm-up step, then the timed one
      layer.forward(stream);
      if (upstream)
        layer.backward(stream);
      stream.synchronize();
    }
    RankStep &r = out.ranks[q];
    for (const auto &[phase, ms] : layer.phase_ms()) {
      (phase.rfind("forward", 0) == 0 ? r.forward_ms : r.backward_ms) += ms;
      if (phase.find("dispatch") != std::string::npos || phase.find("return") != std::string::npos ||
          phase.find("counts") != std::string::npos)
        r.exchange_ms += ms;
    }
    r.y = layer.output(ex.output);
    for (const std::string &of : grads_of)
      r.grads[of] = layer.gradient(of);
    r.experts = layer.token_layer().routed_experts(out.compiled.split.route);
    r.received = layer.received_rows();
  });
  return out;
}

std::vector<std::string> rank_report(const RankedRun &run, bool training) {
  std::vector<std::string> lines;
  const int64_t local = run.compiled.split.local_experts;
  for (size_t q = 0; q < run.ranks.size(); ++q) {
    const RankStep &r = run.ranks[q];
    char line[256];
    const long long first = static_cast<long long>(q) * local;
    std::snprintf(line, sizeof line,
                  "rank %zu    GPU %zu: tokens %lld, experts %lld-%lld computed %lld rows; forward %.3f ms", q, q,
                  static_cast<long long>(r.y.shape[0]), first, first + local - 1, static_cast<long long>(r.received),
                  r.forward_ms);
    std::string text = line;
    if (training) {
      std::snprintf(line, sizeof line, ", backward %.3f ms", r.backward_ms);
      text += line;
    }
    std::snprintf(line, sizeof line, ", of which exchanging rows %.3f ms", r.exchange_ms);
    lines.push_back(text + line);
  }
  return lines;
}

// The experts every rank chose, in the order of all tokens.
std::vector<int32_t> all_experts(const RankedRun &run) {
  std::vector<int32_t> experts;
  for (const RankStep &r : run.ranks)
    experts.insert(experts.end(), r.experts.begin(), r.experts.end());
  return experts;
}
} // namespace

BackendRun cli_run_on_gpus(const Example &ex, const ExampleShape &shape, const TensorMap &inputs,
                           const Schedule &schedule, std::vector<std::string> *rank_lines) {
  RankedRun ranked = step_on_gpus(ex, shape, inputs, nullptr, schedule, {});
  BackendRun run;
  run.backend = ranked.backend;
  std::vector<HostTensor> ys;
  for (const RankStep &r : ranked.ranks) {
    ys.push_back(r.y);
    run.ms = std::max(run.ms, r.forward_ms);
  }
  run.values[ex.output] = concat_rows(ys);
  for (const RoutingPtr &r : ex.pipeline.routes())
    if (r->name == ranked.compiled.split.route)
      run.routes[r->name] = routing_from_experts(*r, shape.tokens, all_experts(ranked), {});
  *rank_lines = rank_report(ranked, false);
  return run;
}

BackendTraining cli_train_on_gpus(const TrainingTask &task, const ExampleShape &shape, const TensorMap &inputs,
                                  const Schedule &schedule, std::vector<std::string> *rank_lines) {
  const Example &ex = task.example;
  user_check(task.outputs.size() == 1)
      << "--ranks with --aux: an auxiliary loss over the tokens would be each rank's own, not the layer's; "
      << "train the auxiliary losses on one GPU";
  const TrainingProgram unsplit = lower_training(ex.pipeline, task.outputs, schedule.on_one_rank()); // for names
  RankedRun ranked = step_on_gpus(ex, shape, inputs, &task.upstream.at(ex.output), schedule, unsplit.of);
  BackendTraining run;
  run.backend = ranked.backend;
  run.training = unsplit;
  std::vector<HostTensor> ys;
  for (const RankStep &r : ranked.ranks) {
    ys.push_back(r.y);
    run.forward_ms = std::max(run.forward_ms, r.forward_ms);
    run.backward_ms = std::max(run.backward_ms, r.backward_ms);
  }
  run.values[ex.output] = concat_rows(ys);
  const auto &params = ranked.compiled.split.expert_params;
  for (size_t i = 0; i < unsplit.of.size(); ++i) {
    const std::string &of = unsplit.of[i];
    std::vector<HostTensor> parts;
    for (const RankStep &r : ranked.ranks)
      parts.push_back(r.grads.at(of));
    HostTensor g = parts.front();
    if (per_token(*ex.pipeline.buffer(of)) || std::find(params.begin(), params.end(), of) != params.end()) {
      g = concat_rows(parts);
    } else { // on every rank: each holds its tokens' share
      for (size_t q = 1; q < parts.size(); ++q)
        for (int64_t k = 0; k < g.size(); ++k)
          g.data[k] += parts[q].data[k];
    }
    run.values[unsplit.gradients[i]] = g;
  }
  for (const RoutingNode *r : unsplit.program.routes)
    if (r->name == ranked.compiled.split.route)
      run.routes[r->name] = routing_from_experts(*r, shape.tokens, all_experts(ranked), {});
  *rank_lines = rank_report(ranked, true);
  return run;
}
#endif

} // namespace moeforge
