// The checks a layer's host API makes on its caller, the same for the CPU
// and the CUDA backends: reading a tensor the layer does not hold, and
// running steps whose Inputs or Params were never given.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "lowering/kernel_program.h"
#include "runtime/program_shapes.h"

namespace moeforge {

// The declaration of tensor `name` for download(), or a user error naming
// the tensors the layer holds.
const TensorDecl &downloadable(const KernelProgram &program, const std::string &name);

// A tensor as the layer stores it: its storage type, its shape as the
// reference lays it out (routed rows in pair order, T * k), whether its
// stored bytes are exactly that (row-major, unpadded), so that another
// framework's tensor can be bound or copied as is, and its stored bytes.
struct TensorInfo {
  DType dtype;
  std::vector<int64_t> shape;
  bool contiguous;
  size_t bytes;
};
// UserError naming the layer's tensors for an unknown name.
TensorInfo tensor_info(const KernelProgram &program, const ProgramShapes &shapes, const std::string &name);

// A user error unless every Input and Param the steps [begin, end) read is
// in `uploaded` (the steps would compute on whatever the memory held); `call`
// is the API call that runs them ("run()", "enqueue()").
void check_uploaded(const KernelProgram &program, size_t begin, size_t end, const std::set<std::string> &uploaded,
                    const std::string &call);

} // namespace moeforge
