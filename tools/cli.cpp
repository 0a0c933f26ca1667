#include "tools/cli.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "backends/reference/evaluate.h"
#include "dsl/error.h"
#include "dsl/training.h"
#include "examples/aux_loss_example.h"
#include "examples/examples.h"
#include "examples/skewed_routing.h"
#include "lowering/choices_without_effect.h"
#include "lowering/default_schedule.h"
#include "lowering/gemm_plan.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "runtime/memory_report.h"
#include "runtime/program_shapes.h"
#include "runtime/routing_host.h"
#include "schedules/presets.h"
#include "tools/cli_backend.h"
#include "tools/cli_help.h"
#include "tools/cli_options.h"
#include "tools/progress.h"
#include "tools/sampled_check.h"

namespace moeforge {

namespace {

const char *kUsage =
    "usage: moeforge list\n"
    "       moeforge print <example> [--tokens N --experts E --topk K --d D --f F]\n"
    "       moeforge run <example> [--tokens N --experts E --topk K --d D --f F --seed S\n"
    "                               --precision f32|f64 --schedule megablocks|scattermoe|default|auto|<file>\n"
    "                               --capacity F --backend reference|cpu|cuda --ranks N] [--check | --check=full]\n"
    "       moeforge train <example> [shape flags] [--seed S] [--schedule megablocks|scattermoe|default|auto|<file>]\n"
    "                                 [--capacity F] [--recompute] [--aux] [--backend cpu|cuda] [--ranks N] [--check]\n"
    "       moeforge emit <example> [shape flags] [--schedule S] --ir | --passes | --cuda | --llvm | --plan | "
    "--memory\n"
    "                               [--train]\n"
    "       moeforge tune <example> [shape flags] [--schedule S] [--train] [--budget-seconds N] [--seed S]\n";

// The project's version (CMakeLists.txt), as the installed package reports it.
const char *kVersion = MOEFORGE_VERSION;

// What the flags default to (Options and ExampleShape below), for --help.
const char *kDefaults = "\n"
                        "defaults: --tokens 256 --experts 8 --topk 2 --d 64 --f 128 --seed 1 --precision f32\n"
                        "          --schedule auto (run, train, tune: what `moeforge tune` cached for the layer\n"
                        "          on this GPU, else the default schedule; the output says which),\n"
                        "          megablocks (emit)\n"
                        "          --backend: the GPU when there is one, else the CPU backend, else (run\n"
                        "          only) the reference\n"
                        "moeforge help | --help | -h: this text; moeforge <command> --help (or\n"
                        "moeforge help <command>): a command's flags, defaults and examples;\n"
                        "moeforge --version: the version and what it was built with\n";

// Tokens `run --check` compares with the float64 reference (a random
// sample, where the layer allows; all of them with --check=full).
constexpr int64_t kCheckSample = 64;

void print_routing(std::ostream &out, const std::string &name, const RoutingResult &r) {
  std::vector<int64_t> c = r.expert_counts();
  auto [mn, mx] = std::minmax_element(c.begin(), c.end());
  int64_t empty = std::count(c.begin(), c.end(), int64_t{0});
  const int64_t kept = static_cast<int64_t>(r.token.size()) - r.dropped();
  out << "routing   " << name << ": " << r.token.size() << " pairs (" << r.tokens << " tokens x k=" << r.k << ") over "
      << r.experts << " experts; tokens per expert min " << *mn << " / mean " << std::fixed << std::setprecision(1)
      << double(kept) / double(r.experts) << " / max " << *mx << "; empty experts " << empty << std::defaultfloat;
  if (!r.kept.empty())
    out << "; dropped at capacity " << r.dropped() << " pairs (" << std::fixed << std::setprecision(1)
        << 100.0 * double(r.dropped()) / double(r.token.size()) << " %)" << std::defaultfloat;
  out << "\n";
}

constexpr bool kHaveCuda =
#ifdef MOEFORGE_HAVE_CUDA
    true;
#else
    false;
#endif
constexpr bool kHaveCpu =
#ifdef MOEFORGE_HAVE_CPU_BACKEND
    true;
#else
    false;
#endif

bool gpu_present(std::string *why) {
#ifdef MOEFORGE_HAVE_CUDA
  return cli_gpu_available(why);
#else
  *why = "this build has no CUDA backend (the CUDA toolkit was not found when it was configured)";
  return false;
#endif
}

// The backend a run goes to: --backend, or by default the GPU when this build
// has the CUDA backend and a GPU is present, else the LLVM CPU backend when
// built, else the reference. Asking for one that is missing is a usage error.
// A layer without routing takes a schedule's tiles only: naming the
// schedule alone ('megablocks') would suggest a permutation that never ran.
std::string tiles_only(const Example &ex) { return ex.route.empty() ? " (tiles only: no routing)" : ""; }

std::string choose_backend(const Options &o, std::string *why_not_gpu, bool &working) {
  bool gpu = gpu_present(why_not_gpu);
  bool train = o.command == "train"; // the reference has no training runtime of its own
  // f64 is the reference's precision; the compiled backends compute in f32
  // (and bf16 on tensor cores): asked for alone it picks the reference.
  user_check(o.precision == Precision::f32 || o.backend.empty() || o.backend == "reference")
      << "--precision f64: the " << o.backend << " backend computes in f32; only the "
      << "reference evaluates in f64: drop --precision f64, or use --backend reference";
  // A backend this machine or build lacks is not a mistake in the command
  // line: said without the usage.
  const bool before = working;
  working = true;
  if (o.backend == "cuda") {
    user_check(gpu) << "--backend cuda: " << *why_not_gpu << "; use --backend cpu" << (train ? "" : " or reference");
  }
  if (o.backend == "cpu") {
    user_check(kHaveCpu) << "--backend cpu: this build has no CPU backend (LLVM 19 was not found when it was "
                         << "configured: install llvm-19-dev)" << (train ? "" : "; use --backend reference");
  }
  working = before;
  if (o.precision == Precision::f64)
    return "reference";
  if (!o.backend.empty())
    return o.backend;
  working = true;
  user_check(!train || gpu || kHaveCpu) << "train needs a compiled backend: " << *why_not_gpu
                                        << ", and this build has no CPU backend (install llvm-19-dev)";
  working = before;
  return gpu ? "cuda" : (kHaveCpu ? "cpu" : "reference");
}

// --experts beyond what a compiled backend routes: refused before any input
// is made (the layer's inputs grow with E, and the routing would refuse it
// only once they exist).
void check_expert_count(const Options &o, const Example &ex, const std::string &backend) {
  if (ex.route.empty() || backend == "reference")
    return;
  user_check(o.shape.experts <= kMaxRoutingExperts)
      << "--experts " << o.shape.experts << ": the " << backend << " backend routes 1 to " << kMaxRoutingExperts
      << " experts" << (o.command == "run" ? "; --backend reference takes any count" : "; lower --experts");
}

void print_time_and_checksum(std::ostream &out, double ms, const std::string &func, const HostTensor &y) {
  out << "time      " << std::fixed << std::setprecision(3) << ms << " ms\n" << std::defaultfloat;
  out << "checksum  " << func << ": " << std::setprecision(9) << y.checksum() << std::setprecision(6) << "\n";
}

// A compiled backend against the float64 reference: every Func it
// materialises, relative to the reference's largest value (bf16 storage).
// t (Func `name`'s values, pair order for a routed Func) with the rows of
// the pairs its route dropped at capacity zeroed: the reference computes
// them, a layer leaves them in a row nothing reads.
HostTensor without_dropped(const Pipeline &p, const EvalResult &ref, const std::string &name, HostTensor t) {
  const auto &args = p.func(name).args();
  for (const RoutingPtr &r : p.routes()) {
    auto rr = ref.routes.find(r->name);
    if (args.empty() || !args[0].dim().same_as(r->pairs) || rr == ref.routes.end() || rr->second.kept.empty())
      continue;
    const std::vector<uint8_t> &kept = rr->second.kept;
    const size_t row = t.data.size() / kept.size();
    for (size_t q = 0; q < kept.size(); ++q)
      if (!kept[q])
        std::fill_n(t.data.begin() + static_cast<int64_t>(q * row), row, 0.0);
  }
  return t;
}

bool check_backend(std::ostream &out, const BackendRun &run, const EvalResult &ref, const Pipeline &p) {
  bool ok = true;
  for (const auto &[name, want] : ref.values) {
    auto got = run.values.find(name);
    if (got == run.values.end())
      continue; // not materialised under this schedule (e.g. o when the gate is fused)
    double err = max_normalized_error(without_dropped(p, ref, name, got->second), without_dropped(p, ref, name, want));
    bool pass = err <= 1e-2;
    ok &= pass;
    out << "check     " << std::setw(16) << std::left << name << std::right
        << " max |ours - ref| / max |ref| = " << std::scientific << std::setprecision(2) << err
        << " (tolerance 1e-2): " << (pass ? "PASS" : "FAIL") << "\n"
        << std::defaultfloat;
  }
  return ok;
}

void print_shape(std::ostream &out, const std::string &name, const HostTensor &t) {
  out << " " << name << "[";
  for (size_t i = 0; i < t.shape.size(); ++i)
    out << (i ? "x" : "") << t.shape[i];
  out << "]";
}

std::string mib(int64_t bytes) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(bytes < (10 << 20) ? 3 : 1) << double(bytes) / double(1 << 20);
  return s.str();
}

// The upstream gradient d(loss)/d(output): U(-1, 1), bf16-exact (so the
// backend and the reference see the same values), shaped like the output.
HostTensor random_upstream_gradient(const Func &output, int64_t tokens, uint64_t seed) {
  std::vector<int64_t> shape;
  for (const Var &v : output.args())
    shape.push_back(v.dim().is_dynamic() ? tokens : v.dim().extent());
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull); // apart from the inputs' stream
  return random_tensor(shape, rng, -1.0, 1.0, /*bf16=*/true);
}

