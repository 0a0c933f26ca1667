#include "backends/cuda/tuner.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <sstream>
#include <thread>

#include "backends/cuda/layer.h"
#include "backends/cuda/stream.h"
#include "backends/cuda/training_layer.h"
#include "backends/cuda/tune_space.h"
#include "dsl/error.h"

namespace moeforge::cuda {

namespace {

CompiledCandidate compile_one(const TuneRequest &r, const Schedule &schedule, const std::string &arch) {
  CompiledCandidate c;
  try {
    if (r.training)
      c.training = compile_training(*r.pipeline, r.pipeline->func(r.output), schedule, arch);
    else
      c.layer = compile_layer(*r.pipeline, schedule, arch);
  } catch (const std::runtime_error &e) {
    c.error = e.what();
  }
  return c;
}

// The inputs (and a training step's upstream gradient) on the device, in
// the layers' storage types: the first candidate's layer uploads them into
// these buffers, every later one is bound to them. Converting and copying
// a real layer's gigabytes of weights from the host took seconds of each
// candidate's time.
using StagedInputs = std::map<std::string, DeviceBuffer>;

// Binds `layer` (a CudaLayer or TrainingLayer; `plain` its CudaLayer, which
// tells the sizes) to the staged buffers, made on the first call.
template <typename Layer>
void stage(Layer &layer, const CudaLayer &plain, const std::vector<std::string> &names, StagedInputs &staged) {
  const bool first = staged.empty();
  for (const std::string &name : names) {
    const size_t bytes = plain.info(name).bytes;
    if (first)
      staged.emplace(name, DeviceBuffer(bytes));
    layer.bind(name, staged.at(name).ptr(), bytes);
  }
}

// The compiled candidate, ms per replay (the mean of `reps` after warm-up
// replays).
double time_candidate(Device &device, const TuneRequest &r, const CompiledCandidate &c, StagedInputs &staged) {
  if (!c.error.empty())
    throw std::runtime_error(c.error);
  Stream stream;
  auto timed = [&](const std::function<void()> &replay) {
    // Warm-up: module load, first touch, and the clocks up to speed (the
    // first replays of a cold GPU ran 1.5 % slower, enough to pick a
    // schedule identical to the base as "faster").
    for (int i = 0; i < 3; ++i)
      replay();
    Event start, stop;
    start.record(stream);
    for (int i = 0; i < r.reps; ++i)
      replay();
    stop.record(stream);
    stop.synchronize();
    return elapsed_ms(start, stop) / r.reps;
  };
  std::vector<std::string> names;
  for (const auto &[name, value] : r.inputs)
    names.push_back(name);
  const bool first = staged.empty();
  if (!r.training) {
    CudaLayer layer(device, *c.layer, r.tokens);
    stage(layer, layer, names, staged);
    if (first)
      layer.upload(r.inputs);
    CudaGraph g = CudaGraph::capture(stream, [&] { layer.enqueue(stream); });
    return timed([&] { g.launch(stream); });
  }
  TrainingLayer layer(device, *c.training, r.tokens);
  names.push_back(c.training->training.seed);
  stage(layer, layer.layer(), names, staged); // the bound upstream gradient counts as given
  if (first) {
    layer.upload(r.inputs);
    layer.upload_upstream_gradient(r.upstream);
  }
  // Captured once: the backward's check that the upstream gradient was
  // uploaded since the last forward holds at capture, and replays reuse it.
  CudaGraph fwd = CudaGraph::capture(stream, [&] { layer.forward(stream); });
  CudaGraph bwd = CudaGraph::capture(stream, [&] { layer.backward(stream); });
  return timed([&] {
    fwd.launch(stream);
    bwd.launch(stream);
  });
}

constexpr double kNoise = 0.01;

std::string fmt_ms(double ms) {
  std::ostringstream o;
  o.precision(4);
  o << ms << " ms";
  return o.str();
}

} // namespace

std::vector<CompiledCandidate> compile_candidates(const TuneRequest &r, const std::vector<Schedule> &schedules,
                                                  const std::string &arch, unsigned threads) {
  std::vector<CompiledCandidate> out(schedules.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < schedules.size(); i = next++)
      out[i] = compile_one(r, schedules[i], arch);
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < std::max(1u, threads) && t < schedules.size(); ++t)
    pool.emplace_back(work);
  work();
  for (std::thread &t : pool)
    t.join();
  return out;
}

