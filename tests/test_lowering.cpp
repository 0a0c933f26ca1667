// Lowering without a backend: the passes are listed in order and
// MOEFORGE_DEBUG=lower prints the kernel program after each one.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <set>
#include <sstream>

#include "dsl/ops.h"
#include "dsl/printer.h"
#include "dsl/visitor.h"
#include "examples/examples.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "program_order.h"
#include "schedules/presets.h"

using namespace moeforge;

TEST_CASE("lowering: MOEFORGE_DEBUG=lower prints the program after every pass in order") {
  ExampleShape s;
  s.tokens = 32;
  Example ex = make_example("swiglu_moe", s);
  std::ostringstream captured;
  std::streambuf *old = std::cerr.rdbuf(captured.rdbuf());
  ::setenv("MOEFORGE_DEBUG", "lower", 1);
  KernelProgram p = lower(ex.pipeline, preset("megablocks"));
  ::unsetenv("MOEFORGE_DEBUG");
  std::cerr.rdbuf(old);
  const std::string text = captured.str();
  size_t at = 0;
  for (const char *pass : {"build_steps", "fuse_gate_into_epilogue", "split_unfused_epilogues", "insert_permutation",
                           "assign_row_layouts", "resolve_row_maps", "materialize_transposes",
                           "fuse_elementwise_consumers", "gate_from_routing", "softmax_into_routing", "plan_gemms"}) {
    size_t found = text.find(std::string("=== after ") + pass + " ===", at);
    CHECK_MESSAGE(found != std::string::npos, "no dump after " << pass << " (in order)");
    if (found != std::string::npos)
      at = found;
  }
  // The last dump is the program lower() returned, each GEMM with the CUDA
  // target's plan.
  std::ostringstream final_program;
  final_program << p;
  const std::string last = "=== after plan_gemms ===\n";
  CHECK(text.substr(text.rfind(last) + last.size()) == final_program.str());
  CHECK(final_program.str().find("    cuda plan: tile 128x128x64") != std::string::npos);
  CHECK(final_program.str().find("    cuda plan: walk: ") != std::string::npos);
}

TEST_CASE("lowering: without MOEFORGE_DEBUG nothing is printed") {
  ::unsetenv("MOEFORGE_DEBUG");
  std::ostringstream captured;
  std::streambuf *old = std::cerr.rdbuf(captured.rdbuf());
  lower(make_example("moe_mlp", ExampleShape{}).pipeline, preset("scattermoe"));
  std::cerr.rdbuf(old);
  CHECK(captured.str().empty());
}

TEST_CASE("lowering: a pass that does not apply returns the program unchanged") {
  Example ex = make_example("moe_mlp", ExampleShape{});
  Schedule blocked = preset("megablocks"); // gate in the combine: nothing to fuse
  KernelProgram p = build_steps(ex.pipeline, blocked);
  std::ostringstream before, after;
  before << p;
  after << fuse_gate_into_epilogue(p, blocked);
  CHECK(before.str() == after.str());
  std::ostringstream scattered;
  scattered << insert_permutation(p, preset("scattermoe")); // gathers stay in the GEMM: no copy step
  CHECK(scattered.str() == before.str());
}

