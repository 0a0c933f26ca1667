#include "backends/cuda/tune/tuner.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <variant>

#include "backends/cuda/runtime/layer.h"
#include "backends/cuda/runtime/stream.h"
#include "backends/cuda/runtime/training_layer.h"
#include "backends/cuda/tune/tune_space.h"
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

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// A candidate's layer on the device for one set of inputs, bound to those
// staged inputs, its step captured as CUDA graphs. `shared` (the first
// set's staged buffers, or null for the first set) holds every input this
// set does not give itself: a skewed set changes the router's inputs only,
// and the weights (gigabytes on a real layer) are staged once.
class LiveLayer {
public:
  LiveLayer(Device &device, const TuneRequest &r, const TensorMap &inputs, std::shared_ptr<const CompiledCandidate> c,
            StagedInputs &staged, const StagedInputs *shared, Stream &stream)
      : compiled_(std::move(c)), stream_(stream) {
    if (!compiled_->error.empty())
      throw std::runtime_error(compiled_->error);
    std::vector<std::string> names;
    for (const auto &[name, value] : r.inputs)
      names.push_back(name);
    if (r.training)
      names.push_back(compiled_->training->training.seed); // the bound upstream gradient counts as given
    const bool first = staged.empty();
    auto bind_all = [&](auto &layer, const CudaLayer &plain) {
      for (const std::string &name : names) {
        const size_t bytes = plain.info(name).bytes;
        const bool own = shared == nullptr || inputs.count(name) > 0;
        if (own && first)
          staged.emplace(name, DeviceBuffer(bytes));
        layer.bind(name, (own ? staged : *shared).at(name).ptr(), bytes);
      }
      if (first)
        for (const auto &[name, value] : inputs)
          layer.upload(name, value);
    };
    if (!r.training) {
      layer_ = std::make_unique<CudaLayer>(device, *compiled_->layer, r.tokens);
      bind_all(*layer_, *layer_);
      fwd_ = CudaGraph::capture(stream_, [&] { layer_->enqueue(stream_); });
      return;
    }
    training_ = std::make_unique<TrainingLayer>(device, *compiled_->training, r.tokens);
    bind_all(*training_, training_->layer());
    if (first && shared == nullptr)
      training_->upload_upstream_gradient(r.upstream);
    // Captured once: the backward's check that the upstream gradient was
    // uploaded since the last forward holds at capture, and replays reuse it.
    fwd_ = CudaGraph::capture(stream_, [&] { training_->forward(stream_); });
    bwd_ = CudaGraph::capture(stream_, [&] { training_->backward(stream_); });
  }

  // ms per replay: `warm` replays untimed (module load, first touch, and
  // the clocks up to speed: the first replays of a cold GPU ran 1.5 %
  // slower), then the mean of `reps`.
  double time(int warm, int reps) {
    for (int i = 0; i < warm; ++i)
      replay();
    Event start, stop;
    start.record(stream_);
    for (int i = 0; i < reps; ++i)
      replay();
    stop.record(stream_);
    stop.synchronize();
    return elapsed_ms(start, stop) / reps;
  }

  // ms of `func`'s GEMM steps alone (the sum of their kernels' times, an
  // event around each step), the median of `rounds` runs of the whole
  // layer step by step. What a Func's choice changes is its own kernels:
  // timed alone they differ by their own few percent, where the whole
  // step's time moves with the clock by as much.
  double time_func(const std::string &func, int rounds) {
    const KernelProgram &program = training_ ? compiled_->training->layer.program : compiled_->layer->program;
    std::set<std::string> steps;
    for (const Step &st : program.steps)
      if (const auto *g = std::get_if<GemmStep>(&st); g && g->func == func)
        steps.insert(step_name(st));
    user_check(!steps.empty()) << "tune: no GEMM step of '" << func << "' to time";
    replay(); // warm: the clocks up, the caches as the step leaves them
    std::vector<double> ms;
    for (int i = 0; i < rounds; ++i) {
      std::vector<std::pair<std::string, double>> prof;
      if (training_) {
        prof = training_->profile_forward(stream_);
        for (auto &p : training_->profile_backward(stream_))
          prof.push_back(std::move(p));
      } else {
        prof = layer_->profile(stream_);
      }
      double sum = 0;
      for (const auto &[name, t] : prof)
        sum += steps.count(name) ? t : 0;
      ms.push_back(sum);
    }
    return median(std::move(ms));
  }

private:
  void replay() {
    fwd_.launch(stream_);
    if (!bwd_.empty())
      bwd_.launch(stream_);
  }
  // Declared in the order they are built: the graphs go first, the layers
  // next, and the compiled candidate (which a layer reads) last.
  std::shared_ptr<const CompiledCandidate> compiled_;
  Stream &stream_;
  std::unique_ptr<CudaLayer> layer_;
  std::unique_ptr<TrainingLayer> training_;
  CudaGraph fwd_, bwd_;
};