// The host memory the inputs alone take (8-byte values, as HostTensor holds
// them), against the machine's: a shape past it ends here with what to
// change, not in std::bad_alloc or the kernel's OOM killer.
// as_doubles: the inputs are made on the host as 8-byte values; else (a GPU
// run without --check) straight in their storage types.
void check_host_memory(const Example &ex, const ExampleShape &shape, bool as_doubles = true) {
  double bytes = 0;
  for (const BufferPtr &b : ex.pipeline.buffers()) {
    double n = as_doubles ? 8 : dtype_bytes(b->dtype);
    for (int64_t e : ex.input_shape(*b, shape)) // in doubles: a hostile shape's product must not wrap
      n *= static_cast<double>(e);
    bytes += n;
  }
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page <= 0)
    return; // unknown: nothing to compare with
  const double have = static_cast<double>(pages) * static_cast<double>(page), gib = double(1 << 30);
  user_check(bytes < 0.5 * have) << ex.name << ": the inputs alone need " << std::fixed << std::setprecision(1)
                                 << bytes / gib << " GiB of host memory ("
                                 << (as_doubles ? "8-byte values" : "in their storage types")
                                 << "), more than half of this "
                                 << "machine's " << have / gib << " GiB: lower --tokens, --d, --f or --experts";
}

