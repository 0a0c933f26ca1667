#include "runtime/program_shapes.h"

#include <cstring>

#include "dsl/error.h"
#include "runtime/parallel.h"

namespace moeforge {

namespace {
void encode_one(double v, DType t, uint8_t *out) {
  float f = static_cast<float>(v);
  if (t == DType::f32) {
    std::memcpy(out, &f, 4);
  } else {
    uint16_t b = bf16_bits(f);
    std::memcpy(out, &b, 2);
  }
}
} // namespace

std::vector<uint8_t> encode_values(const HostValues &values, DType t) {
  internal_check(t != DType::f16) << "f16 storage";
  const int bytes = dtype_bytes(t);
  std::vector<uint8_t> out(values.size() * bytes);
  parallel_chunks(static_cast<int64_t>(values.size()), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      encode_one(values[i], t, &out[i * bytes]);
  });
  return out;
}

std::vector<uint8_t> encode_hashed_random(int64_t elements, uint64_t seed, uint64_t stream, double lo, double hi,
                                          bool bf16, DType t) {
  internal_check(t != DType::f16) << "f16 storage";
  const int bytes = dtype_bytes(t);
  std::vector<uint8_t> out(static_cast<size_t>(elements) * bytes);
  const uint64_t key = hashed_random_key(seed, stream);
  parallel_chunks(elements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      encode_one(hashed_random_value(key, i, lo, hi, bf16), t, &out[i * bytes]);
  });
  return out;
}

ProgramShapes::ProgramShapes(const KernelProgram &program, int64_t tokens) : tokens_(tokens) {
  user_check(tokens >= 1) << "a layer needs at least one token (got " << tokens << ")";
  for (const TensorDecl &t : program.tensors) {
    user_check(t.dtype != DType::f16) << "tensor '" << t.name << "' is f16, which no backend stores yet: use bf16";
    for (const Dim &d : t.dims)
      for (const DimNode *n = d.get(); n; n = n->base.get())
        if (!n->base && n->extent < 0)
          dynamic_[n->name] = tokens;
  }
  for (const Step &s : program.steps)
    if (auto *rs = std::get_if<RoutingStep>(&s)) {
      RoutingShape shape;
      shape.tokens = extent(rs->route->token_dim());
      shape.experts = static_cast<int>(rs->route->expert_dim().extent());
      shape.k = rs->route->k;
      shape.block = rs->block;
      shape.groups = rs->route->groups;
      shape.top_groups = rs->route->top_groups;
      if (rs->drops()) {
        shape.priority = rs->priority;
        shape.capacity = expert_capacity(rs->capacity_factor, shape.tokens, shape.k, shape.experts, rs->priority);
      }
      shape.check();
      routings_[rs->route] = shape;
      if (shape.drops())
        dynamic_[max_padded_rows_extent(rs->route)] = shape.max_padded_rows();
    }
}

int64_t ProgramShapes::extent(const Dim &d) const {
  const DimNode *n = d.get();
  int64_t factor = 1;
  for (; n->base; n = n->base.get())
    factor *= n->factor;
  return factor * (n->extent >= 0 ? n->extent : dynamic_.at(n->name));
}

std::vector<int64_t> ProgramShapes::shape(const TensorDecl &t) const {
  std::vector<int64_t> s;
  for (const Dim &d : t.dims)
    s.push_back(extent(d));
  return s;
}

int64_t ProgramShapes::elements(const TensorDecl &t) const {
  std::vector<int64_t> s = shape(t);
  if (t.layout == RowLayout::padded)
    s.at(0) = routing(t.route).max_padded_rows();
  if (t.layout == RowLayout::padded_t)
    s.back() = routing(t.route).max_padded_rows();
  if (t.stride8 && !s.empty())
    s.back() = (s.back() + 7) / 8 * 8;
  int64_t n = 1;
  for (size_t i = t.outer_stride > 0 ? 1 : 0; i < s.size(); ++i)
    n *= s[i];
  if (t.outer_stride > 0) // up to the last index's elements: the rest of the larger tensor is not this one's
    n += (s[0] - 1) * t.outer_stride;
  return std::max<int64_t>(n, 1);
}

std::optional<SizeProduct> ProgramShapes::bytes_over_tokens(const TensorDecl &t) const {
  if (t.outer_stride > 0)
    return std::nullopt;
  SizeProduct p{dtype_bytes(t.dtype), {}};
  const size_t n = t.dims.size();
  for (size_t i = 0; i < n; ++i) {
    SizeFactor f;
    if ((t.layout == RowLayout::padded && i == 0) || (t.layout == RowLayout::padded_t && i + 1 == n)) {
      const RoutingShape &r = routing(t.route);
      if (r.drops())
        return std::nullopt;
      f = SizeFactor::padded_rows(r.k, r.block, r.experts);
    } else {
      const DimNode *node = t.dims[i].get();
      int64_t factor = 1;
      for (; node->base; node = node->base.get())
        factor *= node->factor;
      if (node->extent >= 0) {
        f = SizeFactor::constant(factor * node->extent);
      } else {
        for (const auto &[r, shape] : routings_) // a dropping route's row bound is not the token count
          if (shape.drops() && node->name == max_padded_rows_extent(r))
            return std::nullopt;
        f = SizeFactor::tokens(factor);
      }
    }
    if (t.stride8 && i + 1 == n) { // the last extent rounded up to 8, as elements() does
      if (f.a == 0)
        f = SizeFactor::constant((f.c + 7) / 8 * 8);
      else if (f.b == 0 && f.d == 1 && f.m == 1 && f.c == 0)
        f = {f.a, 7, 8, 8, 0};
      else if (f.m % 8 != 0 || f.c % 8 != 0) // padded rows: whole blocks
        return std::nullopt;
    }
    if (f.a == 0)
      p.bytes *= f.c;
    else
      p.factors.push_back(f);
  }
  if (p.bytes == 0) // elements() counts at least one
    return std::nullopt;
  return p;
}