// A candidate built on the device for each set of inputs the request times
// (uniform routing, and skewed where given), so that it can be timed again
// beside others (a run-off) without being built again. Its times are the
// sums over the sets: a schedule is chosen for both routings.
class LiveCandidate {
public:
  LiveCandidate(Device &device, const TuneRequest &r, const std::shared_ptr<const CompiledCandidate> &c,
                std::vector<StagedInputs> &staged, Stream &stream) {
    const std::vector<const TensorMap *> sets = input_sets(r);
    for (size_t i = 0; i < sets.size(); ++i)
      layers_.push_back(
          std::make_unique<LiveLayer>(device, r, *sets[i], c, staged.at(i), i ? &staged.at(0) : nullptr, stream));
  }
  static std::vector<const TensorMap *> input_sets(const TuneRequest &r) {
    std::vector<const TensorMap *> sets{&r.inputs};
    if (!r.skewed_inputs.empty())
      sets.push_back(&r.skewed_inputs);
    return sets;
  }
  double time(int warm, int reps) {
    double sum = 0;
    for (auto &l : layers_)
      sum += l->time(warm, reps);
    return sum;
  }
  double time_func(const std::string &func, int rounds) {
    double sum = 0;
    for (auto &l : layers_)
      sum += l->time_func(func, rounds);
    return sum;
  }

private:
  std::vector<std::unique_ptr<LiveLayer>> layers_;
};

// Replays long enough together that the events' resolution and one
// replay's launch jitter are small beside them: mbpaper's forward takes
// 0.65 ms, five of them were within the noise of the differences timed.
constexpr double kMinTimedMs = 25;

// Replays timed for a candidate whose replay takes about `ms`.
int reps_for(const TuneRequest &r, double ms) {
  return std::max(r.reps, static_cast<int>(std::ceil(kMinTimedMs / std::max(ms, 1e-3))));
}

// Passes of the search over the layer-wide choices and every Func's, at most.
constexpr int kPasses = 2;

// Step-by-step runs whose median times a Func's kernels in a sweep.
constexpr int kFuncRuns = 3;

// One timing of a candidate built for it and freed after: a sweep's.
double time_once(Device &device, const TuneRequest &r, const std::shared_ptr<const CompiledCandidate> &c,
                 std::vector<StagedInputs> &staged, Stream &stream) {
  LiveCandidate live(device, r, c, staged, stream);
  const double estimate = live.time(3, 1);
  return live.time(1, reps_for(r, estimate));
}

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

size_t runoff_winner(const std::vector<std::vector<double>> &ms) {
  user_check(!ms.empty()) << "a run-off needs a contender";
  size_t best = 0;
  double best_median = 0;
  for (size_t c = 0; c < ms.size(); ++c) {
    user_check(!ms[c].empty()) << "a run-off contender with no timing";
    const double m = median(ms[c]);
    if (c == 0 || m < best_median) {
      best = c;
      best_median = m;
    }
  }
  return best;
}

