#include "tools/cli_options.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "dsl/error.h"

namespace moeforge {

namespace {

// Whether text is digits only, after an optional sign: an integer however
// large, so that one too large is told so rather than "not an integer".
bool integer_text(const std::string &text) {
  const size_t start = !text.empty() && (text[0] == '-' || text[0] == '+') ? 1 : 0;
  return text.size() > start &&
         std::all_of(text.begin() + static_cast<long>(start), text.end(), [](char c) { return c >= '0' && c <= '9'; });
}

int64_t parse_int(const std::string &flag, const std::string &text) {
  user_check(integer_text(text)) << flag << " needs an integer, got '" << text << "'";
  char *end = nullptr;
  errno = 0;
  long long v = std::strtoll(text.c_str(), &end, 10);
  user_check(errno == 0) << flag << " " << text << " is beyond " << (text[0] == '-' ? "-" : "")
                         << "9223372036854775807, the largest integer it takes";
  return v;
}

// A seed: any of the 2^64 values of the generator's state.
uint64_t parse_seed(const std::string &flag, const std::string &text) {
  user_check(integer_text(text) && text[0] != '-' && text[0] != '+')
      << flag << " needs a whole number from 0 to 18446744073709551615, got '" << text << "'";
  char *end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  user_check(errno == 0) << flag << " " << text << " is beyond 18446744073709551615, the largest seed";
  return v;
}

} // namespace

Options parse_options(const std::vector<std::string> &args) {
  Options o;
  user_check(!args.empty()) << "no command given";
  o.command = args[0];
  user_check(o.command == "list" || o.command == "print" || o.command == "run" || o.command == "train" ||
             o.command == "emit" || o.command == "tune")
      << "unknown command '" << o.command << "': use list, print, run, train, emit or tune (or help)";
  size_t i = 1;
  if (o.command != "list") {
    user_check(args.size() > 1 && args[1].rfind("--", 0) != 0)
        << "'" << o.command << "' needs an example name (see 'moeforge list')";
    o.example = args[1];
    i = 2;
  }
  for (; i < args.size(); ++i) {
    const std::string &flag = args[i];
    if (flag == "--check" && (o.command == "run" || o.command == "train")) {
      o.check = true;
      continue;
    }
    if (flag == "--check=full" && o.command == "run") {
      o.check = o.check_full = true;
      continue;
    }
    if (flag == "--recompute" && o.command == "train") {
      o.recompute = true;
      continue;
    }
    if (flag == "--train" && (o.command == "emit" || o.command == "tune")) {
      o.emit_training = true;
      continue;
    }
    if (flag == "--aux" && o.command == "train") {
      o.aux = true;
      continue;
    }
    if ((flag == "--ir" || flag == "--passes" || flag == "--cuda" || flag == "--llvm" || flag == "--plan" ||
         flag == "--memory") &&
        o.command == "emit") {
      user_check(o.emit.empty())
          << "emit needs exactly one of --ir, --passes, --cuda, --llvm, --plan or --memory, got --" << o.emit << " and "
          << flag;
      o.emit = flag.substr(2);
      continue;
    }
    // list takes no flags; print takes the shape flags; run also --seed,
    // --precision, --backend and --schedule; train --seed, --backend and
    // --schedule, and --k for --topk; emit --schedule.
    bool runs = o.command == "run" || o.command == "train";
    bool takes_value =
        o.command != "list" && (flag == "--tokens" || flag == "--experts" || flag == "--topk" || flag == "--d" ||
                                flag == "--f" || (o.command == "train" && flag == "--k") ||
                                (runs && (flag == "--seed" || flag == "--backend" || flag == "--capacity")) ||
                                (runs && flag == "--ranks") || (o.command == "run" && flag == "--precision") ||
                                ((runs || o.command == "emit" || o.command == "tune") && flag == "--schedule") ||
                                (o.command == "tune" && (flag == "--budget-seconds" || flag == "--seed")));
    user_check(takes_value) << "unknown flag '" << flag << "' for '" << o.command << "'";
    user_check(i + 1 < args.size()) << flag << " needs a value";
    const std::string &v = args[++i];
    if (flag == "--schedule") {
      user_check(!v.empty()) << "--schedule needs a value: a preset (megablocks, scattermoe), a schedule "
                             << "file or auto, got an empty one";
      o.schedule = v;
    } else if (flag == "--backend" && o.command == "train") {
      user_check(v == "cpu" || v == "cuda")
          << "--backend of train must be cpu or cuda, got '" << v << "' (--check compares with the reference)";
      o.backend = v;
    } else if (flag == "--backend") {
      user_check(v == "reference" || v == "cpu" || v == "cuda")
          << "--backend must be reference, cpu or cuda, got '" << v << "'";
      o.backend = v;
    } else if (flag == "--precision") {
      user_check(v == "f32" || v == "f64") << "--precision must be f32 or f64, got '" << v << "'";
      o.precision = v == "f32" ? Precision::f32 : Precision::f64;
    } else if (flag == "--capacity") {
      char *end = nullptr;
      o.capacity = std::strtod(v.c_str(), &end);
      user_check(end && *end == '\0' && !v.empty() && !std::isnan(o.capacity))
          << "--capacity must be a positive number (the capacity factor: 1.0 lets each expert take its even share "
          << "T * k / E of the pairs, 1.25 a quarter more), got '" << v << "'";
      user_check(std::isfinite(o.capacity) && o.capacity <= 1024)
          << "--capacity " << v << " is beyond 1024, the largest capacity factor (an expert never takes more than "
          << "all T * k pairs; for no dropping, leave --capacity out)";
      user_check(o.capacity > 0) << "--capacity must be a positive number (the capacity factor: 1.0 lets each "
                                 << "expert take its even share T * k / E of the pairs, 1.25 a quarter more), got '"
                                 << v << "'";
    } else if (flag == "--ranks") {
      const int64_t n = parse_int(flag, v);
      user_check(n >= 1 && n <= 64) << "--ranks must be between 1 and 64 (GPUs of this machine), got " << n;
      o.ranks = static_cast<int>(n);
    } else if (flag == "--seed") {
      o.seed = parse_seed(flag, v);
    } else if (flag == "--budget-seconds") {
      o.budget_seconds = parse_int(flag, v);
      user_check(o.budget_seconds >= 1 && o.budget_seconds <= 86400)
          << "--budget-seconds must be between 1 and 86400, got " << o.budget_seconds;
    } else {
      int64_t n = parse_int(flag, v);
      (flag == "--tokens"                  ? o.shape.tokens
       : flag == "--experts"               ? o.shape.experts
       : flag == "--topk" || flag == "--k" ? o.shape.topk
       : flag == "--d"                     ? o.shape.d
                                           : o.shape.f) = n;
    }
  }
  if (o.schedule.empty()) // emit shows a schedule's program, and auto is resolved only where a layer runs
    o.schedule = o.command == "emit" ? "megablocks" : "auto";
  user_check(o.command != "emit" || !o.emit.empty())
      << "emit needs exactly one of --ir (the lowered kernel program), --passes (the program after each lowering "
      << "pass), --cuda (the generated CUDA source), --llvm (the CPU backend's optimised LLVM IR), --plan (each "
      << "GEMM's plan on the CUDA backend) or --memory (what the layer keeps and the workspace it takes)";
  user_check(o.command != "emit" || !o.emit_training || (o.emit != "llvm" && o.emit != "passes"))
      << "emit --train goes with --ir, --cuda, --plan or --memory (the training step's program, CUDA source, GEMM "
      << "plans or memory); "
      << "--passes shows the forward's passes";
  return o;
}

} // namespace moeforge