long long *ProgramShapes::dynamic_extent(const std::string &dim) { return &dynamic_.at(dim); }

std::vector<uint8_t> ProgramShapes::encode_input(const TensorDecl &t, const TensorMap &inputs) const {
  auto it = inputs.find(t.name);
  user_check(it != inputs.end()) << "no tensor given for input '" << t.name << "'";
  const HostTensor &h = it->second;
  std::string dims;
  for (const Dim &d : t.dims)
    dims += (dims.empty() ? "" : ", ") + d.name();
  user_check(h.shape == shape(t)) << "input '" << t.name << "' has shape " << shape_text(h.shape) << ", and at "
                                  << tokens_ << " tokens the layer takes " << shape_text(shape(t)) << " (" << dims
                                  << "): give it that shape, or make the layer for the token count it has";
  std::vector<uint8_t> dense = encode_values(h.data, t.dtype);
  if (t.outer_stride == 0)
    return dense;
  // Each index of the first dim at its stride; the bytes between stay zero.
  const size_t bytes = static_cast<size_t>(dtype_bytes(t.dtype)), row = dense.size() / h.shape.at(0);
  std::vector<uint8_t> out(static_cast<size_t>(elements(t)) * bytes, 0);
  for (int64_t i = 0; i < h.shape[0]; ++i)
    std::memcpy(&out[static_cast<size_t>(i * t.outer_stride) * bytes], &dense[i * row], row);
  return out;
}

HostTensor ProgramShapes::decode(const TensorDecl &t, const std::vector<uint8_t> &bytes,
                                 const std::vector<int32_t> *pair_rows) const {
  HostTensor out = HostTensor::uninitialized(shape(t)); // every element written below
  int64_t row = 1;
  for (size_t i = 1; i < out.shape.size(); ++i)
    row *= out.shape[i];
  auto value = [&](int64_t i) -> double {
    if (t.dtype == DType::f32) {
      float f;
      std::memcpy(&f, &bytes[i * 4], 4);
      return f;
    }
    uint16_t b;
    std::memcpy(&b, &bytes[i * 2], 2);
    return bf16_value(b);
  };
  // Routed rows stored grouped by expert (padded or sorted) come back in
  // pair order.
  const bool padded = t.layout == RowLayout::padded || t.layout == RowLayout::sorted;
  internal_check(!padded || pair_rows) << "decoding '" << t.name << "' needs the row each of its pairs is stored at";
  internal_check(t.layout != RowLayout::padded_t) << "'" << t.name << "' is a transposed internal copy";
  const int64_t stride = t.outer_stride > 0 ? t.outer_stride : row; // where each row is stored
  parallel_chunks(
      out.shape.empty() ? 1 : out.shape[0],
      [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          int64_t from = padded ? (*pair_rows)[r] : r;
          for (int64_t i = 0; i < row; ++i)
            out.data[r * row + i] = value(from * stride + i);
        }
      },
      std::max<int64_t>(1, (int64_t(1) << 20) / std::max<int64_t>(row, 1)));
  return out;
}

std::vector<uint8_t> ProgramShapes::drop_row_padding(const TensorDecl &t, std::vector<uint8_t> bytes) const {
  if (!t.stride8 || t.dims.empty())
    return bytes;
  std::vector<int64_t> s = shape(t);
  if (t.layout == RowLayout::padded)
    s.at(0) = routing(t.route).max_padded_rows();
  const int64_t len = s.back(), stride = (len + 7) / 8 * 8, size = dtype_bytes(t.dtype);
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < s.size(); ++i)
    rows *= s[i];
  internal_check(static_cast<int64_t>(bytes.size()) >= rows * stride * size)
      << "'" << t.name << "': " << bytes.size() << " bytes for " << rows << " rows of stride " << stride;
  for (int64_t r = 0; r < rows; ++r) // in place, front to back: row r moves to or before where it was
    std::memmove(&bytes[r * len * size], &bytes[r * stride * size], len * size);
  bytes.resize(rows * len * size);
  return bytes;
}

int64_t saved_bytes(const TrainingProgram &t, int64_t tokens) {
  ProgramShapes shapes(t.program, tokens);
  int64_t bytes = 0;
  for (const std::string &n : t.saved) {
    const TensorDecl &d = t.program.tensor(n);
    bytes += shapes.elements(d) * dtype_bytes(d.dtype);
  }
  for (const auto &[route, shape] : shapes.routings())
    bytes += 4 * (2 * shape.pairs() + shape.max_padded_rows());
  return bytes;
}

} // namespace moeforge
