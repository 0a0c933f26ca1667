#include "tools/cli.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <optional>

#include "backends/reference/evaluate.h"
#include "dsl/error.h"
#include "examples/examples.h"
#include "lowering/lower.h"
#include "schedules/presets.h"
#ifdef MOEFORGE_HAVE_CUDA
#include "tools/cli_gpu.h"
#endif

namespace moeforge {

namespace {

const char *kUsage =
    "usage: moeforge list\n"
    "       moeforge print <example> [--tokens N --experts E --topk K --d D --f F]\n"
    "       moeforge run <example> [--tokens N --experts E --topk K --d D --f F --seed S\n"
    "                               --precision f32|f64 --schedule megablocks|scattermoe|<file>\n"
    "                               --backend reference|cuda] [--check]\n"
    "       moeforge emit <example> [shape flags] [--schedule S] --ir | --cuda\n";

struct Options {
  std::string command, example;
  ExampleShape shape;
  uint64_t seed = 1;
  Precision precision = Precision::f32;
  bool check = false;
  std::string schedule = "megablocks";
  std::string backend; // empty: the GPU when there is one, else the reference
  bool emit_ir = false, emit_cuda = false;
};

int64_t parse_int(const std::string &flag, const std::string &text) {
  char *end = nullptr;
  errno = 0;
  long long v = std::strtoll(text.c_str(), &end, 10);
  user_check(!text.empty() && *end == '\0' && errno == 0)
      << flag << " needs an integer, got '" << text << "'";
  return v;
}

Options parse(const std::vector<std::string> &args) {
  Options o;
  user_check(!args.empty()) << "no command given";
  o.command = args[0];
  user_check(o.command == "list" || o.command == "print" || o.command == "run" || o.command == "emit")
      << "unknown command '" << o.command << "': use list, print, run or emit";
  size_t i = 1;
  if (o.command != "list") {
    user_check(args.size() > 1 && args[1].rfind("--", 0) != 0)
        << "'" << o.command << "' needs an example name (see 'moeforge list')";
    o.example = args[1];
    i = 2;
  }
  for (; i < args.size(); ++i) {
    const std::string &flag = args[i];
    if (flag == "--check" && o.command == "run") {
      o.check = true;
      continue;
    }
    if ((flag == "--ir" || flag == "--cuda") && o.command == "emit") {
      (flag == "--ir" ? o.emit_ir : o.emit_cuda) = true;
      continue;
    }
    // list takes no flags; print takes the shape flags; run also --seed and --precision.
    bool takes_value = o.command != "list" &&
                       (flag == "--tokens" || flag == "--experts" || flag == "--topk" || flag == "--d" ||
                        flag == "--f" || (o.command == "run" && (flag == "--seed" || flag == "--precision")) ||
                        (o.command == "run" && flag == "--backend") ||
                        ((o.command == "run" || o.command == "emit") && flag == "--schedule"));
    user_check(takes_value) << "unknown flag '" << flag << "' for '" << o.command << "'";
    user_check(i + 1 < args.size()) << flag << " needs a value";
    const std::string &v = args[++i];
    if (flag == "--schedule") {
      o.schedule = v;
    } else if (flag == "--backend") {
      user_check(v == "reference" || v == "cuda") << "--backend must be reference or cuda, got '" << v << "'";
      o.backend = v;
    } else if (flag == "--precision") {
      user_check(v == "f32" || v == "f64") << "--precision must be f32 or f64, got '" << v << "'";
      o.precision = v == "f32" ? Precision::f32 : Precision::f64;
    } else if (flag == "--seed") {
      o.seed = static_cast<uint64_t>(parse_int(flag, v));
    } else {
      int64_t n = parse_int(flag, v);
      (flag == "--tokens"    ? o.shape.tokens
       : flag == "--experts" ? o.shape.experts
       : flag == "--topk"    ? o.shape.topk
       : flag == "--d"       ? o.shape.d
                             : o.shape.f) = n;
    }
  }
  user_check(o.command != "emit" || o.emit_ir != o.emit_cuda)
      << "emit needs exactly one of --ir (the lowered kernel program) or --cuda (the generated CUDA source)";
  return o;
}

void print_routing(std::ostream &out, const std::string &name, const RoutingResult &r) {
  std::vector<int64_t> c = r.expert_counts();
  auto [mn, mx] = std::minmax_element(c.begin(), c.end());
  int64_t empty = std::count(c.begin(), c.end(), int64_t{0});
  out << "routing   " << name << ": " << r.token.size() << " pairs (" << r.tokens << " tokens x k=" << r.k
      << ") over " << r.experts << " experts; tokens per expert min " << *mn << " / mean " << std::fixed
      << std::setprecision(1) << double(r.token.size()) / double(r.experts) << " / max " << *mx
      << "; empty experts " << empty << std::defaultfloat << "\n";
}

// Whether this run goes to the GPU: asked for with --backend cuda (an error
// without one), or by default when this build has the CUDA backend and a GPU
// is present.
bool use_gpu(const Options &o, std::string *no_gpu) {
#ifdef MOEFORGE_HAVE_CUDA
  bool present = cli_gpu_available(no_gpu);
#else
  bool present = false;
  *no_gpu = "this build has no CUDA backend (the CUDA toolkit was not found when it was configured)";
#endif
  if (o.backend == "cuda") {
    user_check(present) << "--backend cuda: " << *no_gpu << "; use --backend reference";
  }
  return o.backend != "reference" && present;
}

int run(const Options &o, std::ostream &out) {
  Example ex = make_example(o.example, o.shape);
  // The schedule only matters on the GPU (the reference has none), where
  // compiling checks it against the layer.
  Schedule schedule = schedule_from_arg(o.schedule);
  std::string no_gpu;
  bool gpu = use_gpu(o, &no_gpu);
  TensorMap inputs = ex.random_inputs(o.shape, o.seed);
  const char *prec = o.precision == Precision::f32 ? "f32" : "f64";
  out << "example   " << ex.name << ": " << ex.description << "\n";
  out << "inputs   ";
  for (const BufferPtr &b : ex.pipeline.buffers()) {
    out << " " << b->name << "[";
    const HostTensor &t = inputs.at(b->name);
    for (size_t i = 0; i < t.shape.size(); ++i)
      out << (i ? "x" : "") << t.shape[i];
    out << "]";
  }
  out << "\n";
#ifdef MOEFORGE_HAVE_CUDA
  if (gpu)
    return cli_run_on_gpu(ex, o.shape, inputs, schedule, o.check, out);
#endif
  out << "backend   reference (Eigen, " << prec << ")" << (o.backend.empty() ? "; no GPU: " + no_gpu : "")
      << "\n";

  auto start = std::chrono::steady_clock::now();
  EvalResult res = evaluate(ex.pipeline, inputs, o.precision);
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  for (const auto &[name, r] : res.routes)
    print_routing(out, name, r);
  const HostTensor &y = res[ex.output];
  out << "time      " << std::fixed << std::setprecision(2) << ms << " ms\n" << std::defaultfloat;
  out << "checksum  " << ex.output << ": " << std::setprecision(9) << y.checksum() << std::setprecision(6) << "\n";
  if (!o.check)
    return 0;
  // The oracle: the same algebra in float64. On the reference backend,
  // --check measures the run's precision against it.
  EvalResult oracle = evaluate(ex.pipeline, inputs, Precision::f64);
  double err = max_relative_error(y, oracle[ex.output]);
  double tol = o.precision == Precision::f32 ? 1e-4 : 1e-12;
  bool ok = err <= tol;
  out << "check     " << ex.output << " vs reference f64: max relative error " << std::scientific
      << std::setprecision(2) << err << " (tolerance " << tol << "): " << (ok ? "PASS" : "FAIL") << "\n"
      << std::defaultfloat;
  return ok ? 0 : 1;
}

} // namespace

int run_cli(const std::vector<std::string> &args, std::ostream &out, std::ostream &err) {
  Options o;
  try {
    o = parse(args);
    if (o.command == "list") {
      for (const std::string &n : example_names())
        out << n << ": " << make_example(n, ExampleShape{}).description << "\n";
      return 0;
    }
    if (o.command == "print") {
      Example ex = make_example(o.example, o.shape);
      out << ex.pipeline;
      return 0;
    }
    if (o.command == "emit") {
      Example ex = make_example(o.example, o.shape);
      KernelProgram program = lower(ex.pipeline, schedule_from_arg(o.schedule));
      if (o.emit_ir) {
        out << program;
        return 0;
      }
#ifdef MOEFORGE_HAVE_CUDA
      out << cli_cuda_source(program);
      return 0;
#else
      user_error << "emit --cuda: this build has no CUDA backend (the CUDA toolkit was not found when it was "
                 << "configured); emit --ir works without it";
#endif
    }
    return run(o, out);
  } catch (const UserError &e) {
    err << "moeforge: " << e.what() << "\n" << kUsage;
    return 2;
  }
}

} // namespace moeforge