TEST_CASE("lowering: a training forward's element-wise steps run in its GEMMs' epilogues") {
  ExampleShape s;
  s.tokens = 32;
  Example ex = make_example("swiglu_moe", s);
  TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), preset("scattermoe"));
  // The forward: h_lhs = silu(h_silu_in) and h = h_lhs * h_rhs are written by
  // the GEMMs of h_silu_in and h_rhs, not by element-wise steps.
  std::vector<std::string> extras;
  for (size_t i = 0; i < t.forward_steps; ++i) {
    const Step &st = t.program.steps[i];
    if (auto *pw = std::get_if<PointwiseStep>(&st))
      CHECK_MESSAGE(pw->output != "h", "h is still an element-wise step");
    if (auto *g = std::get_if<GemmStep>(&st))
      for (const GemmStep::Extra &e : g->extra)
        extras.push_back(e.output);
  }
  CHECK(std::find(extras.begin(), extras.end(), "h") != extras.end());
  // h_lhs = silu(h_silu_in) is neither kept nor stored: the backward's one
  // element-wise reader makes it again from h_silu_in.
  CHECK(std::find(extras.begin(), extras.end(), "h_lhs") == extras.end());
  CHECK(t.program.find("h_lhs") == nullptr);
  CHECK(std::find(t.saved.begin(), t.saved.end(), "h_lhs") == t.saved.end());
  CHECK(std::find(t.saved.begin(), t.saved.end(), "h_silu_in") != t.saved.end());
  // The backward keeps its element-wise steps (see lowering/training.cpp).
  bool backward_pointwise = false;
  for (size_t i = t.forward_steps; i < t.program.steps.size(); ++i)
    if (auto *pw = std::get_if<PointwiseStep>(&t.program.steps[i]))
      backward_pointwise |= pw->output == "d_x_s_a";
  CHECK(backward_pointwise);
  // Every tensor a step reads is written by an earlier step or is an input.
  CHECK(testing::reads_follow_writes(t.program));
}

TEST_CASE("lowering: SwiGLU's two projections in training run as one GEMM, in h's tiling") {
  ExampleShape s;
  s.tokens = 32;
  Example ex = make_example("swiglu_moe", s);
  for (bool h_tiled : {false, true}) {
    INFO((h_tiled ? "tile(h, 128, 128, 64) over a 128 x 256 default" : "the preset's tiling"));
    Schedule sch = preset("scattermoe");
    if (h_tiled)
      sch.mma("*", MmaKind::wgmma_ws).tile("*", 128, 256, 64).tile("h", 128, 128, 64);
    TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), sch);
    int gemms = 0;
    size_t h = t.forward_steps;
    for (size_t i = 0; i < t.forward_steps; ++i)
      if (auto *g = std::get_if<GemmStep>(&t.program.steps[i]); g && g->route) {
        ++gemms;
        if (g->b.size() == 2)
          h = i;
      }
    CHECK(gemms == 2); // x [W1 W3], then h W2
    REQUIRE(h < t.forward_steps);
    const GemmStep &g = std::get<GemmStep>(t.program.steps[h]);
    CHECK(g.b == std::vector<std::string>{"w1", "w3"});
    CHECK(g.tiling.tile_n == 128); // h's own: autodiff's h_silu_in and h_rhs follow it
    // Every output of both projections and of the element-wise steps
    // between them comes out of its one epilogue.
    std::vector<std::string> outs = step_outputs(t.program.steps[h]);
    for (const char *o : {"h_silu_in", "h_rhs", "h"})
      CHECK(std::find(outs.begin(), outs.end(), o) != outs.end());
  }
}

namespace {

// The mbpaper benchmark's layer (d = 1024, f = 4096, E = 64, k = 1; T is
// dynamic, so the token count does not matter here), or k pairs per token.
ExampleShape mbpaper_shape(int64_t k) {
  ExampleShape s;
  s.d = 1024;
  s.f = 4096;
  s.experts = 64;
  s.topk = k;
  return s;
}

const PointwiseStep *pointwise_writing(const KernelProgram &p, const std::string &name) {
  for (const Step &st : p.steps)
    if (auto *pw = std::get_if<PointwiseStep>(&st); pw && pw->output == name)
      return pw;
  return nullptr;
}

const GemmStep *gemm_writing(const KernelProgram &p, const std::string &name) {
  for (const Step &st : p.steps)
    if (auto *g = std::get_if<GemmStep>(&st)) {
      std::vector<std::string> outs = step_outputs(st);
      if (std::find(outs.begin(), outs.end(), name) != outs.end())
        return g;
    }
  return nullptr;
}

} // namespace

