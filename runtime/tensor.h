// Host tensors: how values enter and leave the backends. Dense, row-major,
// double storage (any f32/bf16/f16 value is exact in a double); backends cast
// to their working precision.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace moeforge {

// std::allocator, except that resize() leaves new doubles uninitialised
// rather than zeroing them: a real-size layer's weights are tens of
// gigabytes, and one thread zeroing them before many threads fill them
// costs more than the filling. Every other way of sizing still zeroes.
template <typename T> struct DefaultInitAllocator : std::allocator<T> {
  template <typename U> struct rebind { using other = DefaultInitAllocator<U>; };
  using std::allocator<T>::allocator;
  template <typename U> void construct(U *p) { ::new (static_cast<void *>(p)) U; }
  template <typename U, typename... Args> void construct(U *p, Args &&...args) {
    ::new (static_cast<void *>(p)) U(std::forward<Args>(args)...);
  }
};
using HostValues = std::vector<double, DefaultInitAllocator<double>>;

struct HostTensor {
  std::vector<int64_t> shape;
  HostValues data;

  HostTensor() = default;
  explicit HostTensor(std::vector<int64_t> shape_, double fill = 0.0);
  // Of that shape with its values left unset, for a caller that writes
  // every element (on many threads: no serial pass over the memory first).
  static HostTensor uninitialized(std::vector<int64_t> shape_);
  int64_t size() const { return static_cast<int64_t>(data.size()); }
  int64_t rank() const { return static_cast<int64_t>(shape.size()); }
  // Row-major element access, for tests and small loops.
  double &at(std::initializer_list<int64_t> index);
  double at(std::initializer_list<int64_t> index) const;
  // A sum that any change to any element moves (weights by position).
  double checksum() const;
};

using TensorMap = std::map<std::string, HostTensor>;

// Uniform random values in [lo, hi), rounded to bfloat16 when `bf16` so that
// the same values are exact on every backend.
HostTensor random_tensor(std::vector<int64_t> shape, std::mt19937_64 &rng, double lo = -1.0, double hi = 1.0,
                         bool bf16 = true);

// The same, but element i's value is a hash of (seed, stream, i) rather than
// the i-th draw of a sequential generator: filled on every core (a
// real-size layer's weights are billions of values), identical for any
// thread count, and each tensor's values independent of the others' sizes.
// `stream` tells tensors of one seed apart (random_stream of the name).
HostTensor hashed_random_tensor(std::vector<int64_t> shape, uint64_t seed, uint64_t stream, double lo = -1.0,
                                double hi = 1.0, bool bf16 = true);
// A stream number for hashed_random_tensor from a tensor's name.
uint64_t random_stream(const std::string &name);

// A shape as Python writes it, for messages: "(8, 64)", "(8,)", "()".
std::string shape_text(const std::vector<int64_t> &shape);
// Element i of hashed_random_tensor(shape, seed, stream, lo, hi, bf16), for
// a caller that stores the values some other way (the CLI's GPU run writes
// them straight into the device's bf16 bytes): key = hashed_random_key.
uint64_t hashed_random_key(uint64_t seed, uint64_t stream);
double hashed_random_value(uint64_t key, int64_t i, double lo, double hi, bool bf16);

// bfloat16 storage, as the GPU converts: round to nearest, ties to even (a
// NaN stays a quiet NaN). bf16_bits gives the 16 stored bits, bf16_value
// reads them back, round_to_bf16 does both.
uint16_t bf16_bits(float x);
float bf16_value(uint16_t bits);
double round_to_bf16(double x);

// max |a - b| over all elements; infinite where a or b holds a NaN.
double max_abs_difference(const HostTensor &a, const HostTensor &b);

// max |a - b| / max |b|: the error of a backend with bf16 storage and fp32
// accumulation against reference b, relative to b's scale (small entries
// carry absolute error). A NaN in a (an element nothing wrote) is infinite.
double max_normalized_error(const HostTensor &a, const HostTensor &b);

// Largest |a - b| / max(|b|, floor) over all elements: the relative error of a
// against reference b, with `floor` keeping near-zero entries from dominating.
double max_relative_error(const HostTensor &a, const HostTensor &b, double floor = 1e-3);

} // namespace moeforge
