#include "dsl/dtype.h"

#include "dsl/error.h"

namespace moeforge {

const char *dtype_name(DType t) {
  switch (t) {
  case DType::f32:
    return "f32";
  case DType::bf16:
    return "bf16";
  case DType::f16:
    return "f16";
  }
  return "?";
}

DType parse_dtype(const std::string &name) {
  if (name == "f32")
    return DType::f32;
  if (name == "bf16")
    return DType::bf16;
  if (name == "f16")
    return DType::f16;
  user_error << "unknown dtype '" << name << "': use f32, bf16 or f16";
}

DType promote(DType a, DType b) { return a == b ? a : DType::f32; }

int dtype_bytes(DType t) { return t == DType::f32 ? 4 : 2; }

} // namespace moeforge
