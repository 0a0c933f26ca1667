#include "runtime/tensor.h"

#include <cmath>
#include <cstring>

#include "dsl/error.h"
#include "runtime/host_memory.h"
#include "runtime/parallel.h"

namespace moeforge {

static size_t element_count(const std::vector<int64_t> &shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    internal_check(s >= 0) << "negative extent";
    n *= s;
  }
  return static_cast<size_t>(n);
}

// The elements of `shape`, once the host has room for them as doubles.
static size_t checked_element_count(const std::vector<int64_t> &shape) {
  const size_t n = element_count(shape);
  check_host_array(shape, sizeof(double), "a host tensor", " (doubles)");
  return n;
}

HostTensor::HostTensor(std::vector<int64_t> shape_, double fill) : shape(std::move(shape_)) {
  data.assign(checked_element_count(shape), fill);
}

HostTensor HostTensor::uninitialized(std::vector<int64_t> shape_) {
  HostTensor t;
  t.shape = std::move(shape_);
  t.data.resize(checked_element_count(t.shape));
  return t;
}

static int64_t flat_index(const std::vector<int64_t> &shape, std::initializer_list<int64_t> index) {
  internal_check(index.size() == shape.size()) << "index rank " << index.size() << " for rank " << shape.size();
  int64_t off = 0, d = 0;
  for (int64_t i : index) {
    internal_check(i >= 0 && i < shape[d]) << "index " << i << " out of range " << shape[d];
    off = off * shape[d++] + i;
  }
  return off;
}

double &HostTensor::at(std::initializer_list<int64_t> index) { return data[flat_index(shape, index)]; }
double HostTensor::at(std::initializer_list<int64_t> index) const { return data[flat_index(shape, index)]; }

double HostTensor::checksum() const {
  double s = 0;
  for (size_t i = 0; i < data.size(); ++i)
    s += data[i] * (1.0 + static_cast<double>(i % 7) * 0.125);
  return s;
}

uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x))
    return static_cast<uint16_t>((u >> 16) | 0x40); // stay a (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);                  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}

float bf16_value(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

double round_to_bf16(double x) { return bf16_value(bf16_bits(static_cast<float>(x))); }

HostTensor random_tensor(std::vector<int64_t> shape, std::mt19937_64 &rng, double lo, double hi, bool bf16) {
  HostTensor t(std::move(shape));
  std::uniform_real_distribution<double> dist(lo, hi);
  for (double &v : t.data)
    v = bf16 ? round_to_bf16(dist(rng)) : dist(rng);
  return t;
}

namespace {
// SplitMix64's finaliser: consecutive inputs give unrelated 64-bit outputs.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
} // namespace

uint64_t random_stream(const std::string &name) {
  uint64_t h = 1469598103934665603ull; // FNV-1a
  for (unsigned char c : name)
    h = (h ^ c) * 1099511628211ull;
  return h;
}

uint64_t hashed_random_key(uint64_t seed, uint64_t stream) { return mix64(mix64(seed) ^ stream); }

double hashed_random_value(uint64_t key, int64_t i, double lo, double hi, bool bf16) {
  // The top 53 bits as a double in [0, 1).
  const double u = static_cast<double>(mix64(key + static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull) >> 11) * 0x1.0p-53;
  const double x = lo + (hi - lo) * u;
  return bf16 ? round_to_bf16(x) : x;
}

HostTensor hashed_random_tensor(std::vector<int64_t> shape, uint64_t seed, uint64_t stream, double lo, double hi,
                                bool bf16) {
  HostTensor t = HostTensor::uninitialized(std::move(shape)); // the threads below write every element
  const uint64_t key = hashed_random_key(seed, stream);
  double *v = t.data.data();
  parallel_chunks(t.size(), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      v[i] = hashed_random_value(key, i, lo, hi, bf16);
  });
  return t;
}

double max_abs_difference(const HostTensor &a, const HostTensor &b) {
  internal_check(a.shape == b.shape) << "comparing tensors of different shapes";
  double worst = 0;
  for (size_t i = 0; i < a.data.size(); ++i) {
    double d = std::fabs(a.data[i] - b.data[i]);
    if (std::isnan(d))
      return INFINITY;
    worst = std::max(worst, d);
  }
  return worst;
}

double max_normalized_error(const HostTensor &a, const HostTensor &b) {
  double scale = 1e-30;
  for (double v : b.data)
    scale = std::max(scale, std::fabs(v));
  return max_abs_difference(a, b) / scale;
}

double max_relative_error(const HostTensor &a, const HostTensor &b, double floor) {
  internal_check(a.shape == b.shape) << "comparing tensors of different shapes";
  double worst = 0;
  for (size_t i = 0; i < a.data.size(); ++i) {
    double d = std::fabs(a.data[i] - b.data[i]) / std::max(std::fabs(b.data[i]), floor);
    if (std::isnan(d))
      return INFINITY;
    worst = std::max(worst, d);
  }
  return worst;
}

std::string shape_text(const std::vector<int64_t> &shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i)
    out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + (shape.size() == 1 ? ",)" : ")");
}

} // namespace moeforge