// --schedule's preset or file. A file that is there but holds no valid
// schedule is the file's error, not the command line's: its message comes
// without the usage (`working` is set while it loads).
Schedule schedule_arg(const std::string &arg, bool &working) {
  const std::vector<std::string> presets = preset_names();
  std::error_code ec;
  // A path that is there (a directory, /dev/null) is the file's error too.
  if (std::find(presets.begin(), presets.end(), arg) != presets.end())
    return schedule_from_arg(arg);
  std::string names;
  for (const std::string &n : presets)
    names += (names.empty() ? "" : ", ") + n;
  user_check(std::filesystem::exists(arg, ec))
      << "schedule '" << arg << "' is neither a preset (" << names << "), default, auto (run, train, "
      << "tune) nor an existing schedule file: name one of those or the path of a schedule file (a schedule's "
      << "text, as its save() writes it)";
  const bool before = working;
  working = true;
  Schedule s = schedule_from_arg(arg);
  working = before;
  return s;
}

// The outputs a layer's schedule is made for: its output when it trains
// (default_schedule then makes the backward's choices), none for a forward.
std::vector<Func> schedule_outputs(const Example &ex, bool training) {
  return training ? std::vector<Func>{ex.pipeline.func(ex.output)} : std::vector<Func>{};
}

// The schedule a run or a training step uses: --schedule's preset or file,
// or for `auto` what `moeforge tune` cached for this layer, token count and
// GPU, else the default schedule (lowering/default_schedule.h: the fastest
// hand-written training schedule's choices, made for this layer); `note`
// says which and why.
Schedule base_schedule(const Options &o, const Example &ex, const std::string &backend, bool training,
                       std::string *note, bool &working) {
  const std::vector<Func> outputs = schedule_outputs(ex, training);
  if (o.schedule == "default") {
    *note = "the default schedule (--schedule default: the tuned-schedule cache is not looked in)";
    return default_schedule(ex.pipeline, outputs);
  }
  if (o.schedule != "auto")
    return schedule_arg(o.schedule, working);
#ifdef MOEFORGE_HAVE_CUDA
  if (backend == "cuda") {
    std::string where;
    if (std::optional<Schedule> s = cli_cached_schedule_on_gpu(ex, o.shape, training, &where)) {
      *note = "auto: tuned for this layer and token count (" + where + ")";
      return *s;
    }
    *note = "auto: the default schedule, nothing tuned for this layer and token count here (" + where +
            "); `moeforge tune " + ex.name + (training ? " --train" : "") + "` finds a faster one and caches it";
    return default_schedule(ex.pipeline, outputs);
  }
#endif
  *note = "auto: the default schedule on the " + backend + " backend (schedules are tuned on a GPU)";
  return default_schedule(ex.pipeline, outputs);
}

// The schedule to run: --schedule's, with --capacity's expert capacity.
Schedule resolve_schedule(const Options &o, const Example &ex, const std::string &backend, bool training,
                          std::string *note, bool &working) {
  Schedule s = base_schedule(o, ex, backend, training, note, working);
  if (o.capacity > 0)
    s.capacity(o.capacity);
  return s;
}

// The choices `schedule` made that the layer's program does not take
// (lowering/choices_without_effect.h), one "note" line each: the same on the
// CPU and the CUDA backend, which lower the same program. Where the experts
// spread over ranks each side has its own program; the lines are the
// unsplit layer's.
void print_not_applied(std::ostream &out, const std::string &backend, const TrainingTask *task, const Example &ex,
                       const Schedule &schedule) {
  if (backend == "reference")
    return; // it runs the algebra, not the schedule
  for (const std::string &n : choices_not_taken(ex.pipeline, schedule, task ? task->outputs : std::vector<Func>{}))
    out << "note      " << n << "\n";
}

// The reference's routing options for a layer run under `schedule`.
EvalOptions reference_options(const Schedule &schedule) {
  EvalOptions e;
  e.capacity_factor = schedule.capacity();
  return e;
}

