// fused_attention (lowering/fuse_attention.h): a forward's attention between
// two contractions over the tokens, softmax(u, c q . key) value, becomes one
// AttentionStep that takes the softmax online and stores no scores; in
// training the backward's steps from the probabilities to the query's,
// key's and value's gradients become two more, which make the
// probabilities again from each row's log-sum-exp. Checked on the program
// (which steps and tensors remain; where it does not apply, the schedule's
// note) and, on the CPU backend, against the float64 reference at token
// counts that are no multiple of 8, outputs poisoned.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "examples/examples.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/fuse_attention.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "program_order.h"
#include "program_steps.h"
#include "training_compare.h"
#if MOEFORGE_HAVE_CPU_BACKEND
#include "cpu_compare.h"
#endif

using namespace moeforge;

namespace {

ExampleShape attention_shape(int64_t tokens) { return testing::shape(tokens, 64, 32, 8, 2); }

Schedule fused(const Example &ex) { return default_schedule(ex.pipeline, {}).fused_attention(true); }

size_t count_attention(const KernelProgram &p) {
  return static_cast<size_t>(std::count_if(p.steps.begin(), p.steps.end(),
                                           [](const Step &s) { return std::holds_alternative<AttentionStep>(s); }));
}

bool has_note(const KernelProgram &p, const std::string &start) {
  return std::any_of(p.not_applied.begin(), p.not_applied.end(),
                     [&](const std::string &n) { return n.rfind(start, 0) == 0; });
}

// The attention steps of a part.
std::vector<AttentionStep> attention_steps(const KernelProgram &p, AttentionStep::Part part) {
  std::vector<AttentionStep> out;
  for (const Step &s : p.steps)
    if (const auto *a = std::get_if<AttentionStep>(&s); a && a->part == part)
      out.push_back(*a);
  return out;
}

// A training schedule with the attention fused: the default, or a preset.
Schedule fused_training(const Example &ex, const std::string &preset) {
  const Schedule s = preset == "default"
                         ? default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)})
                         : testing::training_preset(preset, preset.find("recompute") != std::string::npos);
  return Schedule(s).fused_attention(true);
}

} // namespace

TEST_CASE("fused attention: moa's and attention's scores, softmax and second contraction become one step") {
  for (const char *name : {"moa", "attention"}) {
    INFO(name);
    Example ex = make_example(name, attention_shape(37));
    const KernelProgram unfused = lower(ex.pipeline, default_schedule(ex.pipeline, {}));
    REQUIRE(unfused.find("p") != nullptr);
    CHECK(count_attention(unfused) == 0);
    const KernelProgram p = lower(ex.pipeline, fused(ex));
    REQUIRE(count_attention(p) == 1);
    CHECK(p.steps.size() == unfused.steps.size() - 2); // the scores' GEMM, the softmax and p value: one step
    // Neither the scores nor the probabilities are tensors any more.
    CHECK(p.find("p") == nullptr);
    CHECK(p.find("p_s") == nullptr);
    CHECK_FALSE(has_note(p, "fused_attention"));
    const auto &a = *std::find_if(p.steps.begin(), p.steps.end(),
                                  [](const Step &s) { return std::holds_alternative<AttentionStep>(s); });
    const AttentionStep &at = std::get<AttentionStep>(a);
    // The scale is the algebra's 1 / sqrt(head dim).
    const double head = static_cast<double>(p.tensor(at.q).dims[1].extent());
    CHECK(at.scale == doctest::Approx(1 / std::sqrt(head)).epsilon(1e-6));
    // moa's query rows are its route's padded rows; attention's the tokens.
    CHECK((at.route != nullptr) == (std::string(name) == "moa"));
  }
}

TEST_CASE("fused attention: not applied where nothing fuses, with the reason") {
  SUBCASE("a layer without attention") {
    Example ex = make_example("swiglu_moe", attention_shape(37));
    const KernelProgram p = lower(ex.pipeline, default_schedule(ex.pipeline, {}).fused_attention(true));
    CHECK(count_attention(p) == 0);
    CHECK(has_note(p, "fused_attention(true) is not applied"));
  }
  SUBCASE("off unless named") {
    Example ex = make_example("attention", attention_shape(37));
    CHECK(count_attention(lower(ex.pipeline, default_schedule(ex.pipeline, {}))) == 0);
  }
}

