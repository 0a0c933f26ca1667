// The Eigen reference: evaluates any well-formed Pipeline on host tensors, in
// float32 or float64, with no schedule. It is the oracle every schedule and
// backend is checked against, so it is written for clarity first: each Func
// is materialised densely over its indices; contractions become Eigen matrix
// products; expressions that read expert(r) are evaluated one expert segment
// at a time (the rows r routed to expert e form one dense GEMM), which is the
// same grouping MegaBlocks uses, and keeps memory at the size of the tensors.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dsl/fp8.h"
#include "dsl/pipeline.h"
#include "runtime/tensor.h"

namespace moeforge {

enum class Precision { f32, f64 };

// The pairs a top_k chose: pair r = t * k + slot routes token[r] to expert[r].
struct RoutingResult {
  int64_t tokens = 0;
  int64_t experts = 0;
  int k = 0;
  std::vector<int32_t> token;
  std::vector<int32_t> expert;
  // kept[r] = 0 for a pair dropped at its expert's capacity (dsl/capacity.h);
  // empty when the route is dropless. A dropped pair adds nothing to any sum
  // over the pairs; its pair values are still computed.
  std::vector<uint8_t> kept;
  bool is_kept(size_t r) const { return kept.empty() || kept[r]; }
  int64_t dropped() const;
  // Rows routed to each expert (kept ones).
  std::vector<int64_t> expert_counts() const;
};

// How the reference routes, beyond the algebra.
struct EvalOptions {
  EvalOptions() = default;
  // NOLINTNEXTLINE: the experts given, as the overloads below always took them
  EvalOptions(std::map<std::string, std::vector<int32_t>> g) : given(std::move(g)) {}
  // The experts of each route named here taken as given (see below).
  std::map<std::string, std::vector<int32_t>> given;
  // A schedule's expert capacity (Schedule::capacity): every top_k route
  // drops past it, as the compiled layer does. 0: dropless.
  double capacity_factor = 0;
  // Funcs whose contractions take FP8 operands (Schedule::fp8_funcs): each
  // operand is rounded to bf16, then in blocks by dsl/fp8.h's rule, before
  // the product, as the compiled layer rounds them, and the product is then
  // exact. Blocks
  // along a sum over an expert's pairs (a weight gradient) run over that
  // expert's pairs in pair order from its first.
  std::map<std::string, Fp8Format> fp8;
};

struct EvalResult {
  TensorMap values;                            // every Func, by name
  std::map<std::string, RoutingResult> routes; // every route, by name
  std::map<std::string, int64_t> extents;      // every Dim, by name
  const HostTensor &operator[](const std::string &func) const;
};

// Evaluates every step of `p`. `inputs` holds one tensor per Input and Param,
// shaped as declared; a dynamic Dim takes its extent from the first tensor
// that uses it. Wrong or missing inputs are UserErrors naming the tensor.
EvalResult evaluate(const Pipeline &p, const TensorMap &inputs, Precision precision = Precision::f64);

// The same, with the experts of each route named in `given` taken as given
// (pair order, r = t * k + slot, as a backend chose them) instead of
// selected from the probabilities; everything else, the gates included, is
// computed as usual. For comparing a backend's values under its own routing
// where a near-tie of two scores, within the rounding of bf16 storage,
// went the other way. UserError for a wrong count, an expert out of range
// or one chosen twice for a token.
EvalResult evaluate(const Pipeline &p, const TensorMap &inputs, Precision precision, const EvalOptions &options);

// Inputs by pointer, read in place (Precision::f64): several evaluations can
// share one copy of large weights (the sampled check's token groups, one
// per thread). The tensors must outlive the call.
using TensorViews = std::map<std::string, const HostTensor *>;
EvalResult evaluate(const Pipeline &p, const TensorViews &inputs, Precision precision = Precision::f64,
                    const EvalOptions &options = {});

} // namespace moeforge
