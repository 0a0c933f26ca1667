// The router's work moved into the routing (lower.h: gate_from_routing,
// softmax_into_routing): which programs lose the softmax and gate steps and
// which keep them, the CPU backend against the reference and against the
// unfused program bit for bit, and (on a GPU) the device top-k taking the
// softmax itself.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "dsl/losses.h"
#include "dsl/ops.h"
#include "examples/biased_moe.h"
#include "examples/examples.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "runtime/program_shapes.h"
#include "schedules/presets.h"

#ifdef MOEFORGE_HAVE_CPU_BACKEND
#include "cpu_compare.h"
#endif
#ifdef MOEFORGE_HAVE_CUDA
#include "backends/cuda/runtime/layer.h"
#include "backends/cuda/runtime/routing_kernels.h"
#include "gpu_test.h"
#include "host_softmax.h"
#endif

using namespace moeforge;

namespace {

ExampleShape moe_shape(int64_t tokens, int64_t experts, int64_t k) {
  ExampleShape s;
  s.tokens = tokens;
  s.d = 64;
  s.f = 128;
  s.experts = experts;
  s.topk = k;
  return s;
}

const RoutingStep &routing_step(const KernelProgram &p) {
  auto it = std::find_if(p.steps.begin(), p.steps.end(),
                         [](const Step &s) { return std::holds_alternative<RoutingStep>(s); });
  REQUIRE(it != p.steps.end());
  return std::get<RoutingStep>(*it);
}

const PointwiseStep *pointwise_writing(const KernelProgram &p, const std::string &name) {
  for (const Step &st : p.steps)
    if (auto *pw = std::get_if<PointwiseStep>(&st); pw && pw->output == name)
      return pw;
  return nullptr;
}

// Every tensor a step reads is an input or written by an earlier step, every
// other tensor is written by some step, and ProgramShapes sizes them all.
void check_consistent(const KernelProgram &p) {
  std::set<std::string> ready, written;
  for (const TensorDecl &d : p.tensors)
    if (d.is_input)
      ready.insert(d.name);
  for (const Step &st : p.steps) {
    std::set<std::string> accumulators; // a GEMM's placeholders, not tensors
    if (auto *g = std::get_if<GemmStep>(&st))
      for (const FuncPtr &a : g->accumulators)
        accumulators.insert(a->name);
    for (const std::string &r : step_reads(st)) {
      if (accumulators.count(r))
        continue;
      CHECK_MESSAGE(p.find(r) != nullptr, step_name(st) << " reads " << r << ", which the program does not declare");
      CHECK_MESSAGE(ready.count(r), step_name(st) << " reads " << r << " before it is written");
    }
    for (const std::string &o : step_outputs(st)) {
      CHECK_MESSAGE(p.find(o) != nullptr, step_name(st) << " writes " << o << ", which the program does not declare");
      ready.insert(o);
      written.insert(o);
    }
  }
  for (const TensorDecl &d : p.tensors)
    CHECK_MESSAGE((d.is_input || written.count(d.name)), "no step writes " << d.name);
  for (const std::string &o : p.outputs)
    CHECK_MESSAGE(written.count(o), "output " << o << " is not written");
  ProgramShapes shapes(p, 100);
  for (const TensorDecl &d : p.tensors)
    CHECK(shapes.elements(d) >= 1);
}

// The program lower() gives without the two routing passes.
KernelProgram lower_unfused(const Pipeline &pipeline, const Schedule &schedule) {
  KernelProgram p = lower_before_fusion(pipeline, schedule);
  fuse_elementwise_consumers(p, 0, p.steps.size(), schedule);
  return p;
}

// moe_mlp's algebra with the probabilities also returned (`also_probs`), or
// an auxiliary loss reading them.
Pipeline router_variant(bool also_probs, bool aux_loss, bool scaled_softmax = false) {
  Dim T = Dim::dynamic("T"), D("D", 64), F("F", 128), E("E", 8);
  Var t("t", T), e("e", E), i("i", D), j("j", F);
  Input x("x", {T, D});
  Param wr("wr", {D, E}), w1("w1", {E, D, F}), w2("w2", {E, F, D});
  Func logits("logits", DType::f32), probs("probs", DType::f32), h("h"), o("o"), y("y");
  logits(t, e) = sum(i, x(t, i) * wr(i, e));
  probs(t, e) = softmax(e, scaled_softmax ? logits(t, e) * 0.5 : Expr(logits(t, e)));
  Route route = top_k(probs, e, 2);
  Var r = route.pair();
  h(r, j) = gelu(sum(i, x(route.token(r), i) * w1(route.expert(r), i, j)));
  o(r, i) = sum(j, h(r, j) * w2(route.expert(r), j, i));
  y(t, i) = combine(route, t, route.gate(r) * o(r, i));
  std::vector<Func> outputs = {y};
  if (also_probs)
    outputs.push_back(probs);
  if (aux_loss)
    outputs.push_back(load_balancing_loss(route, probs, e));
  return Pipeline(outputs);
}

} // namespace

