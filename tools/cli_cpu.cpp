// The CLI's LLVM CPU backend (built with MOEFORGE_HAVE_CPU_BACKEND).
#include <chrono>

#include "backends/cpu/cpu_layer.h"
#include "backends/cpu/cpu_training.h"
#include "tools/cli_backend.h"

namespace moeforge {

std::string cli_llvm_ir(const Pipeline &pipeline, const Schedule &schedule) {
  return cpu::cpu_llvm_ir(pipeline, schedule, /*optimised=*/true);
}

BackendRun cli_run_on_cpu(const Example &ex, const ExampleShape &shape, const TensorMap &inputs,
                          const Schedule &schedule, bool every_func) {
  cpu::CompiledCpuLayer compiled = cpu::compile_cpu_layer(ex.pipeline, schedule);
  cpu::CpuLayer layer(compiled, shape.tokens);
  layer.upload(inputs);
  layer.poison();
  layer.run(); // warm-up: first touch of every buffer
  auto start = std::chrono::steady_clock::now();
  layer.run();
  BackendRun run;
  run.backend = "cpu (LLVM JIT, one thread)";
  run.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  collect_results(run, compiled.program, layer, shape.tokens, every_func ? nullptr : &ex.output);
  return run;
}

BackendTraining cli_train_on_cpu(const TrainingTask &task, const ExampleShape &shape, const TensorMap &inputs,
                                 const Schedule &schedule) {
  cpu::CompiledCpuTraining compiled = cpu::compile_cpu_training(task.example.pipeline, task.outputs, schedule);
  cpu::CpuTrainingLayer layer(compiled, shape.tokens);
  layer.upload(inputs);
  layer.poison();
  for (const auto &[output, grad] : task.upstream)
    layer.upload_upstream_gradient(output, grad);
  layer.forward(); // warm-up: first touch of every buffer
  layer.backward();
  using Clock = std::chrono::steady_clock;
  auto start = Clock::now();
  layer.forward();
  auto mid = Clock::now();
  layer.backward();
  auto stop = Clock::now();
  BackendTraining run;
  run.backend = "cpu (LLVM JIT, one thread)";
  run.forward_ms = std::chrono::duration<double, std::milli>(mid - start).count();
  run.backward_ms = std::chrono::duration<double, std::milli>(stop - mid).count();
  collect_training(run, compiled.training, layer, shape.tokens);
  return run;
}

} // namespace moeforge
