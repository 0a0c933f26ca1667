// Python arguments checked where nanobind's own conversions would answer
// with a TypeError that names only the types ("Invoked with types: ...,
// int"): an integer past the C++ parameter's range, a name that cannot be
// printed or scheduled. Each is a UserError naming the call and the fix.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>

#include "dsl/error.h"

namespace moeforge::python {

// v (a Python int, or anything with __index__: numpy's integers) as an
// integer in [lo, hi].
inline int64_t checked_integer(nanobind::handle v, int64_t lo, int64_t hi, const std::string &call,
                               const std::string &arg) {
  PyObject *index = PyNumber_Index(v.ptr());
  if (!index)
    PyErr_Clear();
  user_check(index != nullptr && !PyBool_Check(v.ptr()))
      << call << ": " << arg << " must be an integer, got " << nanobind::str(nanobind::repr(v)).c_str();
  const std::string text = nanobind::str(nanobind::handle(index)).c_str();
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(index, &overflow);
  Py_DECREF(index);
  user_check(overflow <= 0 && (overflow < 0 || x <= hi))
      << call << ": " << arg << " " << text << " is beyond " << hi << ", the largest it takes";
  user_check(overflow == 0 && x >= lo) << call << ": " << arg << " " << text << " is below " << lo
                                       << ", the smallest it takes";
  return x;
}

// A name the user gives a Dim, Var, Input, Param or Func: printed in the
// algebra and matched by schedules and messages, so not empty, without
// quotes, whitespace or control bytes, and not the schedules' "*" (every Func).
inline void check_user_name(const std::string &name, const char *kind) {
  user_check(!name.empty()) << kind << "(''): a " << kind << " needs a name (letters, digits and _, as 'x' or 'w1')";
  user_check(name != "*") << kind << "('*'): '*' names every Func in a schedule (tile(\"*\", ...)); give the " << kind
                          << " a name of its own";
  for (char c : name) {
    const unsigned char b = static_cast<unsigned char>(c);
    user_check(b > ' ' && b != 0x7f && c != '"' && c != '\'' && c != '\\')
        << kind << " name " << nanobind::str(nanobind::repr(nanobind::str(name.c_str()))).c_str()
        << " holds a quote, a backslash, whitespace or a control byte, which the algebra's text and schedule files "
        << "cannot quote: use letters, digits and _";
  }
}

} // namespace moeforge::python