TEST_CASE("lowering: a schedule naming a Func reaches the GEMMs its sums were split into") {
  // d_x = combine(dH1 W1^T) + combine(dH3 W3^T) + d_logits Wr^T: lowering
  // splits it into one GEMM per sum (d_x_s, d_x_s2, d_x_s3), which take
  // d_x's settings; chained into one, the GEMM still names d_x for messages.
  ExampleShape s;
  s.tokens = 32;
  Example ex = make_example("swiglu_moe", s);
  for (bool chain : {false, true}) {
    INFO((chain ? "chain_summed_gemms" : "separate"));
    Schedule sch = preset("scattermoe");
    sch.tile("d_x", 64, 128, 64).persistent("d_x", true).padded_elementwise(true).chain_summed_gemms(chain);
    TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), sch);
    int parts = 0;
    for (const Step &st : t.program.steps)
      if (auto *g = std::get_if<GemmStep>(&st); g && g->output.rfind("d_x_s", 0) == 0) {
        ++parts;
        INFO(g->name);
        CHECK(g->func == "d_x");
        CHECK(g->tiling.tile_m == 64);
        CHECK(g->tiling.tile_n == 128);
        CHECK(g->tiling.persistent);
        CHECK(g->chained.has_value() == (chain && g->route != nullptr));
      }
    CHECK(parts == (chain ? 2 : 3));
  }
}

TEST_CASE("lowering: the backward's sibling element-wise steps run as one, unless the schedule keeps one apart") {
  // SwiGLU's two derivatives read d_h and the pre-activation: one step with
  // an extra output. Steps that reduce (the gate's dot product, the
  // combines) and steps reading another's output stay apart.
  ExampleShape s;
  s.tokens = 32;
  Example ex = make_example("swiglu_moe", s);
  for (bool apart : {false, true}) {
    // d_x_s_a2 is a part lowering made for d_x, not a Func a schedule can
    // name: the schedule-wide fuse_epilogue decides for it.
    INFO((apart ? "fuse_epilogue(*, false)" : "scattermoe"));
    Schedule sch = preset("scattermoe");
    if (apart)
      sch.fuse_epilogue("*", false);
    TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), sch);
    const PointwiseStep *pw = pointwise_writing(t.program, "d_x_s_a");
    REQUIRE(pw);
    std::vector<std::string> outs;
    for (const Step &st : t.program.steps)
      for (const std::string &o : step_outputs(st))
        outs.push_back(o);
    CHECK(std::count(outs.begin(), outs.end(), "d_x_s_a2") == 1); // written once either way
    if (apart) {
      CHECK(pw->extra.empty());
      CHECK(pointwise_writing(t.program, "d_x_s_a2"));
      continue;
    }
    REQUIRE(pw->extra.size() == 1);
    CHECK(pw->extra[0].output == "d_x_s_a2");
    // Its value is over the step's own index variables.
    std::ostringstream text;
    text << pw->extra[0].value;
    CHECK(text.str() == "silu(h_silu_in(r, " + pw->vars[1].name() + ")) * d_h(r, " + pw->vars[1].name() + ")");
    for (size_t i = t.forward_steps; i < t.program.steps.size(); ++i)
      if (auto *q = std::get_if<PointwiseStep>(&t.program.steps[i]); q && !q->extra.empty() && q != pw)
        CHECK(q->output == "d_o"); // with its row sum (below); the rest reduce or read each other
  }
}

TEST_CASE("lowering: a per-row sum rides along the element-wise step over its rows") {
  // The gate's gradient d_route_gate(r) = sum(i, d_y(token(r), i) * o(r, i))
  // sums over d_o(r, i)'s last index and reads what is ready there: one
  // step, the sum a row_sum extra over d_o's own index variables. Kept
  // apart by fuse_epilogue(d_route_gate, false).
  ExampleShape s;
  s.tokens = 32;
  Example ex = make_example("swiglu_moe", s);
  for (bool apart : {false, true}) {
    INFO((apart ? "fuse_epilogue(d_route_gate, false)" : "scattermoe"));
    Schedule sch = preset("scattermoe");
    if (apart)
      sch.fuse_epilogue("d_route_gate", false);
    TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), sch);
    const PointwiseStep *d_o = pointwise_writing(t.program, "d_o");
    REQUIRE(d_o);
    if (apart) {
      CHECK(d_o->extra.empty());
      CHECK(pointwise_writing(t.program, "d_route_gate"));
      continue;
    }
    REQUIRE(d_o->extra.size() == 1);
    CHECK(d_o->extra[0].output == "d_route_gate");
    CHECK(d_o->extra[0].row_sum);
    const std::string i = d_o->vars[1].name();
    std::ostringstream text;
    text << d_o->extra[0].value;
    CHECK(text.str() == "d_y(token(r), " + i + ") * o(r, " + i + ")");
    std::ostringstream printed;
    printed << t.program;
    CHECK(printed.str().find("and d_route_gate(r) = sum(" + i + ", d_y(token(r), " + i + ") * o(r, " + i + "))") !=
          std::string::npos);
  }
}