TuneResult tune(Device &device, const TuneRequest &r, const std::function<void(const std::string &)> &progress) {
  user_check(r.pipeline != nullptr && r.tokens > 0) << "tune: a pipeline and a positive token count";
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(clock::now() - start).count(); };
  auto say = [&](TuneResult &res, const std::string &line) {
    res.log.push_back(line);
    if (progress)
      progress(line);
  };
  TuneResult res;
  res.best = r.base;
  std::map<std::string, FuncChoice> chosen; // the Funcs whose best differs from the base
  const std::string arch = device.arch_specific();
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  StagedInputs staged;
  res.base_ms = res.best_ms = time_candidate(device, r, compile_one(r, r.base, arch), staged);
  res.timed = 1;
  say(res, "base schedule: " + fmt_ms(res.base_ms));
  // The layer-wide choices first (the routed rows' format, where the gate
  // multiplies): they change which GEMMs there are and what they read, so
  // the per-Func search starts from the best of them.
  Schedule base = r.base;
  {
    LayoutCandidates lc = layout_candidates(*r.pipeline, r.output, r.base, r.training);
    res.pruned += static_cast<int>(lc.pruned.size());
    std::vector<Schedule> schedules;
    for (const LayoutCandidate &c : lc.kept)
      schedules.push_back(c.schedule);
    std::vector<CompiledCandidate> compiled = compile_candidates(r, schedules, arch, threads);
    for (size_t i = 0; i < lc.kept.size(); ++i) {
      if (elapsed() > r.budget_seconds) {
        res.left += static_cast<int>(lc.kept.size() - i);
        break;
      }
      try {
        const double ms = time_candidate(device, r, compiled[i], staged);
        ++res.timed;
        const bool better = ms < res.best_ms * (1 - kNoise);
        if (better) {
          res.best = base = lc.kept[i].schedule;
          res.best_ms = ms;
        }
        say(res, "[" + std::to_string(res.timed) + "] " + lc.kept[i].what + ": " + fmt_ms(ms) +
                     (better ? " (best)" : "") + "; best " + fmt_ms(res.best_ms));
      } catch (const std::runtime_error &e) {
        ++res.failed;
        say(res, lc.kept[i].what + ": skipped (" + e.what() + ")");
      }
    }
  }
  const std::vector<std::string> funcs = tunable_funcs(*r.pipeline, r.output, base, r.training);
  for (size_t f = 0; f < funcs.size(); ++f) {
    FuncCandidates fc = candidates_for(*r.pipeline, r.output, res.best, funcs[f], r.training);
    // Each candidate is the base with the Funcs' best choices so far and
    // this one, so the winner's schedule file names each Func once.
    auto build = [&](const FuncChoice &c) {
      Schedule s = base;
      for (const auto &[func, choice] : chosen)
        if (func != funcs[f])
          s = with_choice(s, func, choice);
      return with_choice(s, funcs[f], c);
    };
    res.pruned += static_cast<int>(fc.pruned.size());
    if (elapsed() > r.budget_seconds) {
      res.left += static_cast<int>(fc.kept.size());
      continue;
    }
    // This Func's candidates compile side by side, then are timed one by one.
    std::vector<Schedule> schedules;
    for (const FuncChoice &c : fc.kept)
      schedules.push_back(build(c));
    std::vector<CompiledCandidate> compiled = compile_candidates(r, schedules, arch, threads);
    for (size_t i = 0; i < fc.kept.size(); ++i) {
      if (elapsed() > r.budget_seconds) {
        res.left += static_cast<int>(fc.kept.size() - i);
        continue;
      }
      const Schedule &candidate = schedules[i];
      std::string what = funcs[f] + " " + fc.kept[i].text();
      try {
        const double ms = time_candidate(device, r, compiled[i], staged);
        ++res.timed;
        // A win must clear the run-to-run spread of one timing (~1 %), or
        // the search would wander on noise.
        const bool better = ms < res.best_ms * (1 - kNoise);
        if (better) {
          res.best = candidate;
          chosen[funcs[f]] = fc.kept[i];
          res.best_ms = ms;
        }
        // The time left: the candidates not yet timed at this one's pace.
        size_t remaining = fc.kept.size() - i - 1;
        for (size_t g = f + 1; g < funcs.size(); ++g)
          remaining += fc.kept.size(); // the later Funcs' spaces, about as large
        const double eta = std::min(r.budget_seconds - elapsed(), elapsed() / res.timed * double(remaining));
        std::ostringstream line;
        line << "[" << res.timed << "] " << what << ": " << fmt_ms(ms) << (better ? " (best)" : "") << "; best "
             << fmt_ms(res.best_ms) << ", ~" << static_cast<int>(std::max(0.0, eta)) << " s left";
        say(res, line.str());
      } catch (const std::runtime_error &e) {
        ++res.failed; // a candidate the device refuses (resources at launch): skipped, said why
        say(res, what + ": skipped (" + e.what() + ")");
      }
    }
  }
  return res;
}

} // namespace moeforge::cuda
