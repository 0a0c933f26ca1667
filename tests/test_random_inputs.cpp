// The examples' random inputs: element i of a tensor is a hash of (seed,
// tensor name, i), made on every core (hashed_random_tensor), and the same
// values straight in a backend's storage bytes (encode_hashed_random, what
// the CLI's GPU runs upload) without the doubles.
#include <doctest/doctest.h>

#include <cmath>
#include <set>

#include "examples/examples.h"
#include "runtime/program_shapes.h"
#include "runtime/tensor.h"

using namespace moeforge;

TEST_CASE("random inputs: each element is its own hash, so any split over threads gives the same values") {
  // Large enough to be split over threads where there is more than one core.
  const int64_t n = (int64_t(1) << 21) + 77;
  HostTensor t = hashed_random_tensor({n}, 9, random_stream("w1"), -0.5, 0.5, /*bf16=*/true);
  const uint64_t key = hashed_random_key(9, random_stream("w1"));
  bool all_equal = true, in_range = true, bf16_exact = true;
  for (int64_t i = 0; i < n; ++i) {
    const double v = t.data[static_cast<size_t>(i)];
    all_equal &= v == hashed_random_value(key, i, -0.5, 0.5, true);
    in_range &= v >= -0.5 && v <= 0.5; // rounding to bf16 may reach the bound
    bf16_exact &= v == round_to_bf16(v);
  }
  CHECK(all_equal);
  CHECK(in_range);
  CHECK(bf16_exact);
  // Not a constant or a short cycle: many distinct values, mean near 0.
  std::set<double> distinct(t.data.begin(), t.data.begin() + 4096);
  CHECK(distinct.size() > 200); // bf16 has 256 values per binade
  double mean = 0;
  for (double v : t.data)
    mean += v / static_cast<double>(n);
  CHECK(std::fabs(mean) < 0.01);
}

TEST_CASE("random inputs: the seed and the tensor's name decide the values; a tensor's size does not") {
  ExampleShape s{64, 8, 2, 32, 48};
  Example ex = make_example("swiglu_moe", s);
  TensorMap a = ex.random_inputs(s, 1), b = ex.random_inputs(s, 1), c = ex.random_inputs(s, 2);
  for (const auto &[name, t] : a) {
    INFO(name);
    CHECK(t.data == b.at(name).data);
    CHECK(t.data != c.at(name).data);
  }
  CHECK(a.at("w1").data != a.at("w3").data); // same shape, different names
  // More tokens: x's first rows stay what they were, and the weights too.
  ExampleShape more = s;
  more.tokens = 100;
  TensorMap m = ex.random_inputs(more, 1);
  CHECK(std::equal(a.at("x").data.begin(), a.at("x").data.end(), m.at("x").data.begin()));
  CHECK(m.at("w2").data == a.at("w2").data);
}

TEST_CASE("random inputs: made as storage bytes they equal the doubles encoded") {
  for (DType storage : {DType::bf16, DType::f32})
    for (bool bf16 : {true, false}) {
      INFO(dtype_name(storage) << (bf16 ? " from bf16-exact values" : " from doubles"));
      const int64_t n = 300001;
      HostTensor t = hashed_random_tensor({n}, 4, random_stream("wr"), -2, 3, bf16);
      CHECK(encode_hashed_random(n, 4, random_stream("wr"), -2, 3, bf16, storage) == encode_values(t.data, storage));
    }
}