TuneResult tune(Device &device, const TuneRequest &r, const std::function<void(const std::string &)> &progress) {
  user_check(r.pipeline != nullptr && r.tokens > 0) << "tune: a pipeline and a positive token count";
  user_check(r.runoff_size >= 2 && r.runoff_rounds >= 1) << "tune: a run-off of at least two contenders and one round";
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(clock::now() - start).count(); };
  TuneResult res;
  auto say = [&](const std::string &line) {
    res.log.push_back(line);
    if (progress)
      progress(line);
  };
  using Compiled = std::shared_ptr<const CompiledCandidate>;
  auto compile_all = [&](const std::vector<Schedule> &schedules) {
    std::vector<Compiled> out;
    for (CompiledCandidate &c :
         compile_candidates(r, schedules, device.arch_specific(), std::max(1u, std::thread::hardware_concurrency())))
      out.push_back(std::make_shared<const CompiledCandidate>(std::move(c)));
    return out;
  };
  Stream stream;
  std::vector<StagedInputs> staged(LiveCandidate::input_sets(r).size()); // one per set of inputs
  // The best so far, compiled, for the run-offs.
  Compiled best = compile_all({r.base}).at(0);
  res.best = r.base;
  res.base_ms = res.best_ms = time_once(device, r, best, staged, stream);
  res.timed = 1;
  say("base schedule: " + fmt_ms(res.base_ms));

  struct Timed {
    size_t index;
    double ms;
  };
  // Times each candidate once (the sweep), in order, while the budget lasts:
  // the whole layer, or with `func` named that Func's GEMM kernels alone.
  // `remaining_after` tells the candidates after this sweep, for the
  // estimate of the time left.
  auto sweep = [&](const std::vector<Compiled> &compiled, const std::vector<std::string> &what, size_t remaining_after,
                   const std::string &func) {
    std::vector<Timed> timed;
    for (size_t i = 0; i < compiled.size(); ++i) {
      if (elapsed() > r.budget_seconds) {
        res.left += static_cast<int>(compiled.size() - i);
        break;
      }
      try {
        double ms = 0;
        if (func.empty()) {
          ms = time_once(device, r, compiled[i], staged, stream);
        } else {
          LiveCandidate live(device, r, compiled[i], staged, stream);
          ms = live.time_func(func, kFuncRuns);
        }
        ++res.timed;
        timed.push_back({i, ms});
        const size_t remaining = compiled.size() - i - 1 + remaining_after;
        const double eta = std::min(r.budget_seconds - elapsed(), elapsed() / res.timed * double(remaining));
        std::ostringstream line;
        line << "[" << res.timed << "] " << what[i] << ": " << (func.empty() ? "" : func + "'s kernels ") << fmt_ms(ms)
             << "; best " << fmt_ms(res.best_ms) << ", ~" << static_cast<int>(std::max(0.0, eta)) << " s left";
        say(line.str());
      } catch (const std::runtime_error &e) {
        ++res.failed; // a candidate the device refuses (resources at launch): skipped, said why
        say(what[i] + ": skipped (" + e.what() + ")");
      }
    }
    return timed;
  };
  // The best so far against the sweep's fastest, side by side in
  // interleaved rounds (each contender in every position of a round across
  // the rounds); the winner's index in the sweep, or none where the best
  // so far stays. runoff_medians: the last run-off's median a contender, by
  // index in its sweep.
  std::map<size_t, double> runoff_medians;
  auto runoff = [&](const std::string &round_name, const std::vector<Compiled> &compiled,
                    const std::vector<std::string> &what, std::vector<Timed> timed,
                    const std::string &func) -> std::optional<size_t> {
    if (timed.empty())
      return std::nullopt;
    std::sort(timed.begin(), timed.end(), [](const Timed &a, const Timed &b) { return a.ms < b.ms; });
    timed.resize(std::min(timed.size(), static_cast<size_t>(r.runoff_size - 1)));
    std::vector<std::unique_ptr<LiveCandidate>> live;
    std::vector<std::string> names{"the best so far"};
    std::vector<size_t> index{0}; // into the sweep, for contenders after the first
    live.push_back(std::make_unique<LiveCandidate>(device, r, best, staged, stream));
    for (const Timed &t : timed)
      try {
        live.push_back(std::make_unique<LiveCandidate>(device, r, compiled[t.index], staged, stream));
        names.push_back(what[t.index]);
        index.push_back(t.index);
      } catch (const std::runtime_error &e) {
        say(what[t.index] + ": left out of the run-off (" + e.what() + ")");
      }
    const int reps = reps_for(r, res.best_ms);
    std::vector<std::vector<double>> ms(live.size());
    for (int round = 0; round < r.runoff_rounds; ++round)
      for (size_t j = 0; j < live.size(); ++j) {
        const size_t c = (j + static_cast<size_t>(round)) % live.size();
        ms[c].push_back(func.empty() ? live[c]->time(2, reps) : live[c]->time_func(func, 1));
      }
    const size_t w = runoff_winner(ms);
    // The best's whole layer, for the report (a Func's run-off times its kernels).
    res.best_ms = func.empty() ? median(ms[w]) : live[w]->time(2, reps);
    std::ostringstream line;
    line << "run-off " << round_name << " (medians of " << r.runoff_rounds << " interleaved rounds"
         << (func.empty() ? "" : ", " + func + "'s kernels") << "):";
    runoff_medians.clear();
    for (size_t c = 0; c < live.size(); ++c) {
      line << (c ? ";" : "") << " " << names[c] << " " << fmt_ms(median(ms[c])) << (c == w ? " (best)" : "");
      if (c > 0)
        runoff_medians[index[c]] = median(ms[c]);
    }
    line << "; the layer " << fmt_ms(res.best_ms);
    say(line.str());
    if (w == 0)
      return std::nullopt;
    return index[w];
  };

  // The search: coordinate descent from the base, the layer-wide choices
  // first (the routed rows' format, block size, where the gate multiplies:
  // they change which GEMMs there are and what they read), then each
  // Func's round (its tile, stages and walk, then its raster band); a
  // second pass goes over both again from there, since a layer-wide choice
  // that won under the base's tiles can lose once the Funcs have theirs,
  // and a pass cannot go back on it. It runs from two starts: the best
  // layer-wide choices under the base's tiles (the first round as above),
  // and the base's own layer-wide choices kept through the first pass.
  // Mbpaper shows why: block(256) with the gate in the combine beats
  // scattermoe's layout under its 128 x 128 tiles, and holds on through
  // both passes, while scattermoe's gate in the epilogue with persistent
  // pairs of down-projection tiles is 3 % faster under skew. The two ends
  // and the base meet in a last run-off.
  const Compiled base_compiled = best;
  auto descend = [&](bool layout_first) {
    Schedule base = r.base;
    std::map<std::string, FuncChoice> chosen; // the Funcs whose best differs from the base
    for (int pass = 1; pass <= kPasses && elapsed() <= r.budget_seconds; ++pass) {
      const std::string in_pass = pass > 1 ? " (pass " + std::to_string(pass) + ")" : "";
      bool changed = false;
      if (layout_first || pass > 1) {
        // Around the base's layer-wide choices, each candidate with the
        // Funcs' choices so far applied after them (so that the winner's
        // schedule file names each setting once).
        auto with_chosen = [&](Schedule s) {
          for (const auto &[func, choice] : chosen)
            s = with_choice(s, func, choice);
          return s;
        };
        LayoutCandidates lc = layout_candidates(*r.pipeline, r.output, base, r.training);
        res.pruned += static_cast<int>(lc.pruned.size());
        std::vector<Schedule> schedules;
        std::vector<std::string> what;
        for (const LayoutCandidate &c : lc.kept) {
          schedules.push_back(with_chosen(c.schedule));
          what.push_back(c.what);
        }
        const std::vector<Compiled> compiled = compile_all(schedules);
        if (auto w = runoff("of the layer-wide choices" + in_pass, compiled, what, sweep(compiled, what, 0, ""), "")) {
          base = lc.kept[*w].schedule;
          res.best = schedules[*w];
          best = compiled[*w];
          changed = true;
        }
      }
      const std::vector<std::string> funcs = tunable_funcs(*r.pipeline, r.output, base, r.training);
      for (size_t f = 0; f < funcs.size(); ++f) {
        FuncCandidates fc = candidates_for(*r.pipeline, r.output, res.best, funcs[f], r.training, r.tokens);
        // Each candidate is the base with the Funcs' best choices so far and
        // this one, so the winner's schedule file names each Func once.
        auto build = [&](const FuncChoice &c) {
          Schedule s = base;
          for (const auto &[func, choice] : chosen)
            if (func != funcs[f])
              s = with_choice(s, func, choice);
          return with_choice(s, funcs[f], c);
        };
        // A round of this Func's candidates: compiled side by side, then
        // timed one by one, the fastest in a run-off with the best so far.
        auto func_round = [&](const FuncCandidates &cands, const std::string &round_name, size_t after) {
          std::vector<Schedule> schedules;
          std::vector<std::string> what;
          for (const FuncChoice &c : cands.kept) {
            schedules.push_back(build(c));
            what.push_back(funcs[f] + " " + c.text());
          }
          const std::vector<Compiled> compiled = compile_all(schedules);
          if (auto w = runoff(round_name + in_pass, compiled, what, sweep(compiled, what, after, funcs[f]), funcs[f])) {
            res.best = schedules[*w];
            best = compiled[*w];
            chosen[funcs[f]] = cands.kept[*w];
            changed = true;
          }
        };
        res.pruned += static_cast<int>(fc.pruned.size());
        if (elapsed() > r.budget_seconds) {
          res.left += static_cast<int>(fc.kept.size());
          continue;
        }
        // The later Funcs' spaces, about as large as this one's.
        const size_t after = fc.kept.size() * (funcs.size() - f - 1);
        func_round(fc, "of " + funcs[f], after);
        // Then the order its blocks walk the tiles in (the raster band), with
        // the rest of its settings as they now are: the band decides which
        // tiles share A rows and B columns in L2 at once. Tried apart, not in
        // the product with the other knobs, which would double every round.
        if (elapsed() > r.budget_seconds)
          continue;
        FuncCandidates rc = raster_candidates_for(*r.pipeline, r.output, res.best, funcs[f], r.training, r.tokens);
        res.pruned += static_cast<int>(rc.pruned.size());
        func_round(rc, "of " + funcs[f] + "'s raster band", after);
        // And its narrow tail (a last column tile half full or less, whose
        // wgmmas can be half-width): one candidate where the GEMM has one.
        if (elapsed() > r.budget_seconds)
          continue;
        FuncCandidates nc = narrow_tail_candidates_for(*r.pipeline, r.output, res.best, funcs[f], r.training, r.tokens);
        res.pruned += static_cast<int>(nc.pruned.size());
        func_round(nc, "of " + funcs[f] + "'s narrow tail", after);
      }
      if (!changed)
        break; // a pass that moved nothing: the next would time the same candidates
    }
    return std::make_pair(res.best, best);
  };
  const auto [first_schedule, first_compiled] = descend(true);
  // The last run-off: the first start's end as the best so far, against the
  // second start's and the base itself. Each round of the search compared
  // its contenders side by side, but rounds run minutes apart, and a card
  // that has warmed up to its power limit times the same layer slower later
  // on: the base timed first is no yardstick for an end timed last, so it
  // contends again, and the search never returns a schedule slower than
  // the one it started from.
  std::vector<Compiled> ends;
  std::vector<std::string> end_names;
  std::vector<Schedule> end_schedules;
  bool base_contends = false; // then it is the last of the ends
  if (elapsed() <= r.budget_seconds) {
    say("second start: the base's layer-wide choices kept through the first pass");
    const double first_ms = res.best_ms;
    res.best = r.base;
    best = base_compiled;
    res.best_ms = res.base_ms;
    const auto [second_schedule, second_compiled] = descend(false);
    res.best = first_schedule;
    best = first_compiled;
    res.best_ms = first_ms;
    ends.push_back(second_compiled);
    end_names.push_back("the second start's best");
    end_schedules.push_back(second_schedule);
  }
  if (first_schedule.to_text() != r.base.to_text()) {
    base_contends = true;
    ends.push_back(base_compiled);
    end_names.push_back("the base");
    end_schedules.push_back(r.base);
  }
  std::vector<Timed> contenders;
  for (size_t i = 0; i < ends.size(); ++i)
    contenders.push_back(Timed{i, 0.0});
  if (auto w = runoff("of the search's ends and the base", ends, end_names, contenders, ""))
    res.best = end_schedules[*w];
  // The report compares the best with the base as timed side by side here,
  // not as timed first on a cooler card.
  if (base_contends && runoff_medians.count(ends.size() - 1)) {
    res.base_ms = runoff_medians.at(ends.size() - 1);
    say("the base timed again beside the best: " + fmt_ms(res.base_ms));
  }
  return res;
}

} // namespace moeforge::cuda