TEST_CASE("routing fusion: moe_mlp's softmax and gate steps run in the routing") {
  for (int64_t k : {1, 2})
    for (const std::string &name : preset_names()) {
      INFO("k = " << k << " / " << name);
      Example ex = make_example("moe_mlp", moe_shape(64, 64, k));
      KernelProgram p = lower(ex.pipeline, preset(name));
      CHECK(pointwise_writing(p, "probs") == nullptr);
      CHECK(pointwise_writing(p, "route_gate") == nullptr);
      CHECK(p.find("probs") == nullptr);
      const RoutingStep &rs = routing_step(p);
      CHECK(rs.softmax);
      CHECK(rs.probs == "logits");
      CHECK(rs.gate_output == "route_gate");
      // The gates are still a tensor (the combine or o's GEMM reads them), in
      // the pair order the routing writes.
      REQUIRE(p.find("route_gate") != nullptr);
      CHECK(p.tensor("route_gate").layout == RowLayout::pair);
      CHECK(p.tensor("route_gate").dtype == DType::f32);
      check_consistent(p);
      std::ostringstream text;
      text << p;
      CHECK(text.str().find("top_k(softmax(logits), k = " + std::to_string(k) + ")") != std::string::npos);
      CHECK(text.str().find("; gate -> route_gate\n") != std::string::npos);
    }
}

TEST_CASE("routing fusion: the printed program of the mbpaper forward") {
  ExampleShape s = moe_shape(16384, 64, 1);
  s.d = 1024;
  s.f = 4096;
  KernelProgram p = lower(make_example("moe_mlp", s).pipeline, preset("scattermoe"));
  std::ostringstream text;
  text << p;
  CHECK(text.str().find("  route route: top_k(softmax(logits), k = 1) -> counts, padded offsets (block 128), "
                        "sorted_pair, pair_pos, tiles; gate -> route_gate\n") != std::string::npos);
  CHECK(text.str().find("pointwise") == std::string::npos); // every other step is a GEMM
}

TEST_CASE("routing fusion: a router bias in the logits' GEMM fuses the same way") {
  Example ex = biased_moe(moe_shape(64, 8, 2), false, Bias::ramp);
  KernelProgram p = lower(ex.pipeline, preset("megablocks"));
  const RoutingStep &rs = routing_step(p);
  CHECK(rs.softmax);
  CHECK(rs.probs == "logits");
  CHECK(rs.gate_output == "route_gate");
  check_consistent(p);
}

