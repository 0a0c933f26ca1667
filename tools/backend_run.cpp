// `run` and `train` on a compiled backend, through the backend interface
// (runtime/backend.h): the same steps for the CPU and the GPU.
#include "backends/backends.h"
#include "runtime/program_shapes.h"
#include "tools/cli_backend.h"

namespace moeforge {

namespace {

// Every route's choices (and what it kept at capacity) from a finished layer
// of either kind.
template <typename L>
std::map<std::string, RoutingResult> routes_of(const KernelProgram &program, const L &layer, int64_t tokens) {
  std::map<std::string, RoutingResult> routes;
  for (const RoutingNode *r : program.routes)
    routes[r->name] = routing_from_experts(*r, tokens, layer.routed_experts(r->name), layer.kept_pairs(r->name));
  return routes;
}

// The example's inputs of `seed`, made straight in each one's storage type:
// the values random_inputs gives, without the doubles, which at real sizes
// are tens of gigabytes.
void upload_seeded(Layer &layer, const Example &ex, const ExampleShape &shape, uint64_t seed) {
  for (const BufferPtr &b : ex.pipeline.buffers()) {
    int64_t elements = 1;
    for (int64_t e : ex.input_shape(*b, shape))
      elements *= e;
    const double a = ex.init_range(b->name);
    const TensorDecl *t = layer.program().find(b->name);
    internal_check(t != nullptr) << "input '" << b->name << "' is not in the layer's program";
    layer.upload_bytes(b->name, encode_hashed_random(elements, seed, random_stream(b->name), -a, a,
                                                     b->dtype == DType::bf16, t->dtype));
  }
}

} // namespace

BackendRun run_on_backend(const std::string &name, const Example &ex, const ExampleShape &shape,
                          const TensorMap *inputs, uint64_t seed, const Schedule &schedule, bool every_func) {
  const std::unique_ptr<Backend> backend = make_backend(name);
  const std::unique_ptr<Layer> layer = backend->layer(ex.pipeline, schedule, shape.tokens);
  if (inputs)
    layer->upload(*inputs);
  else
    upload_seeded(*layer, ex, shape, seed);
  layer->poison();
  layer->run(); // warm-up: module load or JIT, first touch of every buffer
  BackendRun run;
  run.ms = layer->run();
  run.backend = backend->description();
  run.routes = routes_of(layer->program(), *layer, shape.tokens);
  // Without --check only the output: at real sizes the others are gigabytes
  // to copy back and convert.
  for (const TensorDecl &t : layer->program().tensors)
    if (!t.is_input && (every_func || t.name == ex.output))
      run.values[t.name] = layer->download(t.name);
  return run;
}

BackendTraining train_on_backend(const std::string &name, const TrainingTask &task, const ExampleShape &shape,
                                 const TensorMap &inputs, const Schedule &schedule) {
  const std::unique_ptr<Backend> backend = make_backend(name);
  const std::unique_ptr<TrainingLayer> layer =
      backend->training_layer(task.example.pipeline, task.outputs, schedule, shape.tokens);
  layer->upload(inputs);
  layer->poison();
  for (const auto &[output, grad] : task.upstream)
    layer->upload_upstream_gradient(output, grad);
  layer->forward(); // warm-up step
  layer->backward();
  BackendTraining run;
  run.forward_ms = layer->forward();
  run.backward_ms = layer->backward();
  run.backend = backend->description();
  const TrainingProgram &t = layer->training();
  run.routes = routes_of(t.program, *layer, shape.tokens);
  for (const std::string &o : t.outputs)
    run.values[o] = layer->output(o);
  for (size_t i = 0; i < t.of.size(); ++i)
    run.values[t.gradients[i]] = layer->gradient(t.of[i]);
  run.saved_bytes = layer->saved_bytes();
  run.training = t;
  return run;
}

} // namespace moeforge