// The example's training step: its output with a random upstream gradient
// and, with --aux, its auxiliary losses (examples/aux_loss_example.h), each
// with upstream gradient 1 (the loss is added to the training loss as is).
TrainingTask training_task(const Options &o) {
  auto make = [&]() -> TrainingTask {
    if (o.aux) {
      AuxLossLayer a = make_aux_loss_example(o.example, o.shape);
      return {a.example, a.output_funcs(), {}};
    }
    Example ex = make_example(o.example, o.shape);
    return {ex, {ex.pipeline.func(ex.output)}, {}};
  };
  TrainingTask task = make();
  // Before the upstream gradients, which are as large as the output.
  check_host_memory(task.example, o.shape);
  task.upstream[task.outputs[0].name()] = random_upstream_gradient(task.outputs[0], o.shape.tokens, o.seed);
  for (size_t k = 1; k < task.outputs.size(); ++k) {
    std::vector<int64_t> shape;
    for (const Var &v : task.outputs[k].args())
      shape.push_back(v.dim().is_dynamic() ? o.shape.tokens : v.dim().extent());
    task.upstream[task.outputs[k].name()] = HostTensor(shape, 1.0);
  }
  return task;
}

// The float64 reference again with every input moved by one bf16 rounding
// (a relative 2^-8, of random sign) and the first run's experts given, so
// that no near-tie of two scores turns the other way: how far each value
// moves when its inputs are known to bf16's precision only.
EvalResult reference_moved_by_bf16(const Pipeline &p, TensorMap inputs, const EvalResult &ref, EvalOptions options) {
  std::mt19937 rng(7);
  for (auto &[name, t] : inputs)
    for (double &v : t.data)
      v *= 1.0 + ((rng() & 1u) ? 0x1p-8 : -0x1p-8);
  for (const auto &[name, route] : ref.routes)
    options.given[name] = route.expert;
  return evaluate(p, inputs, Precision::f64, options);
}

// Every output (y, and the losses with --aux) and every gradient against the
// float64 reference of the training algebra.
// A gradient that is zero in exact arithmetic (the router's, when renormalised
// gates make y independent of it) holds rounding noise on both sides, so each
// error is relative to at least 1e-3 x the largest value of y and the
// gradients, as the tests' compare_with_reference does.
// A value that is a difference of nearly equal terms (the router's gradient
// with a token or two: the gates' gradients of two experts that score
// alike) moves by more than 2e-2 of itself when its inputs move by one bf16
// rounding, so bf16 storage cannot hold it closer. Such a value passes when
// it is within what that move does to the reference (computed only for a
// value past 2e-2), and the line says so.
bool check_training(std::ostream &out, const BackendTraining &run, const TrainingTask &task, TensorMap inputs,
                    const Schedule &schedule) {
  const TrainingProgram &t = run.training;
  TrainingAlgebra algebra = training_algebra(task.example.pipeline, task.outputs);
  for (size_t k = 0; k < t.seeds.size(); ++k)
    inputs[t.seeds[k]] = task.upstream.at(t.outputs[k]);
  EvalResult ref = evaluate(algebra.pipeline, inputs, Precision::f64, reference_options(schedule));
  std::vector<std::string> names = t.outputs;
  names.insert(names.end(), t.gradients.begin(), t.gradients.end());
  double floor = 0;
  for (const std::string &n : names)
    for (double v : ref[n].data)
      floor = std::max(floor, 1e-3 * std::fabs(v));
  bool ok = true;
  std::optional<EvalResult> moved;
  for (const std::string &n : names) {
    const HostTensor &want = ref[n], &got = run.values.at(n);
    internal_check(got.shape == want.shape) << "'" << n << "' has the wrong shape";
    double scale = 0;
    for (double v : want.data)
      scale = std::max(scale, std::fabs(v));
    const double denominator = std::max({scale, floor, 1e-30}), err = max_abs_difference(got, want) / denominator;
    double tolerance = 2e-2;
    if (err > tolerance && std::isfinite(err)) {
      if (!moved)
        moved = reference_moved_by_bf16(algebra.pipeline, inputs, ref, reference_options(schedule));
      tolerance = std::max(tolerance, max_abs_difference((*moved)[n], want) / denominator);
    }
    const bool pass = err <= tolerance;
    ok &= pass;
    out << "check     " << std::setw(16) << std::left << n << std::right
        << (scale < floor ? " max |ours - ref| / floor        = " : " max |ours - ref| / max |ref| = ")
        << std::scientific << std::setprecision(2) << err;
    if (tolerance > 2e-2)
      out << " (tolerance " << tolerance << ", what one bf16 rounding of every input moves the reference by)";
    else
      out << " (tolerance 2e-2)";
    out << ": " << (pass ? "PASS" : "FAIL")
        << (scale < floor ? "; ~0 in exact arithmetic, floor = 1e-3 x the largest value of y and the gradients" : "")
        << "\n"
        << std::defaultfloat;
  }
  return ok;
}

