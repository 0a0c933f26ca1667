// A byte count of a layer's memory as a function of the token count T, in
// the few forms a layer's sizes take, so that a framework can evaluate it at
// a symbolic T: torch.compile's fake kernels must give the saved parts'
// sizes (an output of the forward op) before the layer runs, and a size known
// only when the op runs (an unbacked size) splits inductor's graph and its
// CUDA graphs around the op.
//   bytes(T) = sum over terms of round_up(sum over products of
//              bytes * prod over factors of factor(T), align)
//   factor(T) = ((a T + b) / d) m + c   (integer division; all >= 0)
// which covers T, T k (pairs), a route's padded rows ((ceil(T k / block) +
// E) block), its tiles (ceil(T k / block) + E), a count rounded up to 8,
// and constants.
#pragma once

#include <cstdint>
#include <vector>

namespace moeforge {

struct SizeFactor {
  int64_t a = 0, b = 0, d = 1, m = 1, c = 0;
  int64_t at(int64_t tokens) const { return (a * tokens + b) / d * m + c; }
  static SizeFactor constant(int64_t n) { return {0, 0, 1, 1, n}; }
  static SizeFactor tokens(int64_t times = 1) { return {times, 0, 1, 1, 0}; }
  // max_padded_rows and max_tiles of a dropless route (routing_format.h).
  static SizeFactor padded_rows(int k, int block, int experts) {
    return {k, block - 1, block, block, int64_t{experts} * block};
  }
  static SizeFactor tiles(int k, int block, int experts) { return {k, block - 1, block, 1, experts}; }
};

struct SizeProduct {
  int64_t bytes = 1;
  std::vector<SizeFactor> factors;
  int64_t at(int64_t tokens) const;
};

struct SizeTerm {
  std::vector<SizeProduct> sum;
  int64_t align = 1;
  int64_t at(int64_t tokens) const;
};

using SizeTerms = std::vector<SizeTerm>;
int64_t size_at(const SizeTerms &terms, int64_t tokens);

} // namespace moeforge
