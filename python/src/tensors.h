// Arrays in and out of the Python package. Anything that speaks DLPack or the
// buffer protocol (numpy arrays, torch tensors on the CPU) comes in as an
// nb::ndarray and is read, whatever its strides, into a HostTensor (the
// layers' host-side currency: row-major float64); results go out as numpy
// float64 arrays that own their HostTensor's storage (no second copy).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/layer_checks.h"
#include "runtime/size_terms.h"
#include "runtime/tensor.h"

namespace moeforge::python {

namespace nb = nanobind;

// Any dtype, device, shape and strides: checked here, with messages that name
// the tensor, rather than by nanobind's generic overload failure.
using AnyArray = nb::ndarray<nb::ro>;
using NumpyArray = nb::ndarray<nb::numpy, double>;

// `what` names the array in errors ("input 'x'"). UserError for an array
// that is not in host memory or not of a floating-point (or integer) dtype.
HostTensor to_host_tensor(const AnyArray &array, const std::string &what);

// Moves the tensor's storage into a numpy array.
NumpyArray to_numpy(HostTensor tensor);

// Integer tables (routing choices) as an int32 numpy array.
nb::ndarray<nb::numpy, int32_t> to_numpy(std::vector<int32_t> values);

// Any Python value as a HostTensor: an array of a dtype no layer reads, or
// no array at all, is a UserError naming `what` and the dtype or type
// (the bindings take nb::handle for arrays, so that nanobind's generic
// "incompatible function arguments" never answers instead).
HostTensor to_host_tensor(nb::handle value, const std::string &what);

// A tensor as a layer stores it (runtime/layer_checks.h), as Python sees
// it: (dtype name, shape, contiguous, bytes).
nb::tuple info_tuple(const TensorInfo &info);

// Sizes over the token count (runtime/size_terms.h; a layer's saved parts)
// as Python evaluates them at a symbolic count: None where there are none,
// else a list, for each size, of its terms
// (align, [(bytes, [(a, b, d, m, c), ...]), ...]).
nb::object size_terms_object(const std::optional<std::vector<SizeTerms>> &parts);

// A dict {name: array} as a TensorMap ("input 'name'" in errors).
TensorMap to_tensor_map(const nb::dict &arrays, const std::string &what);

// A TensorMap as a dict {name: numpy array}.
nb::dict to_dict(TensorMap tensors);

} // namespace moeforge::python
