#include "tools/progress.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>

namespace moeforge {

bool Progress::wanted() {
  if (const char *v = std::getenv("MOEFORGE_PROGRESS"); v && *v)
    return std::strcmp(v, "0") != 0;
  return isatty(fileno(stderr)) != 0;
}

void Progress::phase(const std::string &what) {
  finish();
  if (!on_)
    return;
  err_ << "moeforge: " << what << " ..." << std::flush;
  open_ = true;
  start_ = std::chrono::steady_clock::now();
}

void Progress::finish() {
  if (!open_)
    return;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  err_ << " " << std::fixed << std::setprecision(1) << s << " s\n" << std::defaultfloat << std::flush;
  open_ = false;
}

} // namespace moeforge