TEST_CASE("routing fusion: swiglu_moe's renormalised gates run in the routing, with its softmax") {
  for (int64_t k : {1, 2, 8})
    for (const std::string &name : preset_names()) {
      INFO("k = " << k << " / " << name);
      KernelProgram p = lower(make_example("swiglu_moe", moe_shape(64, 8, k)).pipeline, preset(name));
      // route_gate = probs / route_gate_sum: the routing divides by the sum
      // of the chosen probabilities itself, so neither pointwise step stays,
      // and with them the last readers of probs but the routing.
      CHECK(pointwise_writing(p, "probs") == nullptr);
      CHECK(pointwise_writing(p, "route_gate_sum") == nullptr);
      CHECK(pointwise_writing(p, "route_gate") == nullptr);
      CHECK(p.find("probs") == nullptr);
      CHECK(p.find("route_gate_sum") == nullptr);
      const RoutingStep &rs = routing_step(p);
      CHECK(rs.softmax);
      CHECK(rs.renormalize);
      CHECK(rs.probs == "logits");
      CHECK(rs.gate_output == "route_gate");
      check_consistent(p);
      std::ostringstream text;
      text << p;
      CHECK(text.str().find("; gate -> route_gate (renormalised)\n") != std::string::npos);
    }
}

TEST_CASE("routing fusion: a renormalised gate stays two steps where the routing cannot divide") {
  // With a capacity the sum skips pairs dropped after the selection; the
  // group-limited top-k (deepseek_moe: its own picked / picked_sum gate) is
  // another kernel.
  KernelProgram capped =
      lower(make_example("swiglu_moe", moe_shape(64, 8, 2)).pipeline, Schedule(preset("megablocks")).capacity(1.25));
  CHECK(pointwise_writing(capped, "route_gate_sum") != nullptr);
  CHECK(pointwise_writing(capped, "route_gate") != nullptr);
  CHECK_FALSE(routing_step(capped).renormalize);
  CHECK(routing_step(capped).gate_output.empty());
  check_consistent(capped);

  KernelProgram grouped = lower(make_example("deepseek_moe", moe_shape(64, 16, 2)).pipeline, preset("megablocks"));
  CHECK(pointwise_writing(grouped, "picked_sum") != nullptr);
  CHECK_FALSE(routing_step(grouped).renormalize);
  check_consistent(grouped);
}

TEST_CASE("routing fusion: probabilities something else needs stay a step; the gate still moves") {
  struct Case {
    const char *what;
    Pipeline pipeline;
  };
  for (const Case &c : {Case{"probs is an output", router_variant(true, false)},
                        Case{"an aux loss reads probs", router_variant(false, true)},
                        Case{"softmax of an expression, not of a plain read", router_variant(false, false, true)}}) {
    INFO(c.what);
    KernelProgram p = lower(c.pipeline, preset("megablocks"));
    CHECK(pointwise_writing(p, "probs") != nullptr);
    CHECK(p.find("probs") != nullptr);
    const RoutingStep &rs = routing_step(p);
    CHECK_FALSE(rs.softmax);
    CHECK(rs.probs == "probs");
    CHECK(rs.gate_output == "route_gate");
    CHECK(pointwise_writing(p, "route_gate") == nullptr);
    check_consistent(p);
  }
}

TEST_CASE("routing fusion: training programs keep both steps (the backward reads the probabilities)") {
  Example ex = make_example("moe_mlp", moe_shape(32, 8, 2));
  TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), preset("scattermoe"));
  CHECK(pointwise_writing(t.program, "probs") != nullptr);
  const RoutingStep &rs = routing_step(t.program);
  CHECK_FALSE(rs.softmax);
  CHECK(rs.gate_output.empty());
}

TEST_CASE("routing fusion: each pass alone leaves a program without its pattern unchanged") {
  Example ex = make_example("deepseek_moe", moe_shape(32, 16, 2));
  KernelProgram p = lower(ex.pipeline, preset("megablocks"));
  std::ostringstream before, gate, softmax;
  before << p;
  gate << gate_from_routing(p, preset("megablocks"));
  softmax << softmax_into_routing(p, preset("megablocks"));
  CHECK(gate.str() == before.str());
  CHECK(softmax.str() == before.str());
}

