// Element types of tensors. Storage types only: every backend accumulates
// contractions in at least fp32.
#pragma once

#include <string>

namespace moeforge {

enum class DType { f32, bf16, f16 };

const char *dtype_name(DType t);
// Parses "f32", "bf16" or "f16"; throws UserError naming the choices otherwise.
DType parse_dtype(const std::string &name);
// The type of a binary op's result: equal types stay, mixed ones widen to f32.
DType promote(DType a, DType b);
// Bytes per element in storage.
int dtype_bytes(DType t);

} // namespace moeforge
