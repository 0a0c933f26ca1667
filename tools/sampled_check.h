// `--check` at any size: the float64 reference evaluated on a sample of the
// tokens instead of all of them. A layer whose every value for token t
// depends only on token t's inputs (and the weights) gives, on the sampled
// tokens alone, exactly the rows it gives them in the whole batch, routing
// included (top-k is per token); so the backend's rows for those tokens are
// checked against a reference whose cost does not grow with T.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backends/reference/evaluate.h"
#include "dsl/pipeline.h"
#include "runtime/tensor.h"

namespace moeforge {

// Why the layer cannot be checked on a sample of its tokens (a reduction
// over the tokens, a per-expert sum, the token count in an expression, a
// token index that is not a tensor's first), or "" when it can.
std::string token_sampling_blocker(const Pipeline &pipeline);

struct TokenSample {
  std::vector<int64_t> tokens; // ascending, distinct
  TensorMap inputs;            // the Inputs over the token Dim cut to those rows; the rest whole
};

// `count` distinct tokens of `tokens`, drawn with `seed`. The tensors kept
// whole (the weights) are moved into the sample: pass a copy, or std::move
// the inputs when they are not needed again.
TokenSample sample_tokens(const Pipeline &pipeline, TensorMap inputs, int64_t tokens, int64_t count, uint64_t seed);

// evaluate(pipeline, sample.inputs) in float64, the sample's tokens split
// into `groups` contiguous groups evaluated on as many threads (the weights
// shared, read in place) and put back together in the sample's order: the
// same values, as a token's rows depend on that token alone, with the
// reference's per-expert work on every core.
EvalResult evaluate_sample(const Pipeline &pipeline, const TokenSample &sample, int groups);

// The rows of Func `func`'s values over the whole batch that belong to the
// sample: its token rows, or for a Func over a route's pairs (r = t * k +
// slot) each sampled token's k rows; a Func without a token index whole.
HostTensor sample_rows(const Pipeline &pipeline, const std::string &func, const HostTensor &full,
                       const TokenSample &sample);

} // namespace moeforge