#ifdef MOEFORGE_HAVE_CPU_BACKEND
TEST_SUITE("cpu") {
  TEST_CASE("cpu layer: routing that takes the softmax and writes the gates matches the reference") {
    struct Case {
      const char *example;
      int64_t k;
    };
    for (const Case &c : {Case{"moe_mlp", 1}, Case{"moe_mlp", 2}, Case{"swiglu_moe", 1}, Case{"swiglu_moe", 2}})
      for (const char *p : {"megablocks", "scattermoe"}) {
        INFO(c.example << " k = " << c.k << " / " << p);
        ExampleShape s = moe_shape(150, 16, c.k);
        Example ex = make_example(c.example, s);
        // Seeds no other test uses (fixed: a near tie that f32 and the f64
        // reference order differently would make a random seed flaky).
        cpu_test::Outcome o = cpu_test::run_and_compare(ex, ex.random_inputs(s, 41 + c.k), s.tokens, preset(p));
        CHECK(o.routing_mismatches == 0);
        CHECK(o.y_error <= 1e-2);
      }
  }

  TEST_CASE("cpu layer: the fused routing gives the unfused program's gates and output bit for bit") {
    struct Case {
      const char *example;
      int64_t k;
    };
    for (const Case &c : {Case{"moe_mlp", 1}, Case{"moe_mlp", 2}, Case{"swiglu_moe", 1}, Case{"swiglu_moe", 8}}) {
      INFO(c.example << " k = " << c.k);
      ExampleShape s = moe_shape(200, 64, c.k);
      Example ex = make_example(c.example, s);
      TensorMap in = ex.random_inputs(s, 23);
      auto run = [&](KernelProgram program, const char *what) {
        cpu::CompiledCpuLayer c = cpu::compile_cpu_program(std::move(program), what);
        cpu::CpuLayer layer(c, s.tokens);
        layer.upload(in);
        layer.poison();
        layer.run();
        return std::make_tuple(layer.download("route_gate").data, layer.download("y").data,
                               layer.routed_experts("route"));
      };
      KernelProgram fused = lower(ex.pipeline, preset("scattermoe"));
      REQUIRE(routing_step(fused).softmax);
      REQUIRE(routing_step(fused).renormalize == (std::string(c.example) == "swiglu_moe"));
      auto [gate_f, y_f, experts_f] = run(fused, "fused routing");
      auto [gate_u, y_u, experts_u] = run(lower_unfused(ex.pipeline, preset("scattermoe")), "unfused routing");
      CHECK(experts_f == experts_u);
      CHECK(gate_f == gate_u);
      CHECK(y_f == y_u);
    }
  }
}
#endif

#ifdef MOEFORGE_HAVE_CUDA
TEST_CASE("routing fusion: the fused layer compiles for sm_90a without a GPU") {
  Example ex = make_example("moe_mlp", moe_shape(64, 64, 1));
  cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, preset("scattermoe"));
  for (const GeneratedKernel &k : c.source.kernels) {
    CHECK(k.step != "pointwise_probs");
    CHECK(k.step != "pointwise_route_gate");
  }
  CHECK_FALSE(cuda::compile_routing_kernels("sm_90a").cubin.empty());
}

namespace {

// Logits from a coarse grid (multiples of 1/8): distinct values are far
// apart in probability (a factor e^(1/8)), so no rounding of the device's
// or the host's softmax can reorder them, and equal logits give equal
// probabilities on both (ties go to the lower expert everywhere).
std::vector<float> grid_logits(const RoutingShape &s, std::mt19937 &rng) {
  std::uniform_int_distribution<int> u(-24, 24);
  std::vector<float> v(static_cast<size_t>(s.tokens * s.experts));
  for (float &x : v)
    x = static_cast<float>(u(rng)) / 8.0f;
  for (int e = 0; e < s.experts && s.tokens > 1; ++e)
    v[s.experts + e] = 1.0f; // row 1: every expert tied
  return v;
}

} // namespace

