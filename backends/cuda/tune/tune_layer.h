// Tuning a layer as a library user holds it (moeforge.tune from Python), not
// as one of the CLI's examples: inputs made from the algebra's declarations,
// and the winner stored where `--schedule auto` and moeforge.torch's
// schedule="auto" look for it, as `moeforge tune` stores its own.
#pragma once

#include <functional>
#include <map>
#include <string>

#include "backends/cuda/tune/tuner.h"

namespace moeforge::cuda {

// One tensor per Input and Param of `pipeline` at `tokens` tokens: every
// Input U(-1, 1); every Param U(-a, a) with a from `init_scale` where it
// names the Param, else 1 / sqrt(fan-in) (its next-to-last extent, or its
// only one), as moeforge.torch.MoELayer initialises its Parameters; values
// bf16-exact where the buffer is bf16. A router over such inputs spreads
// the tokens about evenly over the experts.
TensorMap layer_inputs(const Pipeline &pipeline, int64_t tokens, uint64_t seed,
                       const std::map<std::string, double> &init_scale = {});

// U(-1, 1), bf16-exact, shaped like `output` at `tokens` tokens: a training
// step's upstream gradient for tuning.
HostTensor upstream_like(const Func &output, int64_t tokens, uint64_t seed);

struct StoredTune {
  TuneResult result;
  std::string cached; // the cache entry's path; empty where none was written (no cache directory)
};

// tune(), then its winner stored in the tuned-schedule cache
// (CompileCache::default_directory()/tune/) under tune_key(pipeline,
// tokens, device, training, moeforge's version).
StoredTune tune_and_store(Device &device, const TuneRequest &request,
                          const std::function<void(const std::string &)> &progress);

} // namespace moeforge::cuda