// The autotuner on the GPU: times the search space's candidates around the
// schedule given (tune_space.h) and stores the winner in the tuned-schedule
// cache; prints it as a schedule file. Progress (a line per candidate) goes
// to stderr.
int tune(const Options &o, std::ostream &out, std::ostream &err, bool &working) {
  TrainingTask task = training_task(o);
  const Example &ex = task.example;
  const bool resolved = o.schedule == "auto" || o.schedule == "default";
  Schedule base = resolved ? Schedule() : schedule_arg(o.schedule, working);
  working = true; // the arguments hold together: from here on, errors are the machine's or the layer's
  std::string no_gpu;
  user_check(gpu_present(&no_gpu)) << "tune times candidate schedules on the GPU, and there is none: " << no_gpu;
  if (resolved) { // go on from what an earlier tune cached (auto), or from the default
    std::string auto_note;
    base = resolve_schedule(o, ex, "cuda", o.emit_training, &auto_note, working);
    err << "tune: base schedule " << auto_note << "\n";
  }
#ifdef MOEFORGE_HAVE_CUDA
  // Each candidate timed under uniform routing and under skewed routing
  // (the busiest expert at 2.5x the mean, design.md's range), so that the
  // schedule chosen holds up when the load is uneven.
  const TensorMap inputs = ex.random_inputs(o.shape, o.seed);
  std::string why;
  std::optional<SkewedInputs> skewed = skewed_router_inputs(inputs, o.shape.topk, 2.5, &why);
  if (skewed)
    err << "tune: each candidate timed under uniform routing and skewed routing (a router bias ramp of " << skewed->ramp
        << ": the busiest expert " << skewed->max_over_mean << "x the mean), the sum compared\n";
  else
    err << "tune: uniform routing only (" << why << ")\n";
  TuneOutcome t = cli_tune_on_gpu(ex, o.shape, inputs, skewed ? skewed->inputs : TensorMap{}, o.emit_training,
                                  task.upstream.at(ex.output), base, static_cast<double>(o.budget_seconds),
                                  [&](const std::string &line) { err << "tune: " << line << "\n"
                                                                     << std::flush; });
  out << "# moeforge tune " << ex.name << (o.emit_training ? " --train" : "") << " on " << t.device << ": base ('"
      << base.name() << "') " << t.base_ms << " ms, best " << t.best_ms << " ms"
      << (skewed ? " (uniform + skewed routing)" : "") << " (" << t.timed << " timed, " << t.pruned << " pruned, "
      << t.failed << " failed, " << t.left << " past the budget)\n";
  out << "# cached as " << (t.cached.empty() ? std::string("(not written: no cache directory)") : t.cached) << "\n";
  out << t.best_text;
#else
  (void)err;
  (void)task;
  (void)base;
#endif
  return 0;
}

// The GPUs the experts spread over: --ranks, else the schedule file's
// expert_parallel (recorded in `schedule`); 1 for one GPU. More than one
// needs the CUDA backend.
int spread_experts(const Options &o, const std::string &backend, const std::string &no_gpu, Schedule &schedule) {
  if (o.ranks > 1)
    schedule.expert_parallel(o.ranks);
  const int ranks = schedule.expert_parallel_ranks();
  // Named as the user gave it: the flag, or the schedule's primitive.
  const std::string asked = o.ranks > 1 ? "--ranks " + std::to_string(ranks)
                                        : "the schedule's expert_parallel(" + std::to_string(ranks) + ")";
  user_check(ranks == 1 || backend == "cuda")
      << asked << " spreads the experts over GPUs: it needs the CUDA backend"
      << (no_gpu.empty() ? "" : " (" + no_gpu + ")")
      << (o.ranks > 1 ? "" : "; to run on the " + backend + " backend, drop expert_parallel from the schedule file");
  return ranks;
}

// A training step's losses and checksums, and with --check its comparison
// with the reference.
int finish_training(const Options &o, std::ostream &out, Progress &progress, const BackendTraining &run,
                    const TrainingTask &task, const TensorMap &inputs, const Schedule &schedule) {
  const TrainingProgram &t = run.training;
  out << std::setprecision(9);
  for (size_t k = 1; k < t.outputs.size(); ++k) // the losses' values
    if (const HostTensor &l = run.values.at(t.outputs[k]); l.size() == 1)
      out << "loss      " << t.outputs[k] << " = " << l.data[0] << "\n";
  for (const std::string &n : t.outputs)
    out << "checksum  " << n << ": " << run.values.at(n).checksum() << "\n";
  for (const std::string &g : t.gradients)
    out << "checksum  " << g << ": " << run.values.at(g).checksum() << "\n";
  out << std::setprecision(6);
  if (!o.check)
    return 0;
  progress.phase("checking against the float64 reference");
  const bool ok = check_training(out, run, task, inputs, schedule);
  progress.finish();
  return ok ? 0 : 1;
}

