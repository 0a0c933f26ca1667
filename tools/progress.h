// Progress of the CLI's long work on stderr: "moeforge: compiling and
// running on cpu ... 1.8 s" per phase, so a run at a real size is not silent
// for a minute. On when stderr is a terminal; MOEFORGE_PROGRESS=1 turns it on
// elsewhere (logs, tests), MOEFORGE_PROGRESS=0 off. stdout, which scripts
// read, never gets it.
#pragma once

#include <chrono>
#include <ostream>
#include <string>

namespace moeforge {

class Progress {
public:
  Progress(std::ostream &err, bool on) : err_(err), on_(on) {}
  // A phase still open here was cut short (an error follows): its line ends
  // without a time.
  ~Progress() {
    if (open_)
      err_ << "\n" << std::flush;
  }
  Progress(const Progress &) = delete;
  Progress &operator=(const Progress &) = delete;

  // Whether progress goes to stderr in this process (the environment and
  // whether stderr is a terminal).
  static bool wanted();

  // Ends the phase under way (its time), and starts `what`.
  void phase(const std::string &what);
  // Ends the phase under way, if any, with its time.
  void finish();

private:
  std::ostream &err_;
  bool on_;
  bool open_ = false;
  std::chrono::steady_clock::time_point start_;
};

} // namespace moeforge
