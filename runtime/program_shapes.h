// A kernel program's storage for one token count, as every backend lays it
// out: the token Dim bound to `tokens`, each route's routing shape (its
// padded layout's rows), each tensor's element count; and the conversions
// between the user's host tensors (the reference's layout, doubles) and the
// backends' bytes (bf16 rounded to nearest even or f32, routed rows padded).
// The CUDA and CPU runtimes share it, so their buffers agree by construction.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "lowering/kernel_program.h"
#include "lowering/training.h"
#include "runtime/routing_host.h"
#include "runtime/size_terms.h"
#include "runtime/tensor.h"

namespace moeforge {

// `values` stored as `t`: f32, or bf16 rounded to nearest even.
std::vector<uint8_t> encode_values(const HostValues &values, DType t);
// encode_values(hashed_random_tensor(shape, seed, stream, lo, hi, bf16).data,
// t), made without the doubles: a real-size layer's weights are 25 GB as
// doubles and 6 GB as the bf16 the GPU reads.
std::vector<uint8_t> encode_hashed_random(int64_t elements, uint64_t seed, uint64_t stream, double lo, double hi,
                                          bool bf16, DType t);

class ProgramShapes {
public:
  // UserError for tokens < 1 or a dtype no backend stores (f16).
  ProgramShapes(const KernelProgram &program, int64_t tokens);

  int64_t tokens() const { return tokens_; }
  int64_t extent(const Dim &d) const;
  const RoutingShape &routing(const RoutingNode *route) const { return routings_.at(route); }
  const std::map<const RoutingNode *, RoutingShape> &routings() const { return routings_; }
  // Stored elements of t (padded layouts hold max_padded_rows rows); at least 1.
  int64_t elements(const TensorDecl &t) const;
  // t's stored bytes (elements() times its dtype's) over any token count,
  // as size_terms.h writes them; none for a size not of that form (a
  // dropping route's rows, which follow its capacity, or a Param inside a
  // larger tensor).
  std::optional<SizeProduct> bytes_over_tokens(const TensorDecl &t) const;
  // t's shape as the user and the reference see it (routed rows: T * k).
  std::vector<int64_t> shape(const TensorDecl &t) const;
  // Where a dynamic Dim's extent lives, for kernel arguments (stable address).
  long long *dynamic_extent(const std::string &dim);

  // The bytes of input t from `inputs` (shape checked, values rounded to t's
  // dtype); UserError naming the tensor otherwise.
  std::vector<uint8_t> encode_input(const TensorDecl &t, const TensorMap &inputs) const;
  // t's stored bytes back in the reference's layout; a padded or sorted
  // tensor needs the row each pair is stored at (padded: the route's
  // pair_pos; sorted: sorted_rows() of its tables).
  HostTensor decode(const TensorDecl &t, const std::vector<uint8_t> &bytes,
                    const std::vector<int32_t> *pair_rows = nullptr) const;
  // A stride8 tensor's bytes as a backend that pads its rows stores them
  // (each row's last extent rounded up to 8 elements: the CUDA backend) with
  // the padding dropped, as decode() reads them; others unchanged. The CPU
  // backend keeps such rows dense (its storage is only larger).
  std::vector<uint8_t> drop_row_padding(const TensorDecl &t, std::vector<uint8_t> bytes) const;

private:
  int64_t tokens_;
  // Every dynamic Dim is the token count; a dropping route's padded row
  // bound is here too, by max_padded_rows_extent(route).
  std::map<std::string, long long> dynamic_;
  std::map<const RoutingNode *, RoutingShape> routings_;
};

// The activation memory of a training step for `tokens` tokens: the bytes of
// the tensors the forward keeps for the backward (TrainingProgram::saved) plus
// the routing tables the backward reads (pair_pos and expert per pair,
// sorted_pair per padded row, 4 bytes each).
int64_t saved_bytes(const TrainingProgram &t, int64_t tokens);

} // namespace moeforge