// One training step: forward, then backward, on a compiled backend.
int train(const Options &o, std::ostream &out, Progress &progress, bool &working) {
  TrainingTask task = training_task(o);
  const Example &ex = task.example;
  std::string no_gpu;
  std::string backend = choose_backend(o, &no_gpu, working);
  check_expert_count(o, ex, backend);
  std::string auto_note;
  Schedule schedule = resolve_schedule(o, ex, backend, /*training=*/true, &auto_note, working);
  if (o.recompute)
    schedule.recompute(true);
  working = o.backend.empty() || o.backend == "cuda" || o.ranks <= 1; // as in run
  const int ranks = spread_experts(o, backend, no_gpu, schedule);
  working = true; // the arguments hold together: from here on, errors are the layer's
  progress.phase("generating the inputs");
  TensorMap inputs = ex.random_inputs(o.shape, o.seed);
  std::vector<std::string> rank_lines;
  BackendTraining run;
  if (ranks > 1) {
#if MOEFORGE_HAVE_NCCL
    progress.phase("compiling and training one step on " + std::to_string(ranks) + " GPUs");
    run = cli_train_on_gpus(task, o.shape, inputs, schedule, &rank_lines);
#else
    user_error << "--ranks: this build has no NCCL (nccl.h was not in the CUDA toolkit when it was configured)";
#endif
  } else {
    progress.phase("compiling and training one step on " + backend);
    run = train_on_backend(backend, task, o.shape, inputs, schedule);
  }
  progress.finish();
  const TrainingProgram &t = run.training;

  out << "example   " << ex.name << ": " << ex.description << "\n";
  out << "inputs   ";
  for (const BufferPtr &b : ex.pipeline.buffers())
    print_shape(out, b->name, inputs.at(b->name));
  out << "; upstream gradient" << (t.seeds.size() > 1 ? "s" : "");
  for (size_t k = 0; k < t.seeds.size(); ++k) {
    const HostTensor &u = task.upstream.at(t.outputs[k]);
    print_shape(out, t.seeds[k], u);
    if (k > 0 && u.size() == 1)
      out << " = " << u.data[0];
  }
  out << "\n";
  out << "backend   " << run.backend << ", schedule '" << schedule.name() << "'" << tiles_only(ex)
      << (o.recompute ? " with recompute" : "") << (backend == "cpu" && o.backend.empty() ? "; no GPU: " + no_gpu : "")
      << "\n";
  if (!auto_note.empty())
    out << "schedule  " << auto_note << "\n";
  print_not_applied(out, backend, &task, ex, schedule);
  for (const auto &[name, r] : run.routes)
    print_routing(out, name, r);
  out << "forward   " << std::fixed << std::setprecision(3) << run.forward_ms << " ms\n";
  out << "backward  " << run.backward_ms << " ms\n" << std::defaultfloat;
  for (const std::string &line : rank_lines)
    out << line << "\n";
  if (ranks > 1) // each rank keeps its own activations: no one layer's
    return finish_training(o, out, progress, run, task, inputs, schedule);
  // The activation memory: what the forward keeps for the backward.
  ProgramShapes shapes(t.program, o.shape.tokens);
  int64_t tables = run.saved_bytes;
  std::string parts;
  for (const std::string &n : t.saved) {
    const TensorDecl &d = t.program.tensor(n);
    int64_t bytes = shapes.elements(d) * dtype_bytes(d.dtype);
    tables -= bytes;
    parts += (parts.empty() ? " " : ", ") + n + " " + mib(bytes);
  }
  if (tables > 0)
    parts += (parts.empty() ? " " : ", ") + std::string("routing tables ") + mib(tables);
  out << "saved     " << mib(run.saved_bytes) << " MiB kept for the backward:" << parts << " (MiB)\n";
  if (!t.recomputed.empty()) {
    out << "recompute";
    for (const std::string &n : t.recomputed)
      out << " " << n;
    out << " (made again by the backward)\n";
  }
  return finish_training(o, out, progress, run, task, inputs, schedule);
}

