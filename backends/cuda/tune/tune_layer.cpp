#include "backends/cuda/tune/tune_layer.h"

#include <cmath>
#include <filesystem>

#include "backends/cuda/codegen/compile_cache.h"
#include "backends/cuda/tune/tune_cache.h"

namespace moeforge::cuda {

namespace {

std::vector<int64_t> shape_at(const std::vector<Dim> &dims, int64_t tokens) {
  std::vector<int64_t> shape;
  for (const Dim &d : dims)
    shape.push_back(d.is_dynamic() ? tokens : d.extent());
  return shape;
}

} // namespace

TensorMap layer_inputs(const Pipeline &pipeline, int64_t tokens, uint64_t seed,
                       const std::map<std::string, double> &init_scale) {
  TensorMap out;
  for (const BufferPtr &b : pipeline.buffers()) {
    const std::vector<int64_t> shape = shape_at(b->dims, tokens);
    double a = 1.0;
    if (b->kind == BufferKind::param) {
      auto it = init_scale.find(b->name);
      const int64_t fan_in = shape.size() >= 2 ? shape[shape.size() - 2] : shape.empty() ? 1 : shape.back();
      a = it != init_scale.end() ? it->second : 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(fan_in, 1)));
    }
    out[b->name] = hashed_random_tensor(shape, seed, random_stream(b->name), -a, a, b->dtype == DType::bf16);
  }
  return out;
}

HostTensor upstream_like(const Func &output, int64_t tokens, uint64_t seed) {
  std::vector<Dim> dims;
  for (const Var &v : output.args())
    dims.push_back(v.dim());
  return hashed_random_tensor(shape_at(dims, tokens), seed, random_stream("d_" + output.name()), -1, 1, true);
}

StoredTune tune_and_store(Device &device, const TuneRequest &request,
                          const std::function<void(const std::string &)> &progress) {
  StoredTune t{tune(device, request, progress), ""};
  const TuneKey key = tune_key(*request.pipeline, request.tokens, device.name(), request.training, MOEFORGE_VERSION);
  const std::filesystem::path dir = CompileCache::default_directory();
  if (!dir.empty() && TuneCache(dir).store(key, t.result.best))
    t.cached = TuneCache(dir).entry_path(key).string();
  return t;
}

} // namespace moeforge::cuda
