#include "lowering/dynamic_rows.h"

namespace moeforge {

void pad_dynamic_rows(KernelProgram &p) {
  for (TensorDecl &t : p.tensors) {
    if (t.is_input || t.dims.size() < 2 || !t.dims.back().is_dynamic() || is_output(p, t.name))
      continue;
    if (t.layout != RowLayout::padded_t)
      t.stride8 = true;
  }
}

} // namespace moeforge