int run(const Options &o, std::ostream &out, Progress &progress, bool &working) {
  Example ex = make_example(o.example, o.shape);
  std::string no_gpu;
  std::string backend = choose_backend(o, &no_gpu, working);
  check_expert_count(o, ex, backend);
  // The schedule only matters to the compiled backends, whose compilers check
  // it against the layer.
  std::string auto_note;
  Schedule schedule = resolve_schedule(o, ex, backend, /*training=*/false, &auto_note, working);
  // --ranks beside a backend named that is not CUDA: the command line's
  // conflict, with the usage; GPUs this machine lacks, or a schedule file's
  // expert_parallel: not the flags' mistake, no usage.
  working = o.backend.empty() || o.backend == "cuda" || o.ranks <= 1;
  const int ranks = spread_experts(o, backend, no_gpu, schedule);
  working = true; // the arguments hold together: memory this machine lacks is not their mistake
  // A GPU run without --check never needs the inputs on the host: the
  // backend makes the same values straight in its storage type (one GPU's).
  const bool host_inputs = backend != "cuda" || o.check || ranks > 1;
  check_host_memory(ex, o.shape, /*as_doubles=*/host_inputs);
  TensorMap inputs;
  if (host_inputs) {
    progress.phase("generating the inputs");
    inputs = ex.random_inputs(o.shape, o.seed);
    progress.finish();
  }
  const char *prec = o.precision == Precision::f32 ? "f32" : "f64";
  out << "example   " << ex.name << ": " << ex.description << "\n";
  out << "inputs   ";
  for (const BufferPtr &b : ex.pipeline.buffers()) {
    out << " " << b->name << "[";
    const std::vector<int64_t> shape = ex.input_shape(*b, o.shape);
    for (size_t i = 0; i < shape.size(); ++i)
      out << (i ? "x" : "") << shape[i];
    out << "]";
  }
  out << "\n";

  if (backend != "reference") {
    progress.phase(std::string(host_inputs ? "" : "generating the inputs, ") + "compiling and running on " + backend);
    std::vector<std::string> rank_lines;
    BackendRun run;
    if (ranks > 1) {
#if MOEFORGE_HAVE_NCCL
      run = cli_run_on_gpus(ex, o.shape, inputs, schedule, &rank_lines);
#else
      user_error << "--ranks: this build has no NCCL (nccl.h was not in the CUDA toolkit when it was configured)";
#endif
    } else {
      run = run_on_backend(backend, ex, o.shape, host_inputs ? &inputs : nullptr, o.seed, schedule,
                           /*every_func=*/o.check);
    }
    progress.finish();
    out << "backend   " << run.backend << ", schedule '" << schedule.name() << "'" << tiles_only(ex)
        << (backend == "cpu" && o.backend.empty() ? "; no GPU: " + no_gpu : "") << "\n";
    if (!auto_note.empty())
      out << "schedule  " << auto_note << "\n";
    print_not_applied(out, backend, nullptr, ex, schedule);
    for (const auto &[name, r] : run.routes)
      print_routing(out, name, r);
    print_time_and_checksum(out, run.ms, ex.output, run.values.at(ex.output));
    for (const std::string &line : rank_lines)
      out << line << "\n";
    if (!o.check)
      return 0;
    // The reference on a sample of the tokens where the layer allows it: its
    // cost then does not grow with T.
    const std::string blocker = schedule.capacity() > 0
                                    ? "the schedule's capacity drops pairs by their place among every token's"
                                    : token_sampling_blocker(ex.pipeline);
    if (!o.check_full && blocker.empty() && o.shape.tokens > kCheckSample) {
      // The whole inputs are not needed after this: their weights move into
      // the sample rather than being copied (gigabytes at real sizes).
      TokenSample sample = sample_tokens(ex.pipeline, std::move(inputs), o.shape.tokens, kCheckSample, o.seed);
      progress.phase("evaluating the float64 reference on " + std::to_string(kCheckSample) + " tokens");
      // One group of tokens per core, as far as there are tokens.
      EvalResult ref = evaluate_sample(ex.pipeline, sample, static_cast<int>(std::thread::hardware_concurrency()));
      progress.finish();
      out << "check     " << kCheckSample << " of " << o.shape.tokens
          << " tokens, drawn at random, with their routing (--check=full: every token)\n";
      for (auto &[name, values] : run.values) // in place: the layer's values are not needed whole again
        if (ref.values.count(name))
          values = sample_rows(ex.pipeline, name, values, sample);
      return check_backend(out, run, ref, ex.pipeline) ? 0 : 1;
    }
    if (!o.check_full && !blocker.empty() && o.shape.tokens > kCheckSample)
      out << "check     every token: " << blocker << ", so a sample of tokens is not the layer's answer for them\n";
    progress.phase("evaluating the float64 reference");
    EvalResult ref = evaluate(ex.pipeline, inputs, Precision::f64, reference_options(schedule));
    progress.finish();
    return check_backend(out, run, ref, ex.pipeline) ? 0 : 1;
  }

  // The reference runs the algebra alone, but a schedule naming a Func the
  // layer lacks is wrong whichever backend runs it.
  schedule.check_names(ex.pipeline);
  out << "backend   reference (Eigen, " << prec << ")" << (o.backend.empty() ? "; no GPU: " + no_gpu : "") << "\n";
  progress.phase(std::string("evaluating the reference (") + prec + ")");
  auto start = std::chrono::steady_clock::now();
  EvalResult res = evaluate(ex.pipeline, inputs, o.precision, reference_options(schedule));
  progress.finish();
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  for (const auto &[name, r] : res.routes)
    print_routing(out, name, r);
  const HostTensor &y = res[ex.output];
  print_time_and_checksum(out, ms, ex.output, y);
  if (!o.check)
    return 0;
  // The oracle: the same algebra in float64. On the reference backend,
  // --check measures the run's precision against it.
  progress.phase("evaluating the float64 reference");
  EvalResult oracle = evaluate(ex.pipeline, inputs, Precision::f64, reference_options(schedule));
  progress.finish();
  double err = max_relative_error(y, oracle[ex.output]);
  double tol = o.precision == Precision::f32 ? 1e-4 : 1e-12;
  bool ok = err <= tol;
  out << "check     " << ex.output << " vs reference f64: max relative error " << std::scientific
      << std::setprecision(2) << err << " (tolerance " << tol << "): " << (ok ? "PASS" : "FAIL") << "\n"
      << std::defaultfloat;
  return ok ? 0 : 1;
}

} // namespace

RoutingResult routing_from_experts(const RoutingNode &route, int64_t tokens, std::vector<int32_t> experts,
                                   std::vector<uint8_t> kept) {
  RoutingResult r;
  if (std::find(kept.begin(), kept.end(), uint8_t{0}) != kept.end())
    r.kept = std::move(kept);
  r.tokens = tokens;
  r.experts = route.expert_dim().extent();
  r.k = route.k;
  for (size_t p = 0; p < experts.size(); ++p)
    r.token.push_back(static_cast<int32_t>(p / static_cast<size_t>(route.k)));
  r.expert = std::move(experts);
  return r;
}

namespace {

// Whether everything written to `out` reached it (flushed: a full disk or a
// closed pipe shows only then); says so on `err` otherwise, since an exit 0
// would tell a script its output is complete.
bool wrote(std::ostream &out, std::ostream &err) {
  out.flush();
  if (out)
    return true;
  err << "moeforge: writing the output failed (its disk is full, or the pipe or file was closed)\n";
  return false;
}

} // namespace