TEST_CASE("lowering: attention's backward sums the softmax's row once, not once per element") {
  // d_q = sum(u, dS(t, u) * k(u, d)) with dS = P * (dP - sum(u', P * dP)) *
  // c: the GEMM's A operand is an expression, made a step of its own, and
  // the sum inside it reads t alone. Left inside, every one of the T x T
  // elements summed a row again (T^3 work: 3.5 s of a 2048-token step on
  // the CPU backend); hoisted, one step makes the T row sums first and the
  // operand (for d_k too, transposed) reads them.
  ExampleShape s;
  s.tokens = 64;
  Example ex = make_example("attention", s);
  TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), preset("scattermoe"));
  const PointwiseStep *row = pointwise_writing(t.program, "d_q_a_sum");
  REQUIRE(row);
  CHECK(row->vars.size() == 1);
  std::ostringstream printed;
  printed << t.program;
  INFO(printed.str());
  // The only sum left in an element-wise step is the row step's.
  for (const Step &st : t.program.steps)
    if (auto *pw = std::get_if<PointwiseStep>(&st); pw && pw != row) {
      INFO(pw->name);
      CHECK_FALSE(contains_kind(pw->body, ExprKind::Sum));
      for (const ExtraOutput &e : pw->extra)
        CHECK_FALSE(contains_kind(e.value, ExprKind::Sum));
    }
  CHECK(printed.str().find("d_q_a_sum(t)") != std::string::npos);
}

TEST_CASE("lowering: a dense GEMM reducing over the routed pairs reads them in pair order") {
  // Mixture-of-Attention's dK = dS^T Q and dV = P^T dZ sum over every
  // routed pair, in pair order: Q and dZ, routed GEMM outputs the blocked
  // permutation would keep in the padded order, stay in pair order (read
  // in the padded order, the reduction paired each r with another pair's
  // row and with padding rows: wrong and not-a-number gradients).
  ExampleShape s;
  s.tokens = 40;
  Example ex = make_example("moa", s);
  for (const char *schedule : {"megablocks", "scattermoe"}) {
    INFO(schedule);
    TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), preset(schedule));
    const KernelProgram &p = t.program;
    CHECK(p.tensor("q").layout == RowLayout::pair);
    CHECK(p.tensor("d_z").layout == RowLayout::pair);
    int reductions = 0;
    for (const Step &st : p.steps)
      if (auto *g = std::get_if<GemmStep>(&st); g && !g->route && g->k.same_as(ex.pipeline.routes().front()->pairs)) {
        ++reductions;
        CHECK(p.tensor(g->b[0]).layout != RowLayout::padded);
      }
    CHECK(reductions == 2); // d_key, d_value
  }
}

TEST_CASE("lowering: a k = 1 combine runs in the last GEMM's epilogue") {
  for (const char *name : {"moe_mlp", "swiglu_moe"})
    for (const char *schedule : {"megablocks", "scattermoe"}) {
      INFO(name << " / " << schedule);
      Example ex = make_example(name, mbpaper_shape(1));
      KernelProgram p = lower(ex.pipeline, preset(schedule));
      CHECK(pointwise_writing(p, "y") == nullptr);
      const GemmStep *g = gemm_writing(p, "y");
      REQUIRE(g != nullptr);
      // o (or o_gated) is read by nothing else: not stored, y is the GEMM's
      // own output, written at row r (= t for k = 1), not in tile order.
      CHECK(g->output == "y");
      CHECK(g->extra.empty());
      CHECK(g->out_rows == RowMap::gather_pair);
      CHECK(p.find("o") == nullptr);
      CHECK(p.find("o_gated") == nullptr);
      CHECK(p.tensor("y").layout == RowLayout::dense);
      // scattermoe's gate is in the epilogue already; megablocks' moves
      // there with the combine.
      CHECK(to_string(g->epilogue) == "route_gate(r) * acc0(r, i)");
    }
}

