// The message of the UserError a piece of code throws, for tests of what
// users are told.
#pragma once

#include <doctest/doctest.h>

#include <exception>
#include <functional>
#include <string>

#include "dsl/error.h"

namespace moeforge::testing {

// The message of the UserError that f throws; fails the test if it throws
// nothing or something else.
inline std::string user_error_of(const std::function<void()> &f) {
  try {
    f();
  } catch (const UserError &e) {
    return e.what();
  } catch (const std::exception &e) {
    FAIL("expected a UserError, got another exception: " << e.what());
    return "";
  }
  FAIL("expected a UserError, but nothing was thrown");
  return "";
}

} // namespace moeforge::testing