TEST_SUITE("gpu") {

  TEST_CASE("cuda gpu: device top-k with the softmax fused matches top_k_on_host of softmaxed logits") {
    MOEFORGE_REQUIRE_GPU();
    cuda::Device device;
    cuda::DeviceRouting routing(device);
    cuda::Stream stream;
    std::mt19937 rng(31);
    for (RoutingShape s : std::vector<RoutingShape>{{1, 8, 2, 64},
                                                    {100, 8, 2, 64},
                                                    {4096, 64, 1, 128},
                                                    {777, 33, 5, 256},
                                                    {3000, 256, 8, 64},
                                                    {500, 16, 16, 128},
                                                    {999, 128, 3, 64},
                                                    {16384, 64, 1, 128}}) {
      CAPTURE(s.to_string());
      std::vector<float> logits = grid_logits(s, rng);
      HostTopK want = top_k_on_host(s, testing::host_softmax(logits, s));
      cuda::DeviceBuffer d_logits = cuda::DeviceBuffer::from(logits);
      cuda::DeviceBuffer d_gate(static_cast<size_t>(s.pairs()) * sizeof(float));
      cuda::RoutingPlan plan(s);
      plan.poison(cuda::kPoisonNaN);
      d_gate.fill32(cuda::kPoisonNaN);
      routing.run(d_logits.ptr(), plan, stream, /*softmax=*/true, d_gate.ptr());
      stream.synchronize();
      RoutingTables tables = plan.download();
      CHECK(tables.expert == want.expert);
      CHECK(verify_routing_tables(s, tables).empty());
      CHECK(tables.pair_pos == route_on_host(s, want.expert).pair_pos);
      // The gates went to d_gate; plan.gate was not written.
      std::vector<float> gate = d_gate.download<float>();
      REQUIRE(gate.size() == want.gate.size());
      for (size_t i = 0; i < gate.size(); ++i)
        if (!(std::fabs(gate[i] - want.gate[i]) <= 1e-5f * want.gate[i])) {
          FAIL_CHECK("gate[" << i << "] = " << gate[i] << ", expected " << want.gate[i]);
          break;
        }
      for (float g : plan.download_gate())
        CHECK_MESSAGE(std::isnan(g), "plan.gate written although a gate tensor was given");
    }
  }

  TEST_CASE("cuda gpu: the fused routing gives the unfused layer's gates and output bit for bit") {
    MOEFORGE_REQUIRE_GPU();
    cuda::Device device;
    cuda::Stream stream;
    struct Case {
      int64_t experts, k;
      bool renormalised = false;
    };
    // Each of the routing's top-k kernels (one per bound on E), and the
    // renormalised gates of swiglu_moe.
    for (const Case &ek : {Case{64, 1}, Case{64, 2}, Case{8, 2}, Case{128, 3}, Case{256, 4}, Case{64, 8, true},
                           Case{8, 2, true}, Case{256, 6, true}}) {
      INFO("E = " << ek.experts << ", k = " << ek.k << (ek.renormalised ? ", swiglu_moe" : ", moe_mlp"));
      ExampleShape s = moe_shape(1000, ek.experts, ek.k);
      Example ex = make_example(ek.renormalised ? "swiglu_moe" : "moe_mlp", s);
      TensorMap in = ex.random_inputs(s, 29);
      auto run = [&](KernelProgram program) {
        cuda::CompiledLayer c = cuda::compile_program(std::move(program), device.arch_specific());
        cuda::CudaLayer layer(device, c, s.tokens);
        layer.upload(in);
        layer.poison();
        layer.enqueue(stream);
        stream.synchronize();
        return std::make_tuple(layer.download("route_gate").data, layer.download("y").data,
                               layer.routed_experts("route"));
      };
      KernelProgram fused = lower(ex.pipeline, preset("scattermoe"));
      REQUIRE(routing_step(fused).softmax);
      REQUIRE(routing_step(fused).renormalize == ek.renormalised);
      auto [gate_f, y_f, experts_f] = run(fused);
      auto [gate_u, y_u, experts_u] = run(lower_unfused(ex.pipeline, preset("scattermoe")));
      CHECK(experts_f == experts_u);
      CHECK(gate_f == gate_u);
      CHECK(y_f == y_u);
    }
  }
}
#endif
