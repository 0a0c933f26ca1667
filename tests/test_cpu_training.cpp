// Training on the LLVM CPU backend: training_algebra(layer, y) compiled as one
// program (forward, then every gradient: transposed operands, expert
// reductions, reductions over tokens) and checked against the float64 Eigen
// reference of the same algebra, Func by Func. Every intermediate and output
// is poisoned (NaN) before the run, so a kernel that writes nothing fails.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "backends/cpu/cpu_training.h"
#include "cpu_compare.h"
#include "dsl/error.h"
#include "dsl/training.h"
#include "examples/aux_loss_example.h"
#include "examples/norm_layers.h"
#include "lowering/default_schedule.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "runtime/program_shapes.h"
#include "training_compare.h"
#include "whole_gradient.h"

using namespace moeforge;
using namespace moeforge::cpu_test;

namespace {

// The algebra of one training step: the forward outputs and the gradients
// of every Input and Param, with the seeds (the outputs' upstream gradients)
// as extra Inputs.
struct Training {
  Pipeline pipeline;
  std::vector<std::string> gradients, seeds, outputs; // seeds[i] belongs to outputs[i]
};

// One output or several (a layer with its auxiliary losses): one seed each.
Training training_of(const Pipeline &forward, const std::vector<Func> &outputs) {
  TrainingAlgebra t = training_algebra(forward, outputs);
  return Training{t.pipeline, t.gradients, t.seeds, t.outputs};
}

Training training_of(const Example &ex) { return training_of(ex.pipeline, {ex.pipeline.func(ex.output)}); }

// The inputs plus a random upstream gradient ~ U(-1, 1) (f32) per output,
// shaped like it.
TensorMap with_seed_gradients(const Pipeline &forward, const Training &t, TensorMap inputs, uint64_t seed) {
  EvalResult y = evaluate(forward, inputs, Precision::f64);
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < t.seeds.size(); ++i)
    inputs[t.seeds[i]] = random_tensor(y[t.outputs[i]].shape, rng, -1.0, 1.0, /*bf16=*/false);
  return inputs;
}

// max |a - b| / max(max |b|, floor): the normalised error of layer_compare.h,
// except for gradients that are zero in exact arithmetic (the router's
// gradients when every token's gate is renormalised to 1), where the f64
// reference holds rounding noise (~1e-28) and the CPU exact zeros.
double gradient_error(const HostTensor &got, const HostTensor &ref, double floor = 1e-6) {
  REQUIRE(got.shape == ref.shape);
  double scale = floor, worst = 0;
  for (double v : ref.data)
    scale = std::max(scale, std::fabs(v));
  for (size_t i = 0; i < got.data.size(); ++i) {
    double d = std::fabs(got.data[i] - ref.data[i]);
    if (std::isnan(d))
      return INFINITY; // an element nothing wrote
    worst = std::max(worst, d);
  }
  return worst / scale;
}

struct TrainingOutcome {
  Outcome outcome; // worst_error: over the outputs, every gradient and every materialised intermediate
  std::vector<std::string> gradients;
};

// Compiles and runs training step t of `forward` (routed by `route`, empty
// for none) under `schedule` and compares every output, every gradient and
// every other materialised Func with the float64 reference.
TrainingOutcome train_and_compare(const Pipeline &forward, const std::string &route, const Training &t,
                                  const TensorMap &inputs, int64_t tokens, const Schedule &schedule,
                                  double tolerance = 2e-2) {
  TensorMap in = with_seed_gradients(forward, t, inputs, 17);
  cpu::CompiledCpuLayer compiled = cpu::compile_cpu_layer(t.pipeline, schedule);
  cpu::CpuLayer layer(compiled, tokens);
  layer.upload(in);
  layer.poison();
  layer.run();
  EvalResult ref = evaluate(t.pipeline, in, Precision::f64);
  TrainingOutcome out{{}, t.gradients};
  if (!route.empty()) {
    const RoutingResult &rr = ref.routes.at(route);
    std::vector<int32_t> got = layer.routed_experts(route);
    REQUIRE(got.size() == rr.expert.size());
    for (size_t p = 0; p < rr.expert.size(); ++p)
      out.outcome.routing_mismatches += got[p] != rr.expert[p];
    out.outcome.counts = rr.expert_counts();
  }
  for (const auto &[name, value] : ref.values) {
    if (!compiled.program.find(name))
      continue; // not materialised under this schedule (o when the gate is fused)
    double err = gradient_error(layer.download(name), value);
    INFO("Func " << name << " under\n" << schedule.to_text());
    CHECK(err <= tolerance);
    out.outcome.worst_error = std::max(out.outcome.worst_error, err);
    if (name == t.outputs[0])
      out.outcome.y_error = err;
  }
  // Every output and gradient is an output of the program, so the loop above saw it.
  for (const std::string &g : t.gradients)
    CHECK(compiled.program.find(g) != nullptr);
  for (const std::string &o : t.outputs)
    CHECK(compiled.program.find(o) != nullptr);
  return out;
}

TrainingOutcome train_and_compare(const Example &ex, const TensorMap &inputs, int64_t tokens,
                                  const Schedule &schedule) {
  return train_and_compare(ex.pipeline, ex.route, training_of(ex), inputs, tokens, schedule);
}

Schedule named(const std::string &preset_name, bool recompute) {
  Schedule s = preset(preset_name);
  if (recompute)
    s.recompute(true);
  return s;
}

