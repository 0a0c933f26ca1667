// The CLI's CUDA backend (built with MOEFORGE_HAVE_CUDA).
#include <filesystem>
#include <sstream>

#include "backends/cuda/codegen_cuda.h"
#include "backends/cuda/compile_cache.h"
#include "backends/cuda/gemm_plan.h"
#include "backends/cuda/layer.h"
#include "backends/cuda/nvrtc_compiler.h"
#include "backends/cuda/training_layer.h"
#include "backends/cuda/tune_cache.h"
#include "backends/cuda/tuner.h"
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
  std::ostringstream algebra;
  algebra << ex.pipeline;
  return cuda::TuneKey{algebra.str(), cuda::token_bucket(shape.tokens), device.name(),
                       std::string("moeforge ") + MOEFORGE_VERSION + ", NVRTC " + cuda::nvrtc_version(), training};
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

TuneOutcome cli_tune_on_gpu(const Example &ex, const ExampleShape &shape, const TensorMap &inputs, bool training,
                            const HostTensor &upstream, const Schedule &base, double budget_seconds,
                            const std::function<void(const std::string &)> &progress) {
  check_vector_alignment(ex.pipeline);
  cuda::Device device;
  cuda::TuneRequest r;
  r.pipeline = &ex.pipeline;
  r.output = ex.output;
  r.tokens = shape.tokens;
  r.inputs = inputs;
  r.training = training;
  r.upstream = upstream;
  r.base = base;
  r.budget_seconds = budget_seconds;
  cuda::TuneResult res = cuda::tune(device, r, progress);
  TuneOutcome t;
  t.device = device.name();
  t.base_ms = res.base_ms;
  t.best_ms = res.best_ms;
  t.timed = res.timed;
  t.pruned = res.pruned;
  t.failed = res.failed;
  t.left = res.left;
  t.best_text = res.best.to_text();
  const cuda::TuneKey key = tune_key(ex, shape, device, training);
  const std::filesystem::path dir = cuda::CompileCache::default_directory();
  if (!dir.empty() && cuda::TuneCache(dir).store(key, res.best))
    t.cached = cuda::TuneCache(dir).entry_path(key).string();
  return t;
}

BackendRun cli_run_on_gpu(const Example &ex, const ExampleShape &shape, const TensorMap *inputs, uint64_t seed,
                          const Schedule &schedule, bool every_func) {
  cuda::Device device;
  cuda::CompiledLayer compiled = cuda::compile_layer(ex.pipeline, schedule, device.arch_specific());
  cuda::CudaLayer layer(device, compiled, shape.tokens);
  if (inputs) {
    layer.upload(*inputs);
  } else {
    for (const BufferPtr &b : ex.pipeline.buffers()) {
      int64_t elements = 1;
      for (int64_t e : ex.input_shape(*b, shape))
        elements *= e;
      const double a = ex.init_range(b->name);
      layer.upload_bytes(b->name, encode_hashed_random(elements, seed, random_stream(b->name), -a, a,
                                                       b->dtype == DType::bf16, layer.info(b->name).dtype));
    }
  }
  layer.poison();
  cuda::Stream stream;
  layer.enqueue(stream); // warm-up: module load, first touch
  stream.synchronize();
  cuda::Event start, stop;
  start.record(stream);
  layer.enqueue(stream);
  stop.record(stream);
  stop.synchronize();

  BackendRun run;
  run.backend = "cuda on " + device.name() + " (" + device.arch_specific() + ")";
  run.ms = cuda::elapsed_ms(start, stop);
  collect_results(run, compiled.program, layer, shape.tokens, every_func ? nullptr : &ex.output);
  return run;
}

BackendTraining cli_train_on_gpu(const TrainingTask &task, const ExampleShape &shape, const TensorMap &inputs,
                                 const Schedule &schedule) {
  cuda::Device device;
  cuda::CompiledTraining compiled =
      cuda::compile_training(task.example.pipeline, task.outputs, schedule, device.arch_specific());
  cuda::TrainingLayer layer(device, compiled, shape.tokens);
  layer.upload(inputs);
  layer.poison();
  for (const auto &[output, grad] : task.upstream)
    layer.upload_upstream_gradient(output, grad);
  cuda::Stream stream;
  layer.forward(stream); // warm-up: module load, first touch
  layer.backward(stream);
  stream.synchronize();
  cuda::Event start, mid, stop;
  start.record(stream);
  layer.forward(stream);
  mid.record(stream);
  layer.backward(stream);
  stop.record(stream);
  stop.synchronize();

  BackendTraining run;
  run.backend = "cuda on " + device.name() + " (" + device.arch_specific() + ")";
  run.forward_ms = cuda::elapsed_ms(start, mid);
  run.backward_ms = cuda::elapsed_ms(mid, stop);
  collect_training(run, compiled.training, layer, shape.tokens);
  return run;
}

} // namespace moeforge
