// Errors. A UserError is the user's mistake: its message says what is wrong,
// where (in the user's own names) and how to fix it. An InternalError is ours.
// Messages are built only when the check fails:
//     user_check(a.rank() == 2) << "'" << a.name() << "' must be a matrix";
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace moeforge {

class UserError : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

class InternalError : public std::logic_error {
public:
  using std::logic_error::logic_error;
};

namespace detail {
// Collects a message with operator<< and throws it when the statement ends.
template <typename Error> class ErrorBuilder {
public:
  explicit ErrorBuilder(const char *prefix) { msg_ << prefix; }
  ErrorBuilder(const ErrorBuilder &) = delete;
  template <typename T> ErrorBuilder &operator<<(const T &v) {
    msg_ << v;
    return *this;
  }
  [[noreturn]] ~ErrorBuilder() noexcept(false) { throw Error(msg_.str()); }

private:
  std::ostringstream msg_;
};
} // namespace detail

} // namespace moeforge

#define user_check(cond)                                                                                               \
  if (cond) {                                                                                                          \
  } else                                                                                                               \
    ::moeforge::detail::ErrorBuilder<::moeforge::UserError>("")

#define user_error ::moeforge::detail::ErrorBuilder<::moeforge::UserError>("")

#define internal_check(cond)                                                                                           \
  if (cond) {                                                                                                          \
  } else                                                                                                               \
    ::moeforge::detail::ErrorBuilder<::moeforge::InternalError>("internal error (" __FILE__ "): " #cond ": ")