TEST_CASE("fused attention: training keeps each row's log-sum-exp, not the probabilities") {
  for (const char *name : {"moa", "attention"})
    for (const char *preset : {"default", "megablocks", "scattermoe+lean"}) {
      INFO(std::string(name) << " / " << std::string(preset));
      Example ex = make_example(name, attention_shape(37));
      const TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), fused_training(ex, preset));
      const KernelProgram &p = t.program;
      CHECK_FALSE(has_note(p, "fused_attention"));
      const auto forward = attention_steps(p, AttentionStep::Part::forward);
      const auto dq = attention_steps(p, AttentionStep::Part::query_gradient);
      const auto dk = attention_steps(p, AttentionStep::Part::key_gradient);
      REQUIRE(forward.size() == 1u);
      REQUIRE(dq.size() == 1u);
      REQUIRE(dk.size() == 1u);
      // Neither the scores, the probabilities, nor any [rows, T] gradient
      // of them is a tensor any more.
      for (const TensorDecl &d : p.tensors) {
        INFO(d.name);
        CHECK_FALSE((d.dims.size() == 2 && d.dims[0].is_dynamic() && d.dims[1].is_dynamic()));
      }
      // The forward keeps the log-sum-exp for the backward; the query's
      // part writes delta, which the key's reads.
      REQUIRE_FALSE(forward[0].lse.empty());
      CHECK(std::find(t.saved.begin(), t.saved.end(), forward[0].lse) != t.saved.end());
      CHECK(dq[0].lse == forward[0].lse);
      CHECK(dk[0].delta == dq[0].delta);
      CHECK(testing::step_index(p, dq[0].name) < testing::step_index(p, dk[0].name));
      CHECK(testing::step_index(p, forward[0].name) < t.forward_steps);
      // The gradients they write are the Funcs' (or the Inputs') own.
      const bool moa = std::string(name) == "moa";
      CHECK(dq[0].output == "d_q");
      CHECK(dk[0].output == (moa ? "d_key" : "d_k"));
      CHECK(dk[0].d_value == (moa ? "d_value" : "d_v"));
      CHECK(testing::reads_follow_writes(p));
    }
}

TEST_CASE("fused attention: training leaves the steps where a gradient has another share") {
  // The keys read twice: by the scores and by a second output, so the keys'
  // gradient adds that output's share, which the attention's backward does
  // not make. Nothing fuses, forward included, and the schedule says so.
  Dim T = Dim::dynamic("T"), D("D", 32);
  Var t("t", T), u("u", T), i("i", D);
  Input q("q", {T, D}), k("k", {T, D}), v("v", {T, D});
  Func p("p", DType::f32), out("out"), twice("twice");
  p(t, u) = softmax(u, sum(i, q(t, i) * k(u, i)) * 0.25);
  out(t, i) = sum(u, p(t, u) * v(u, i));
  twice(t, i) = k(t, i) * 2.0;
  Pipeline pipeline({out, twice});
  const Schedule s = default_schedule(pipeline, {out, twice}).fused_attention(true);
  const TrainingProgram tp = lower_training(pipeline, std::vector<Func>{out, twice}, s);
  CHECK(count_attention(tp.program) == 0);
  CHECK(tp.program.find("p") != nullptr);
  CHECK(has_note(tp.program, "fused_attention(true) is not applied"));
  // Without the second output the same attention fuses.
  Pipeline alone({out});
  const TrainingProgram fused = lower_training(alone, out, default_schedule(alone, {out}).fused_attention(true));
  CHECK(count_attention(fused.program) == 3);
}

TEST_CASE("fused attention: the schedule choice prints and replays") {
  Schedule s = Schedule("x").fused_attention(true);
  const std::string text = s.to_text();
  CHECK(text.find("fused_attention(true)") != std::string::npos);
  CHECK(Schedule::from_text(text).fused_attention());
}

TEST_CASE("fused attention: the routed rows in pair order (no padded_elementwise) fuse too") {
  Example ex = make_example("moa", attention_shape(37));
  const KernelProgram p = lower(ex.pipeline, fused(ex).padded_elementwise(false));
  REQUIRE(count_attention(p) == 1);
  CHECK(p.find("p") == nullptr);
}

#if MOEFORGE_HAVE_CPU_BACKEND
TEST_CASE("fused attention: the CPU backend's forward matches the reference at 1, 37 and 300 tokens") {
  for (const char *name : {"moa", "attention"})
    for (int64_t tokens : {1, 37, 300})
      for (bool padded : {true, false}) {
        ExampleShape s = attention_shape(tokens);
        Example ex = make_example(name, s);
        INFO(std::string(name) << " / T " << tokens << " / padded_elementwise " << padded);
        testing::Outcome o =
            cpu_test::run_and_compare(ex, ex.random_inputs(s, 31), tokens, fused(ex).padded_elementwise(padded));
        CHECK(o.routing_mismatches == 0);
        CHECK(o.worst_error <= 1e-2);
      }
}

TEST_CASE("fused attention: the CPU backend's training step matches the reference at 1, 37 and 300 tokens") {
  for (const char *name : {"moa", "attention"})
    for (int64_t tokens : {1, 37, 300})
      for (const char *preset : {"default", "megablocks", "scattermoe+lean", "scattermoe+recompute"}) {
        ExampleShape s = attention_shape(tokens);
        Example ex = make_example(name, s);
        INFO(std::string(name) << " / T " << tokens << " / " << std::string(preset));
        const Schedule schedule = fused_training(ex, preset);
        testing::Outcome o = cpu_test::cpu_train_and_compare(ex, ex.random_inputs(s, 29), tokens, schedule);
        CHECK(o.routing_mismatches == 0);
        CHECK(o.worst_error <= 2e-2);
      }
}
#endif
