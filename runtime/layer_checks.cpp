#include "runtime/layer_checks.h"

#include "dsl/error.h"

namespace moeforge {

const TensorDecl &downloadable(const KernelProgram &program, const std::string &name) {
  if (const TensorDecl *t = program.find(name))
    return *t;
  std::string known;
  for (const TensorDecl &d : program.tensors)
    if (!d.is_input)
      known += (known.empty() ? "" : ", ") + d.name;
  user_error << "download(\"" << name << "\"): this layer holds no tensor of that name; it holds " << known;
}

void check_uploaded(const KernelProgram &program, size_t begin, size_t end, const std::set<std::string> &uploaded,
                    const std::string &call) {
  for (size_t i = begin; i < end; ++i)
    for (const std::string &r : step_reads(program.steps[i])) {
      const TensorDecl *t = program.find(r);
      user_check(!t || !t->is_input || uploaded.count(r))
          << call << " before upload() of '" << r << "': give every Input and Param (upload(inputs), or upload(\"" << r
          << "\", value)) first";
    }
}

TensorInfo tensor_info(const KernelProgram &program, const ProgramShapes &shapes, const std::string &name) {
  const TensorDecl &t = downloadable(program, name);
  TensorInfo i{t.dtype, shapes.shape(t), false, static_cast<size_t>(shapes.elements(t)) * dtype_bytes(t.dtype)};
  int64_t elements = 1;
  for (int64_t e : i.shape)
    elements *= e;
  // Routed rows in pair order (r = t * k + slot) are the user's layout too.
  i.contiguous = (t.layout == RowLayout::dense || t.layout == RowLayout::pair) && elements == shapes.elements(t);
  return i;
}

} // namespace moeforge