TEST_CASE("lowering: a k = 2 combine stays an element-wise step") {
  for (const char *schedule : {"megablocks", "scattermoe"}) {
    INFO(schedule);
    KernelProgram p = lower(make_example("moe_mlp", mbpaper_shape(2)).pipeline, preset(schedule));
    // A token's two pairs are in different tiles: no epilogue sees both.
    CHECK(pointwise_writing(p, "y") != nullptr);
    CHECK(gemm_writing(p, "y") == nullptr);
  }
}

TEST_CASE("lowering: fuse_epilogue of the GEMM false keeps the k = 1 combine a step") {
  Schedule s = preset("megablocks");
  s.fuse_epilogue("o", false);
  KernelProgram p = lower(make_example("moe_mlp", mbpaper_shape(1)).pipeline, s);
  CHECK(pointwise_writing(p, "y") != nullptr);
  CHECK(p.find("o") != nullptr);
}

TEST_CASE("lowering: a k = 1 combine with a residual reads the residual at the pair's token") {
  Dim T = Dim::dynamic("T"), D("D", 64), F("F", 128), E("E", 8);
  Var t("t", T), e("e", E), i("i", D), j("j", F);
  Input x("x", {T, D});
  Param wr("wr", {D, E}), w1("w1", {E, D, F}), w2("w2", {E, F, D});
  Func logits("logits", DType::f32), probs("probs", DType::f32), h("h"), o("o"), y("y");
  logits(t, e) = sum(i, x(t, i) * wr(i, e));
  probs(t, e) = softmax(e, logits(t, e));
  Route route = top_k(probs, e, 1);
  Var r = route.pair();
  h(r, j) = gelu(sum(i, x(route.token(r), i) * w1(route.expert(r), i, j)));
  o(r, i) = sum(j, h(r, j) * w2(route.expert(r), j, i));
  y(t, i) = x(t, i) + combine(route, t, route.gate(r) * o(r, i));
  KernelProgram p = lower(Pipeline({y}), preset("scattermoe"));
  CHECK(pointwise_writing(p, "y") == nullptr);
  REQUIRE(gemm_writing(p, "y") != nullptr);
  CHECK(to_string(gemm_writing(p, "y")->epilogue) == "x(r, i) + route_gate(r) * acc0(r, i)");
}

TEST_CASE("lowering: gate_gradient_from_dh says so where the backward gives it nothing to rewrite") {
  // mma_sync's dH GEMM reads a transposed copy of W2, not W2 in place: the
  // rewrite's pattern is not there, and the program says so (every command
  // prints it before running) instead of running without it unseen.
  Example ex = make_example("swiglu_moe", ExampleShape{150, 8, 2, 64, 128});
  Schedule plain("plain");
  plain.gate_gradient_from_dh(true);
  TrainingProgram t = lower_training(ex.pipeline, ex.pipeline.func(ex.output), plain);
  REQUIRE(t.program.not_applied.size() == 1);
  CHECK(t.program.not_applied[0].rfind("gate_gradient_from_dh(true) is not applied: ", 0) == 0);
  CHECK(t.program.find("d_h_ungated") == nullptr);
  // On the wgmma loops it applies, and nothing is said.
  Schedule hopper = preset("scattermoe");
  hopper.gate_gradient_from_dh(true);
  TrainingProgram h = lower_training(ex.pipeline, ex.pipeline.func(ex.output), hopper);
  CHECK(h.program.not_applied.empty());
  CHECK(h.program.find("d_h_ungated") != nullptr);
}
