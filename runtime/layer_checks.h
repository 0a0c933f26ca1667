// The checks a layer's host API makes on its caller, the same for the CPU
// and the CUDA backends: reading a tensor the layer does not hold, and
// running steps whose Inputs or Params were never given.
#pragma once

#include <cstddef>
#include <set>
#include <string>

#include "lowering/kernel_program.h"

namespace moeforge {

// The declaration of tensor `name` for download(), or a user error naming
// the tensors the layer holds.
const TensorDecl &downloadable(const KernelProgram &program, const std::string &name);

// A user error unless every Input and Param the steps [begin, end) read is
// in `uploaded` (the steps would compute on whatever the memory held); `call`
// is the API call that runs them ("run()", "enqueue()").
void check_uploaded(const KernelProgram &program, size_t begin, size_t end, const std::set<std::string> &uploaded,
                    const std::string &call);

} // namespace moeforge