// One forward and backward of `compiled` (poisoned first) on `in`, whose
// upstream gradient is in it: y within 1e-2 and every gradient within 2e-2
// of the float64 reference of the training algebra.
void check_step(const cpu::CompiledCpuTraining &compiled, const Example &ex, const Training &train, const TensorMap &in,
                int64_t tokens) {
  const TrainingProgram &tp = compiled.training;
  cpu::CpuTrainingLayer layer(compiled, tokens);
  layer.upload(in);
  layer.poison();
  layer.upload_upstream_gradient(in.at(tp.seed));
  layer.forward();
  layer.backward();
  EvalResult ref = evaluate(train.pipeline, in, Precision::f64);
  CHECK(gradient_error(layer.output(), ref[ex.output]) <= 1e-2);
  for (size_t i = 0; i < tp.of.size(); ++i) {
    INFO("gradient of " << tp.of[i]);
    CHECK(gradient_error(layer.gradient(tp.of[i]), ref[tp.gradients[i]]) <= 2e-2);
  }
}

} // namespace

TEST_SUITE("cpu") {
  TEST_CASE("cpu training: moe_mlp and swiglu_moe gradients match the reference under every preset") {
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (int64_t tokens : {64, 200})
        for (const char *p : {"megablocks", "scattermoe"})
          for (bool recompute : {false, true}) {
            ExampleShape s = shape(tokens, 64, 128, 8, 2);
            Example ex = make_example(name, s);
            TrainingOutcome o = train_and_compare(ex, ex.random_inputs(s, 11), s.tokens, named(p, recompute));
            INFO(name << " / T = " << tokens << " / " << p << (recompute ? " / recompute" : ""));
            CHECK(o.outcome.routing_mismatches == 0);
            CHECK(o.outcome.y_error <= 1e-2);
            CHECK(o.outcome.worst_error <= 2e-2);
            CHECK(o.gradients.size() == (std::string(name) == "moe_mlp" ? 4u : 5u)); // d_x d_wr d_w1 (d_w3) d_w2
          }
  }

  // Per-expert biases: d_b1(e, j) and d_b2(e, i) are sums over each
  // expert's rows (expert_sum of one matrix), element-wise loops, not GEMMs.
  TEST_CASE("cpu training: per-expert biases on both expert GEMMs train under every preset") {
    for (int64_t tokens : {64, 200})
      for (const char *p : {"megablocks", "scattermoe"})
        for (bool recompute : {false, true}) {
          ExampleShape s = shape(tokens, 64, 128, 8, 2);
          Example ex = make_example("expert_bias_moe", s);
          INFO("T = " << tokens << " / " << p << (recompute ? " / recompute" : ""));
          TrainingOutcome o = train_and_compare(ex, ex.random_inputs(s, 13), s.tokens, named(p, recompute));
          CHECK(o.outcome.routing_mismatches == 0);
          CHECK(o.outcome.worst_error <= 2e-2);
          CHECK(o.gradients.size() == 6u); // d_x d_wr d_w1 d_b1 d_w2 d_b2
          KernelProgram prog = lower(training_of(ex).pipeline, named(p, recompute));
          for (const char *b : {"d_b1", "d_b2"}) {
            bool pointwise = false;
            for (const Step &st : prog.steps)
              if (auto *pw = std::get_if<PointwiseStep>(&st))
                pointwise |= pw->output == b;
            CHECK_MESSAGE(pointwise, b << " is not an element-wise step");
          }
        }
  }

  TEST_CASE("cpu training: the GLU variants (GeGLU, ReGLU) train under every preset") {
    for (const char *name : {"geglu_moe", "reglu_moe"})
      for (const char *p : {"megablocks", "scattermoe"}) {
        ExampleShape s = shape(200, 64, 128, 8, 2);
        Example ex = make_example(name, s);
        TrainingOutcome o = train_and_compare(ex, ex.random_inputs(s, 16), s.tokens, named(p, false));
        INFO(name << " / " << p);
        CHECK(o.outcome.routing_mismatches == 0);
        CHECK(o.outcome.worst_error <= 2e-2);
        CHECK(o.gradients.size() == 5u); // d_x d_wr d_w1 d_w3 d_w2
      }
  }

  TEST_CASE("cpu training: the shared-expert MoE (routed SwiGLU + a sigmoid-gated shared expert) trains") {
    for (const char *p : {"megablocks", "scattermoe"})
      for (bool recompute : {false, true}) {
        ExampleShape s = shape(200, 64, 128, 8, 2);
        Example ex = make_example("shared_expert_moe", s);
        TrainingOutcome o = train_and_compare(ex, ex.random_inputs(s, 17), s.tokens, named(p, recompute));
        INFO(p << (recompute ? " / recompute" : ""));
        CHECK(o.outcome.routing_mismatches == 0);
        CHECK(o.outcome.worst_error <= 2e-2);
        CHECK(o.gradients.size() == 9u); // d_x d_wr d_w1 d_w3 d_w2 d_ws1 d_ws3 d_ws2 d_wsg
      }
  }

  // deepseek_moe: group-limited top-k (16 experts in 8 groups of 2, the best
  // 4 kept), a selection-only bias (no gradient reaches it), scaled sigmoid
  // gates; rmsnorm_moe: an RMSNorm prologue before the router and experts.
  TEST_CASE("cpu training: deepseek_moe and rmsnorm_moe train") {
    struct Case {
      const char *name;
      int64_t experts, k;
      size_t gradients;
    };
    for (Case c : {Case{"deepseek_moe", 16, 4, 5}, Case{"rmsnorm_moe", 8, 2, 5}})
      for (const char *p : {"megablocks", "scattermoe"})
        for (bool recompute : {false, true}) {
          ExampleShape s = shape(200, 64, 128, c.experts, c.k);
          Example ex = make_example(c.name, s);
          TrainingOutcome o = train_and_compare(ex, ex.random_inputs(s, 23), s.tokens, named(p, recompute));
          INFO(c.name << " / " << p << (recompute ? " / recompute" : ""));
          CHECK(o.outcome.routing_mismatches == 0);
          CHECK(o.outcome.worst_error <= 2e-2);
          CHECK(o.gradients.size() == c.gradients); // deepseek: x wr w1 w3 w2; rmsnorm: x g wr w1 w2
        }
  }

  TEST_CASE("cpu training: extents that are not multiples of 8 (E 6, d 100, f 60) train") {
    for (const char *name : {"moe_mlp", "swiglu_moe"}) {
      ExampleShape s = shape(150, 100, 60, 6, 2);
      Example ex = make_example(name, s);
      TrainingOutcome o = train_and_compare(ex, ex.random_inputs(s, 22), s.tokens, named("scattermoe", false));
      INFO(name);
      CHECK(o.outcome.routing_mismatches == 0);
      CHECK(o.outcome.worst_error <= 2e-2);
    }
  }

  TEST_CASE("cpu training: attention's gradients (GEMMs over dynamic column extents) match the reference") {
    for (int64_t tokens : {1, 37, 300})
      for (const char *p : {"megablocks", "scattermoe+lean"}) {
        ExampleShape s = shape(tokens, 64, 128, 1, 1);
        Example ex = make_example("attention", s);
        TrainingOutcome o = train_and_compare(ex, ex.random_inputs(s, 6), s.tokens, testing::training_preset(p, false));
        INFO("T " << tokens << " / " << p);
        CHECK(o.outcome.worst_error <= 2e-2);
        CHECK(o.gradients.size() == 3u); // d_q, d_k, d_v
      }
  }

  // Mixture-of-Attention: the keys' and values' gradients are dense GEMMs
  // reducing over every routed pair (dK = dS^T Q), whose routed operands
  // must be read in pair order under either permutation; T = 1 and a T that
  // is no multiple of the block as well.
  TEST_CASE("cpu training: moa (Mixture-of-Attention) trains") {
    for (int64_t tokens : {1, 37, 200})
      for (const char *p : {"megablocks", "scattermoe", "scattermoe+lean"})
        for (bool recompute : {false, true}) {
          ExampleShape s = shape(tokens, 64, 32, 8, 2);
          Example ex = make_example("moa", s);
          TrainingOutcome o =
              train_and_compare(ex, ex.random_inputs(s, 29), s.tokens, testing::training_preset(p, recompute));
          INFO("T " << tokens << " / " << p << (recompute ? " / recompute" : ""));
          CHECK(o.outcome.routing_mismatches == 0);
          CHECK(o.outcome.worst_error <= 2e-2);
          CHECK(o.gradients.size() == 6u); // d_x d_wr d_wq d_wk d_wv d_wo
        }
  }

  TEST_CASE("cpu training: RMSNorm's gradients (through sqrt and rsqrt) match the reference") {
    ExampleShape s = shape(150, 64, 128, 1, 1);
    Example ex = rmsnorm_layer(s);
    TrainingOutcome o = train_and_compare(ex, ex.random_inputs(s, 4), s.tokens, preset("megablocks"));
    CHECK(o.outcome.worst_error <= 1e-4); // f32 throughout
    CHECK(o.gradients.size() == 2u);      // d_x, d_g
  }

  TEST_CASE("cpu training: the dense MLP (no routing) gradients match the reference") {
    ExampleShape s = shape(150, 64, 128, 1, 1);
    Example ex = make_example("dense_mlp", s);
    for (const char *p : {"megablocks", "scattermoe"})
      for (bool recompute : {false, true}) {
        TrainingOutcome o = train_and_compare(ex, ex.random_inputs(s, 5), s.tokens, named(p, recompute));
        INFO(p << (recompute ? " / recompute" : ""));
        CHECK(o.outcome.worst_error <= 2e-2);
        CHECK(!o.gradients.empty());
      }
  }

  TEST_CASE("cpu training: MoE edge cases (empty expert and one busy expert and ragged tails)") {
    for (const testing::EdgeCase &c : testing::edge_cases(64, 128)) {
      if (c.bias == Bias::ramp || c.s.topk == c.s.experts)
        continue; // the forward tests cover these; keep the training sweep short
      for (const char *p : {"megablocks", "scattermoe"}) {
        Example ex = biased_moe(c.s, c.swiglu, c.bias, c.swiglu);
        TensorMap in = biased_inputs(ex, c.s, c.bias, 3);
        TrainingOutcome o = train_and_compare(ex, in, c.s.tokens, named(p, false));
        INFO(std::string(c.what) << " / " << p);
        CHECK(o.outcome.routing_mismatches == 0);
        CHECK(o.outcome.worst_error <= 2e-2);
        testing::check_edge_routing(c, o.outcome);
      }
    }
  }

  TEST_CASE("cpu training: the MoE edge cases in the lean memory mode, checked as the GPU checks them") {
    // The GPU test's presets, seeds and comparison (training_compare.h) on
    // the backend that rounds as the GPU does, so a tolerance question shows
    // up here first, in CI.
    testing::check_edge_cases(64, 128,
                              {"megablocks+lean", "scattermoe+padded+lean", "scattermoe+padded+lean+chain",
                               "scattermoe+padded+lean+chain+split", "scattermoe+padded+lean+chain+upstream+boundary"},
                              [](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &p) {
                                return cpu_train_and_compare(ex, in, tokens, testing::training_preset(p, false));
                              });
  }

  TEST_CASE("cpu training: the auxiliary losses (reductions over tokens and extent(T)) and their gradients") {
    // lb_loss and z_loss are 0-D Funcs of sums over the tokens and pairs
    // divided by extent(T) or extent(pairs): reductions with no free index.
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (const char *p : {"megablocks", "scattermoe"}) {
        ExampleShape s = shape(150, 64, 128, 8, 2);
        AuxLossLayer a = make_aux_loss_example(name, s);
        Training t = training_of(a.example.pipeline, a.output_funcs());
        REQUIRE(t.seeds.size() == 3);
        TrainingOutcome o = train_and_compare(a.example.pipeline, a.example.route, t, a.example.random_inputs(s, 8),
                                              s.tokens, preset(p));
        INFO(name << " / " << p);
        CHECK(o.outcome.routing_mismatches == 0);
        CHECK(o.outcome.worst_error <= 2e-2);
      }
  }

  TEST_CASE("cpu training: outputs and gradients lowered as one program (lower and its fusions) match the reference") {
    // The whole gradient algebra through lower(), not lower_training: the
    // element-wise fusions then see the backward's steps beside the
    // forward's, and a step reading a reduction of a GEMM's output (the
    // z-loss's exp(logits - max)) must not move into that GEMM's epilogue.
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (const char *p : {"megablocks", "scattermoe"}) {
        ExampleShape s = shape(150, 64, 128, 8, 2);
        testing::WholeGradient w = testing::outputs_and_gradients(make_aux_loss_example(name, s), s);
        const Example &t = w.example;
        const TensorMap &in = w.inputs;
        INFO(name << " / " << p);
        cpu::CompiledCpuLayer c = cpu::compile_cpu_layer(t.pipeline, preset(p));
        cpu::CpuLayer layer(c, s.tokens);
        layer.upload(in);
        layer.poison();
        layer.run();
        // Exactly-zero router gradients compare against a floor (test_cuda_training.cpp).
        Outcome o = testing::compare_with_reference(t, in, c.program, layer, p, 2e-2, 1e-3);
        CHECK(o.routing_mismatches == 0);
      }
  }

  TEST_CASE("cpu training: dense transposes are exact copies of their sources") {
    // The weights' transposes are downloadable (dense layouts): each must be
    // the input with its last two dims swapped, bit for bit.
    ExampleShape s = shape(40, 64, 96, 8, 2);
    Example ex = make_example("swiglu_moe", s);
    Training train = training_of(ex);
    TensorMap in = with_seed_gradients(ex.pipeline, train, ex.random_inputs(s, 4), 9);
    // mma.sync GEMMs read B as [K, N]: the weights' transposes are written
    // (the wgmma loops read them in place instead).
    Schedule sync = preset("scattermoe");
    sync.mma("*", MmaKind::mma_sync);
    cpu::CompiledCpuLayer compiled = cpu::compile_cpu_layer(train.pipeline, sync);
    cpu::CpuLayer layer(compiled, s.tokens);
    layer.upload(in);
    layer.poison();
    layer.run();
    int checked = 0;
    for (const char *src : {"x", "wr", "w1", "w2", "w3"}) {
      std::string dst = std::string(src) + "_T";
      if (!compiled.program.find(dst))
        continue;
      const HostTensor &a = in.at(src);
      HostTensor t = layer.download(dst);
      size_t n = a.shape.size();
      REQUIRE(t.shape.size() == n);
      CHECK(t.shape[n - 1] == a.shape[n - 2]);
      CHECK(t.shape[n - 2] == a.shape[n - 1]);
      int64_t rows = a.shape[n - 2], cols = a.shape[n - 1], lead = a.size() / (rows * cols);
      int64_t wrong = 0;
      for (int64_t l = 0; l < lead; ++l)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c)
            wrong += t.data[(l * cols + c) * rows + r] != a.data[(l * rows + r) * cols + c];
      INFO(dst);
      CHECK(wrong == 0);
      ++checked;
    }
    CHECK(checked >= 4); // x_T (K = T), wr_T, w1_T, w2_T, w3_T
  }

  TEST_CASE("cpu training: the lowered program has the backward's new steps") {
    ExampleShape s = shape(64, 64, 128, 8, 2);
    Example ex = make_example("moe_mlp", s);
    Schedule sync = preset("megablocks");
    sync.mma("*", MmaKind::mma_sync);
    std::string ir = cpu::cpu_llvm_ir(training_of(ex).pipeline, sync);
    CHECK(ir.find("define void @moeforge_transpose_w1_T(ptr") != std::string::npos);
    CHECK(ir.find("define void @moeforge_transpose_x_T_route(ptr") != std::string::npos);
    CHECK(ir.find("define void @moeforge_gemm_d_w1(ptr") != std::string::npos);
    CHECK(ir.find("define void @moeforge_gemm_d_wr(ptr") != std::string::npos);
  }

  TEST_CASE("cpu training: forward and backward as two entry points, and a second backward on the saved state") {
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (const char *p : {"megablocks", "scattermoe"})
        for (bool recompute : {false, true}) {
          INFO(name << " / " << p << (recompute ? " / recompute" : ""));
          ExampleShape s = shape(150, 64, 128, 8, 2);
          Example ex = make_example(name, s);
          Training train = training_of(ex);
          TensorMap in = with_seed_gradients(ex.pipeline, train, ex.random_inputs(s, 12), 21);
          cpu::CompiledCpuTraining compiled =
              cpu::compile_cpu_training(ex.pipeline, ex.pipeline.func(ex.output), named(p, recompute));
          const TrainingProgram &tp = compiled.training;
          REQUIRE(tp.seed == train.seeds[0]);
          REQUIRE(tp.gradients.size() == tp.of.size());
          cpu::CpuTrainingLayer layer(compiled, s.tokens);
          layer.upload(in); // the upstream gradient goes separately
          layer.poison();
          layer.upload_upstream_gradient(in.at(tp.seed));
          layer.forward();
          EvalResult ref = evaluate(train.pipeline, in, Precision::f64);
          CHECK(gradient_error(layer.output(), ref[ex.output]) <= 1e-2);
          // The forward writes no gradient: asking for one is an error, not
          // the poison (or zeros).
          for (const std::string &of : tp.of)
            CHECK_THROWS_WITH_AS(layer.gradient(of), doctest::Contains("no step has computed"), UserError);
          layer.backward();
          std::map<std::string, HostTensor> first;
          for (size_t i = 0; i < tp.of.size(); ++i) {
            INFO("gradient of " << tp.of[i]);
            first[tp.of[i]] = layer.gradient(tp.of[i]);
            CHECK(gradient_error(first[tp.of[i]], ref[tp.gradients[i]]) <= 2e-2);
          }
          CHECK(layer.routed_experts(ex.route) == ref.routes.at(ex.route).expert);
          // A new upstream gradient, the same forward: the backward reuses the
          // saved activations and routing.
          std::mt19937_64 rng(33);
          in[tp.seed] = random_tensor(in.at(tp.seed).shape, rng, -1.0, 1.0, /*bf16=*/false);
          layer.upload_upstream_gradient(in.at(tp.seed));
          layer.backward();
          EvalResult ref2 = evaluate(train.pipeline, in, Precision::f64);
          CHECK(gradient_error(layer.output(), ref2[ex.output]) <= 1e-2);
          for (size_t i = 0; i < tp.of.size(); ++i) {
            INFO("second backward: gradient of " << tp.of[i]);
            HostTensor g = layer.gradient(tp.of[i]);
            CHECK(gradient_error(g, ref2[tp.gradients[i]]) <= 2e-2);
            if (tp.of[i] == "x" || tp.of[i] == "w2")
              CHECK(g.data != first[tp.of[i]].data);
          }
          CHECK(layer.saved_bytes() == saved_bytes(tp, s.tokens));
          CHECK(layer.saved_bytes() > 0);
        }
  }

  TEST_CASE("cpu training: bf16_activations stores the introduced routed tensors in bf16, within tolerance") {
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (bool recompute : {false, true}) {
        INFO(name << (recompute ? " / recompute" : ""));
        ExampleShape s = shape(150, 64, 128, 8, 2);
        Example ex = make_example(name, s);
        Training train = training_of(ex);
        TensorMap in = with_seed_gradients(ex.pipeline, train, ex.random_inputs(s, 14), 23);
        Schedule f32 = named("scattermoe", recompute), bf16 = named("scattermoe", recompute);
        bf16.bf16_activations(true);
        CHECK(Schedule::from_text(bf16.to_text()).bf16_activations());
        TrainingProgram wide = lower_training(ex.pipeline, ex.pipeline.func(ex.output), f32);
        cpu::CompiledCpuTraining compiled = cpu::compile_cpu_training(ex.pipeline, ex.pipeline.func(ex.output), bf16);
        const TrainingProgram &tp = compiled.training;
        // The routed matrices autodiff introduced are bf16 now; the gates,
        // the gradients the caller reads and the inputs are not.
        int narrowed = 0;
        for (const TensorDecl &d : tp.program.tensors) {
          const TensorDecl &before = wide.program.tensor(d.name);
          if (before.dtype == d.dtype)
            continue;
          ++narrowed;
          CHECK(d.dtype == DType::bf16);
          CHECK(d.route != nullptr);
          CHECK(d.dims.size() == 2);
        }
        CHECK(narrowed >= 2); // the pre-activation and the per-pair gradient d_h at least
        CHECK(tp.program.tensor("d_h").dtype == DType::bf16);
        CHECK(tp.program.tensor("route_gate").dtype == DType::f32);
        for (const std::string &g : tp.gradients)
          CHECK(tp.program.tensor(g).dtype == wide.program.tensor(g).dtype);
        if (!recompute)
          CHECK(saved_bytes(tp, s.tokens) < saved_bytes(wide, s.tokens));
        check_step(compiled, ex, train, in, s.tokens);
      }
  }

  TEST_CASE("cpu training: y, dy and dx in bf16 (bf16_boundary), dy gathered in the GEMMs, within tolerance") {
    // Every example the default trains, under the default (bf16_boundary
    // and dy's rows gathered in the GEMMs, on), with dy's rows copied per
    // pair, with the boundary f32, and with the input gradient added up
    // atomically and x's rows gathered too (atomic_input_gradient,
    // gather_in_gemms: the backward's least memory).
    ExampleShape s = shape(150, 64, 128, 8, 2);
    for (const char *name : {"moe_mlp", "swiglu_moe", "geglu_moe", "shared_expert_moe", "deepseek_moe"})
      for (int mode : {0, 1, 2, 3}) {
        Example ex = make_example(name, s);
        const Func out = ex.pipeline.func(ex.output);
        Schedule sch = default_schedule(ex.pipeline, {out});
        REQUIRE(sch.bf16_boundary());
        REQUIRE(sch.gather_upstream_in_gemms());
        sch.gather_upstream_in_gemms(mode != 1).bf16_boundary(mode != 2);
        if (mode == 3)
          sch.gather_upstream_in_gemms(false).atomic_input_gradient(true).gather_in_gemms(true);
        INFO(name << " / mode " << mode);
        Outcome o = cpu_train_and_compare(ex, ex.random_inputs(s, 19), s.tokens, sch);
        CHECK(o.routing_mismatches == 0);
      }
  }

  TEST_CASE("cpu training: bf16_weight_gradients stores the expert weights' gradients in bf16, within tolerance") {
    ExampleShape s = shape(150, 64, 128, 8, 2);
    Example ex = make_example("swiglu_moe", s);
    Training train = training_of(ex);
    TensorMap in = with_seed_gradients(ex.pipeline, train, ex.random_inputs(s, 15), 25);
    Schedule sch = named("scattermoe", false);
    sch.bf16_weight_gradients(true);
    CHECK(Schedule::from_text(sch.to_text()).bf16_weight_gradients());
    cpu::CompiledCpuTraining compiled = cpu::compile_cpu_training(ex.pipeline, ex.pipeline.func(ex.output), sch);
    const TrainingProgram &tp = compiled.training;
    for (const char *g : {"d_w1", "d_w3", "d_w2"})
      CHECK(tp.program.tensor(g).dtype == DType::bf16);
    CHECK(tp.program.tensor("d_wr").dtype == DType::f32); // the router's: split-K adds into f32
    CHECK(tp.program.tensor("d_x").dtype == DType::f32);
    check_step(compiled, ex, train, in, s.tokens);
  }

  TEST_CASE("cpu training: padded_elementwise (GEMM-read element-wise results in the padded order) trains") {
    // Every example with routing, blocked and scattered, with and without
    // recompute: the lowered program differs (padded tensors, direct row
    // maps), the gradients must not.
    ExampleShape s = shape(150, 64, 128, 8, 2);
    for (const char *name : {"moe_mlp", "swiglu_moe", "geglu_moe", "expert_bias_moe"})
      for (const char *p : {"megablocks", "scattermoe"})
        for (bool recompute : {false, true}) {
          INFO(name << " / " << p << (recompute ? " / recompute" : ""));
          Example ex = make_example(name, s);
          Training train = training_of(ex);
          TensorMap in = with_seed_gradients(ex.pipeline, train, ex.random_inputs(s, 16), 26);
          Schedule sch = named(p, recompute);
          sch.padded_elementwise(true);
          CHECK(Schedule::from_text(sch.to_text()).padded_elementwise());
          cpu::CompiledCpuTraining compiled = cpu::compile_cpu_training(ex.pipeline, ex.pipeline.func(ex.output), sch);
          const KernelProgram &prog = compiled.training.program;
          // The per-pair gradient the second expert GEMM's backward reads.
          CHECK(prog.tensor("d_o").layout == RowLayout::padded);
          CHECK(prog.tensor("d_o").zero_padding);
          check_step(compiled, ex, train, in, s.tokens);
        }
  }

  TEST_CASE("cpu training: recompute_elementwise keeps the pre-activations only and trains") {
    // The activation's output h is made again in the backward from the
    // pre-activation(s) the forward GEMM stores; it is no longer kept. With
    // and without padded_elementwise, blocked and scattered.
    ExampleShape s = shape(150, 64, 128, 8, 2);
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (const char *p : {"megablocks", "scattermoe"})
        for (bool padded : {false, true}) {
          INFO(name << " / " << p << (padded ? " / padded_elementwise" : ""));
          Example ex = make_example(name, s);
          Training train = training_of(ex);
          TensorMap in = with_seed_gradients(ex.pipeline, train, ex.random_inputs(s, 17), 27);
          Schedule sch = named(p, false);
          sch.padded_elementwise(padded).recompute_elementwise(true);
          CHECK(Schedule::from_text(sch.to_text()).recompute_elementwise());
          cpu::CompiledCpuTraining compiled = cpu::compile_cpu_training(ex.pipeline, ex.pipeline.func(ex.output), sch);
          const TrainingProgram &tp = compiled.training;
          CHECK(std::find(tp.saved.begin(), tp.saved.end(), "h") == tp.saved.end());
          CHECK(tp.program.find("h_re") != nullptr);
          check_step(compiled, ex, train, in, s.tokens);
        }
  }

  TEST_CASE("cpu training: gate_gradient_from_dh keeps no expert outputs and trains") {
    // The gate's gradient <dy, o> taken as <dy W2^T, h> from the dH GEMM: o
    // (T*k x d) is no longer kept, d_h is stored without the gate's scale.
    // With every way of keeping h (stored, made again element-wise, whole
    // recompute), blocked and scattered, T not a multiple of the block and
    // T = 1; a shared expert beside the routed ones.
    for (const char *name : {"moe_mlp", "swiglu_moe", "shared_expert_moe"})
      for (const char *p : {"megablocks", "scattermoe"})
        for (int keep : {0, 1, 2})
          for (int64_t tokens : {150, 1}) {
            if (tokens == 1 && keep != 1)
              continue;
            INFO(name << " / " << p << " / keep " << keep << " / T = " << tokens);
            ExampleShape s = shape(tokens, 64, 128, 8, 2);
            Example ex = make_example(name, s);
            Training train = training_of(ex);
            TensorMap in = with_seed_gradients(ex.pipeline, train, ex.random_inputs(s, 19), 29);
            Schedule sch = named(p, keep == 2);
            sch.padded_elementwise(keep == 1).recompute_elementwise(keep == 1).gate_gradient_from_dh(true);
            CHECK(Schedule::from_text(sch.to_text()).gate_gradient_from_dh());
            cpu::CompiledCpuTraining compiled =
                cpu::compile_cpu_training(ex.pipeline, ex.pipeline.func(ex.output), sch);
            const TrainingProgram &tp = compiled.training;
            CHECK(std::find(tp.saved.begin(), tp.saved.end(), "o") == tp.saved.end());
            CHECK(tp.program.find("d_h_ungated") != nullptr);
            CHECK(tp.program.find("d_h") == nullptr);
            check_step(compiled, ex, train, in, s.tokens);
          }
  }

  TEST_CASE("cpu training: chain_summed_gemms runs SwiGLU's input-gradient GEMMs as one and trains") {
    // d_x = combine(dH1 W1^T) + combine(dH3 W3^T): one GEMM over both
    // reductions (GemmStep::chained), so one per-pair tensor of width d.
    // GeLU's layer has one such product and stays as it is. Blocked and
    // scattered, padded_elementwise and the lean mode, T = 150 and T = 1.
    for (const char *name : {"swiglu_moe", "moe_mlp"})
      for (const char *p : {"megablocks", "scattermoe"})
        for (int mode : {0, 1, 2})
          for (int64_t tokens : {150, 1}) {
            if (tokens == 1 && mode != 2)
              continue;
            INFO(name << " / " << p << " / mode " << mode << " / T = " << tokens);
            ExampleShape s = shape(tokens, 64, 128, 8, 2);
            Example ex = make_example(name, s);
            Training train = training_of(ex);
            TensorMap in = with_seed_gradients(ex.pipeline, train, ex.random_inputs(s, 23), 31);
            Schedule sch = named(p, false);
            sch.padded_elementwise(mode >= 1).recompute_elementwise(mode == 2).gate_gradient_from_dh(mode == 2);
            sch.chain_summed_gemms(true);
            CHECK(Schedule::from_text(sch.to_text()).chain_summed_gemms());
            cpu::CompiledCpuTraining compiled =
                cpu::compile_cpu_training(ex.pipeline, ex.pipeline.func(ex.output), sch);
            int chained = 0;
            for (const Step &st : compiled.training.program.steps)
              if (const auto *g = std::get_if<GemmStep>(&st); g && g->chained)
                ++chained;
            CHECK(chained == (std::string(name) == "swiglu_moe" ? 1 : 0));
            check_step(compiled, ex, train, in, s.tokens);
          }
  }

  TEST_CASE("cpu training: the backward's memory choices (atomic_combine, gather_in_gemms) train") {
    // The input gradient added atomically onto the router's share (one
    // writer, then the experts' adds), dy's and x's rows gathered inside the
    // GEMMs instead of copied in the padded order; the default schedule and
    // the lean mode of both presets, T = 150 and T = 1.
    for (const char *name : {"swiglu_moe", "moe_mlp"})
      for (const char *p : {"default", "megablocks", "scattermoe"})
        for (int64_t tokens : {150, 1}) {
          INFO(name << " / " << p << " / T = " << tokens);
          ExampleShape s = shape(tokens, 64, 128, 8, 2);
          Example ex = make_example(name, s);
          Training train = training_of(ex);
          TensorMap in = with_seed_gradients(ex.pipeline, train, ex.random_inputs(s, 29), 37);
          const Func out = ex.pipeline.func(ex.output);
          Schedule sch = p == std::string("default") ? default_schedule(ex.pipeline, {out}) : named(p, false);
          if (p != std::string("default"))
            sch.padded_elementwise(true).recompute_elementwise(true).gate_gradient_from_dh(true).chain_summed_gemms(
                true);
          sch.atomic_combine(true).gather_in_gemms(true);
          CHECK(Schedule::from_text(sch.to_text()).gather_in_gemms());
          cpu::CompiledCpuTraining compiled = cpu::compile_cpu_training(ex.pipeline, out, sch);
          check_step(compiled, ex, train, in, s.tokens);
        }
  }

  TEST_CASE("cpu training: gradient() of an unknown name and backward() before forward() are user errors") {
    ExampleShape s = shape(32, 64, 128, 8, 2);
    Example ex = make_example("moe_mlp", s);
    cpu::CompiledCpuTraining compiled =
        cpu::compile_cpu_training(ex.pipeline, ex.pipeline.func(ex.output), preset("megablocks"));
    cpu::CpuTrainingLayer layer(compiled, s.tokens);
    TensorMap in = ex.random_inputs(s, 2);
    layer.upload(in);
    CHECK_THROWS_WITH_AS(layer.gradient("nope"),
                         doctest::Contains("no gradient for 'nope': the layer's output depends on x, wr, w1, w2"),
                         UserError);
    CHECK_THROWS_WITH_AS(layer.backward(), doctest::Contains("backward() before forward()"), UserError);
    CHECK_THROWS_WITH_AS(layer.backward(), doctest::Contains("run forward() first"), UserError);
    HostTensor dy({s.tokens, s.d});
    layer.upload_upstream_gradient(dy);
    layer.forward();
    CHECK_NOTHROW(layer.backward());
    // New inputs make the saved activations stale.
    layer.upload(in);
    CHECK_THROWS_WITH_AS(layer.backward(), doctest::Contains("run forward() first"), UserError);
    TensorMap missing = in;
    missing.erase("w2");
    CHECK_THROWS_WITH_AS(layer.upload(missing), doctest::Contains("no tensor given for input 'w2'"), UserError);
  }

  TEST_CASE("cpu training: moe_mlp and swiglu_moe with the auxiliary losses through CpuTrainingLayer") {
    // Three outputs (y, lb_loss, z_loss), three seeds: d_y random, the
    // losses' 0-D seeds 1.0 (the losses join the training loss as they are).
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (const char *p : {"megablocks", "scattermoe"})
        for (bool recompute : {false, true}) {
          INFO(name << " / " << p << (recompute ? " / recompute" : ""));
          ExampleShape s = shape(150, 64, 128, 8, 2);
          AuxLossLayer a = make_aux_loss_example(name, s);
          const Pipeline &forward = a.example.pipeline;
          cpu::CompiledCpuTraining compiled = cpu::compile_cpu_training(forward, a.output_funcs(), named(p, recompute));
          const TrainingProgram &tp = compiled.training;
          REQUIRE(tp.outputs == std::vector<std::string>{"y", "lb_loss", "z_loss"});
          REQUIRE(tp.seeds == std::vector<std::string>{"d_y", "d_lb_loss", "d_z_loss"});
          CHECK(tp.output == "y");
          CHECK(tp.seed == "d_y");
          TensorMap in = a.example.random_inputs(s, 8);
          std::mt19937_64 rng(41);
          in["d_y"] = random_tensor({s.tokens, s.d}, rng, -1.0, 1.0, /*bf16=*/false);
          in["d_lb_loss"] = HostTensor(std::vector<int64_t>{}, 1.0);
          in["d_z_loss"] = HostTensor(std::vector<int64_t>{}, 1.0);
          cpu::CpuTrainingLayer layer(compiled, s.tokens);
          layer.upload(in);
          layer.poison();
          for (size_t k = 0; k < tp.outputs.size(); ++k)
            layer.upload_upstream_gradient(tp.outputs[k], in.at(tp.seeds[k]));
          layer.forward();
          layer.backward();
          EvalResult ref = evaluate(training_algebra(forward, a.output_funcs()).pipeline, in, Precision::f64);
          CHECK(layer.routed_experts(a.example.route) == ref.routes.at(a.example.route).expert);
          for (const std::string &o : tp.outputs) {
            INFO("output " << o);
            CHECK(gradient_error(layer.output(o), ref[o]) <= 1e-2);
          }
          CHECK(layer.output().data == layer.output("y").data);
          CHECK(layer.output("lb_loss").shape.empty());
          for (size_t i = 0; i < tp.of.size(); ++i) {
            INFO("gradient of " << tp.of[i]);
            CHECK(gradient_error(layer.gradient(tp.of[i]), ref[tp.gradients[i]]) <= 2e-2);
          }
          // The losses reach the router: d_wr differs from y's alone.
          in["d_lb_loss"] = HostTensor(std::vector<int64_t>{}, 0.0);
          in["d_z_loss"] = HostTensor(std::vector<int64_t>{}, 0.0);
          HostTensor with_losses = layer.gradient("wr");
          layer.upload_upstream_gradient("lb_loss", in.at("d_lb_loss"));
          layer.upload_upstream_gradient("z_loss", in.at("d_z_loss"));
          layer.backward();
          EvalResult ref0 = evaluate(training_algebra(forward, a.output_funcs()).pipeline, in, Precision::f64);
          CHECK(gradient_error(layer.gradient("wr"), ref0["d_wr"]) <= 2e-2);
          CHECK(layer.gradient("wr").data != with_losses.data);
        }
  }

  TEST_CASE("cpu training: a missing upstream gradient and an unknown output are user errors") {
    ExampleShape s = shape(32, 64, 128, 8, 2);
    AuxLossLayer a = make_aux_loss_example("moe_mlp", s);
    cpu::CompiledCpuTraining compiled =
        cpu::compile_cpu_training(a.example.pipeline, a.output_funcs(), preset("megablocks"));
    cpu::CpuTrainingLayer layer(compiled, s.tokens);
    layer.upload(a.example.random_inputs(s, 2));
    layer.poison();
    HostTensor dy({s.tokens, s.d}), one(std::vector<int64_t>{}, 1.0);
    layer.upload_upstream_gradient(dy); // the first output's: y
    layer.forward();
    CHECK_THROWS_WITH_AS(layer.backward(),
                         doctest::Contains("backward() without the upstream gradient of output 'lb_loss' (input "
                                           "'d_lb_loss'): call upload_upstream_gradient(\"lb_loss\", ...) first"),
                         UserError);
    layer.upload_upstream_gradient("lb_loss", one);
    CHECK_THROWS_WITH_AS(layer.backward(), doctest::Contains("upstream gradient of output 'z_loss'"), UserError);
    layer.upload_upstream_gradient("z_loss", one);
    CHECK_NOTHROW(layer.backward());
    // poison() forgets them all.
    layer.poison();
    layer.forward();
    CHECK_THROWS_WITH_AS(layer.backward(), doctest::Contains("upstream gradient of output 'y' (input 'd_y')"),
                         UserError);
    // Unknown outputs name the known ones.
    CHECK_THROWS_WITH_AS(layer.upload_upstream_gradient("loss", one),
                         doctest::Contains("upload_upstream_gradient: no output 'loss': the training step's outputs "
                                           "are 'y', 'lb_loss', 'z_loss'"),
                         UserError);
    CHECK_THROWS_WITH_AS(layer.output("d_y"), doctest::Contains("output(): no output 'd_y'"), UserError);
    // One output: the one-argument form and the output's name agree.
    Example ex = make_example("moe_mlp", s);
    cpu::CompiledCpuTraining single =
        cpu::compile_cpu_training(ex.pipeline, ex.pipeline.func(ex.output), preset("megablocks"));
    cpu::CpuTrainingLayer one_output(single, s.tokens);
    one_output.upload(ex.random_inputs(s, 2));
    one_output.forward();
    CHECK_THROWS_WITH_AS(one_output.backward(), doctest::Contains("upstream gradient of output 'y'"), UserError);
    one_output.upload_upstream_gradient("y", dy);
    CHECK_NOTHROW(one_output.backward());
    CHECK_THROWS_WITH_AS(one_output.upload_upstream_gradient("lb_loss", one),
                         doctest::Contains("the training step's outputs are 'y'"), UserError);
  }
}