int run_cli(const std::vector<std::string> &args, std::ostream &out, std::ostream &err) {
  // Help and the version are answers, not errors: stdout, exit 0.
  if (args.size() == 1 && (args[0] == "help" || args[0] == "--help" || args[0] == "-h")) {
    out << kUsage << kDefaults;
    return wrote(out, err) ? 0 : 2;
  }
  // A command's help: `moeforge help run`, `moeforge run --help`, or -h
  // anywhere after a command's name (other arguments then do not matter).
  auto is_help = [](const std::string &a) { return a == "--help" || a == "-h"; };
  if (!args.empty()) {
    const bool help_word = args[0] == "help" && args.size() == 2;
    const std::string &command = help_word ? args[1] : args[0];
    if (help_word || (command_help(command) && std::any_of(args.begin() + 1, args.end(), is_help))) {
      const char *text = command_help(command);
      if (!text) {
        err << "moeforge: no command '" << command << "': use list, print, run, train, emit or tune\n";
        return 2;
      }
      out << text;
      return wrote(out, err) ? 0 : 2;
    }
  }
  if (args.size() == 1 && (args[0] == "version" || args[0] == "--version")) {
    out << "moeforge " << kVersion << "\nbuilt with " << MOEFORGE_BUILD_COMPILER << ", CUDA toolkit "
        << MOEFORGE_BUILD_CUDA << ", LLVM " << MOEFORGE_BUILD_LLVM << "\n";
    return wrote(out, err) ? 0 : 2;
  }
  Options o;
  // Errors in the arguments come with the usage; once they hold together
  // (example, shape, schedule, backend), an error about compiling or running
  // the layer comes alone.
  bool working = false;
  try {
    o = parse_options(args);
    if (o.command == "list") {
      for (const std::string &n : example_names())
        out << n << ": " << make_example(n, ExampleShape{}).description << "\n";
      return wrote(out, err) ? 0 : 2;
    }
    if (o.command == "print") {
      Example ex = make_example(o.example, o.shape);
      out << ex.pipeline;
      return wrote(out, err) ? 0 : 2;
    }
    if (o.command == "emit") {
      Example ex = make_example(o.example, o.shape);
      user_check(o.schedule != "auto") << "emit prints what a schedule compiles to, and 'auto' is chosen where the "
                                       << "layer runs (run, train, tune): name a preset or a schedule file";
      const Func out_func = ex.pipeline.func(ex.output);
      // "default": what a layer runs with no schedule and nothing tuned
      // (lowering/default_schedule.h), made for this layer.
      Schedule schedule = o.schedule == "default" ? default_schedule(ex.pipeline, schedule_outputs(ex, o.emit_training))
                                                  : schedule_arg(o.schedule, working);
      working = o.emit == "ir" || o.emit == "passes" || o.emit == "memory" ||
                (o.emit == "cuda" || o.emit == "plan" ? kHaveCuda : kHaveCpu);
      if (o.emit == "memory") {
        if (o.emit_training) {
          const TrainingProgram t = lower_training(ex.pipeline, out_func, schedule);
          out << memory_report(t.program, t.forward_steps, o.shape.tokens);
        } else {
          const KernelProgram p = lower(ex.pipeline, schedule);
          out << memory_report(p, p.steps.size(), o.shape.tokens);
        }
        return wrote(out, err) ? 0 : 2;
      }
      if (o.emit == "passes") {
        lower(ex.pipeline, schedule, [&](const std::string &pass, const KernelProgram &p) {
          out << "=== after " << pass << " ===\n" << p;
        });
        return wrote(out, err) ? 0 : 2;
      }
      if (o.emit == "ir") {
        if (o.emit_training)
          out << lower_training(ex.pipeline, ex.pipeline.func(ex.output), schedule).program;
        else
          out << lower(ex.pipeline, schedule);
        return wrote(out, err) ? 0 : 2;
      }
      if (o.emit == "plan") {
        user_check(kHaveCuda) << "emit --plan: this build has no CUDA backend (the CUDA toolkit was not found when "
                              << "it was configured); emit --ir works without it";
#ifdef MOEFORGE_HAVE_CUDA
        out << cli_cuda_plans(ex, schedule, o.emit_training);
#endif
        return wrote(out, err) ? 0 : 2;
      }
      if (o.emit == "cuda") {
        user_check(kHaveCuda) << "emit --cuda: this build has no CUDA backend (the CUDA toolkit was not found when "
                              << "it was configured); emit --ir works without it";
#ifdef MOEFORGE_HAVE_CUDA
        out << cli_cuda_source(ex, schedule, o.emit_training);
#endif
        return wrote(out, err) ? 0 : 2;
      }
      user_check(kHaveCpu) << "emit --llvm: this build has no CPU backend (LLVM 19 was not found when it was "
                           << "configured: install llvm-19-dev); emit --ir works without it";
#ifdef MOEFORGE_HAVE_CPU_BACKEND
      out << cli_llvm_ir(ex.pipeline, schedule);
#endif
      return wrote(out, err) ? 0 : 2;
    }
    Progress progress(err, Progress::wanted());
    if (o.command == "tune")
      return tune(o, out, err, working) == 0 && wrote(out, err) ? 0 : 2;
    const int rc = o.command == "train" ? train(o, out, progress, working) : run(o, out, progress, working);
    return wrote(out, err) ? rc : 2;
  } catch (const UserError &e) {
    err << "moeforge: " << e.what() << "\n" << (working ? "" : kUsage);
    return 2;
  }
}

} // namespace moeforge
