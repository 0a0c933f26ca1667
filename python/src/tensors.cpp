#include "tensors.h"

#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <vector>

#include "dsl/error.h"

namespace moeforge::python {

namespace {

// DLPack's type codes (dlpack.h's DLDataTypeCode).
enum : uint8_t { dl_int = 0, dl_uint = 1, dl_float = 2, dl_bfloat = 4, dl_complex = 5, dl_bool = 6 };

std::string dtype_text(nb::dlpack::dtype t) {
  const char *code = t.code == dl_int       ? "int"
                     : t.code == dl_uint    ? "uint"
                     : t.code == dl_float   ? "float"
                     : t.code == dl_bfloat  ? "bfloat"
                     : t.code == dl_complex ? "complex"
                     : t.code == dl_bool    ? "bool"
                                            : "code";
  std::ostringstream s;
  s << code << int(t.bits);
  if (t.lanes != 1)
    s << "x" << int(t.lanes);
  return s.str();
}

const char *device_text(int32_t type) {
  switch (type) {
  case nb::device::cuda::value:
    return "cuda";
  case nb::device::cuda_host::value:
    return "cuda_host";
  case nb::device::cuda_managed::value:
    return "cuda_managed";
  case nb::device::rocm::value:
    return "rocm";
  case nb::device::metal::value:
    return "metal";
  default:
    return "a non-host device";
  }
}

double half_value(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  double v;
  if (exponent == 0)
    v = std::ldexp(double(mantissa), -24);
  else if (exponent == 31)
    v = mantissa ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else
    v = std::ldexp(double(mantissa | 0x400), int(exponent) - 25);
  return sign ? -v : v;
}

// One element at byte address p, as a double.
double read_element(const uint8_t *p, nb::dlpack::dtype t) {
  switch (t.code) {
  case dl_float:
    if (t.bits == 64) {
      double v;
      std::memcpy(&v, p, 8);
      return v;
    }
    if (t.bits == 32) {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
    uint16_t h;
    std::memcpy(&h, p, 2);
    return half_value(h);
  case dl_bfloat: {
    uint16_t b;
    std::memcpy(&b, p, 2);
    return bf16_value(b);
  }
  case dl_int:
    if (t.bits == 64) {
      int64_t v;
      std::memcpy(&v, p, 8);
      return double(v);
    }
    int32_t v;
    std::memcpy(&v, p, 4);
    return double(v);
  }
  throw InternalError("read_element: unchecked dtype");
}

bool supported(nb::dlpack::dtype t) {
  if (t.lanes != 1)
    return false;
  return (t.code == dl_float && (t.bits == 16 || t.bits == 32 || t.bits == 64)) ||
         (t.code == dl_bfloat && t.bits == 16) || (t.code == dl_int && (t.bits == 32 || t.bits == 64));
}

} // namespace

HostTensor to_host_tensor(const AnyArray &array, const std::string &what) {
  if (array.device_type() != nb::device::cpu::value)
    throw UserError(what + " is in " + device_text(array.device_type()) +
                    " memory; this layer reads host memory: pass a CPU array (tensor.cpu(), or numpy)");
  const nb::dlpack::dtype t = array.dtype();
  if (!supported(t))
    throw UserError(what + " has dtype " + dtype_text(t) +
                    "; give float64, float32, float16, bfloat16, int32 or int64 values");
  std::vector<int64_t> shape(array.ndim());
  for (size_t d = 0; d < array.ndim(); ++d)
    shape[d] = static_cast<int64_t>(array.shape(d));
  HostTensor out(shape);
  if (out.size() == 0)
    return out;
  // Strides in elements (DLPack's convention; negative ones allowed): walk the
  // index odometer so that any view reads the same values as a copy.
  const uint8_t *base = static_cast<const uint8_t *>(array.data());
  const size_t bytes = t.bits / 8, rank = array.ndim();
  std::vector<int64_t> index(rank, 0);
  for (int64_t n = 0; n < out.size(); ++n) {
    int64_t offset = 0;
    for (size_t d = 0; d < rank; ++d)
      offset += index[d] * array.stride(d);
    out.data[n] = read_element(base + offset * static_cast<int64_t>(bytes), t);
    for (size_t d = rank; d-- > 0;) {
      if (++index[d] < shape[d])
        break;
      index[d] = 0;
    }
  }
  return out;
}

NumpyArray to_numpy(HostTensor tensor) {
  auto *storage = new HostValues(std::move(tensor.data));
  nb::capsule owner(storage, [](void *p) noexcept { delete static_cast<HostValues *>(p); });
  std::vector<size_t> shape(tensor.shape.begin(), tensor.shape.end());
  return NumpyArray(storage->data(), shape.size(), shape.data(), owner);
}

nb::ndarray<nb::numpy, int32_t> to_numpy(std::vector<int32_t> values) {
  auto *storage = new std::vector<int32_t>(std::move(values));
  nb::capsule owner(storage, [](void *p) noexcept { delete static_cast<std::vector<int32_t> *>(p); });
  const size_t shape[1] = {storage->size()};
  return nb::ndarray<nb::numpy, int32_t>(storage->data(), 1, shape, owner);
}

TensorMap to_tensor_map(const nb::dict &arrays, const std::string &what) {
  TensorMap out;
  for (auto [key, value] : arrays) {
    if (!nb::isinstance<nb::str>(key))
      throw UserError(what + " names must be strings, got " + nb::cast<std::string>(nb::str(key.type())));
    const std::string name = nb::cast<std::string>(key);
    out[name] = to_host_tensor(nb::handle(value), what + " '" + name + "'");
  }
  return out;
}

HostTensor to_host_tensor(nb::handle value, const std::string &what) {
  AnyArray array;
  if (!nb::try_cast(value, array)) {
    // An array of a dtype no layer reads (object, str, longdouble, a
    // record) is an array all the same: say which dtype, not "not an array".
    if (nb::hasattr(value, "dtype") && nb::hasattr(value, "shape"))
      throw UserError(what + " has dtype " + nb::cast<std::string>(nb::str(nb::object(value.attr("dtype")))) +
                      "; give float64, float32, float16, bfloat16, int32 or int64 values (numpy: "
                      "astype(np.float32))");
    throw UserError(what + " is a " + nb::cast<std::string>(nb::str(value.type())) +
                    ", not an array: give a numpy array or a tensor (anything with __dlpack__)");
  }
  return to_host_tensor(array, what);
}

nb::dict to_dict(TensorMap tensors) {
  nb::dict out;
  for (auto &[name, tensor] : tensors)
    out[nb::str(name.c_str())] = to_numpy(std::move(tensor));
  return out;
}

nb::object size_terms_object(const std::optional<std::vector<SizeTerms>> &parts) {
  if (!parts)
    return nb::none();
  nb::list out;
  for (const SizeTerms &terms : *parts) {
    nb::list part;
    for (const SizeTerm &t : terms) {
      nb::list sum;
      for (const SizeProduct &p : t.sum) {
        nb::list factors;
        for (const SizeFactor &f : p.factors)
          factors.append(nb::make_tuple(f.a, f.b, f.d, f.m, f.c));
        sum.append(nb::make_tuple(p.bytes, factors));
      }
      part.append(nb::make_tuple(t.align, sum));
    }
    out.append(part);
  }
  return out;
}

nb::tuple info_tuple(const TensorInfo &info) {
  return nb::make_tuple(std::string(dtype_name(info.dtype)), nb::tuple(nb::cast(info.shape)), info.contiguous,
                        info.bytes);
}

} // namespace moeforge::python
