// CI checks of the GPU code path that need no GPU: lowering structure per
// schedule, and the generated CUDA compiling through NVRTC for sm_90a with a
// resource report inside bounds (no spills, registers and shared memory
// within Hopper's limits).
#include <doctest/doctest.h>

#include <tuple>

#include "cuda_resources.h"
#include "layer_compare.h"
#include "program_steps.h"
#include "softmax_layers.h"
#include "source_files.h"
#include "whole_gradient.h"

#include "backends/cuda/runtime/layer.h"
#include "backends/cuda/runtime/training_layer.h"
#include "benchmarks/train_schedule.h"
#include "dsl/printer.h"
#include "examples/aux_loss_example.h"
#include "examples/biased_moe.h"
#include "examples/gradient_nodes.h"
#include "examples/norm_layers.h"
#include "lowering/default_schedule.h"
#include "lowering/lower.h"
#include "schedules/presets.h"

using namespace moeforge;
using testing::check_resources;
using testing::kernel_source;

namespace {

ExampleShape small() { return testing::shape(64, 128, 256, 8, 2); }

template <typename T> int count_steps(const KernelProgram &p) {
  int n = 0;
  for (const Step &s : p.steps)
    n += std::holds_alternative<T>(s);
  return n;
}

const GemmStep &gemm(const KernelProgram &p, const std::string &out) { return testing::gemm_writing(p, out); }

} // namespace

TEST_CASE("codegen: every preset x MoE example compiles for sm_90a without spills") {
  for (const char *example : {"moe_mlp", "swiglu_moe"})
    for (const char *preset_name : {"megablocks", "scattermoe"}) {
      Example ex = make_example(example, small());
      cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, preset(preset_name));
      CHECK(c.arch() == "sm_90a");
      // One cubin per kernel (each its own NVRTC program and cache entry).
      REQUIRE(c.units.size() == c.source.kernels.size());
      for (size_t k = 0; k < c.units.size(); ++k) {
        CHECK(c.unit_of[k] == k);
        CHECK(c.units[k].cubin.size() > 1000);
        CHECK(c.units[k].resources_of(c.source.kernels[k].name) != nullptr);
      }
      check_resources(c, std::string(example) + " / " + preset_name);
    }
}

TEST_CASE("codegen: persistent GEMMs compile without spills and loop over their tiles") {
  for (const char *example : {"moe_mlp", "swiglu_moe"})
    for (const char *preset_name : {"megablocks", "scattermoe"}) {
      Example ex = make_example(example, small());
      Schedule s = preset(preset_name);
      s.persistent("*", true);
      cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, s);
      check_resources(c, std::string(example) + " / " + preset_name + " / persistent");
      // Tiles drawn in order from the counter, which the last block zeroes.
      CHECK(c.source.source.find("tile_id = Cfg::next_tile(ring, tile_counter)") != std::string::npos);
      CHECK(c.source.source.find("Cfg::tiles_done(tile_counter);") != std::string::npos);
      for (const GeneratedKernel &k : c.source.kernels)
        if (k.grid.kind == GridShape::Kind::routed_tiles || k.grid.kind == GridShape::Kind::dense_tiles)
          CHECK(k.grid.persistent);
    }
  // Persistent blocks need the warp-specialised loop.
  Example ex = make_example("moe_mlp", small());
  Schedule s = preset("megablocks");
  s.mma("*", MmaKind::wgmma).persistent("*", true);
  CHECK_THROWS_WITH_AS(cuda::compile_layer(ex.pipeline, s), doctest::Contains("persistent blocks need the warp"),
                       UserError);
}

TEST_CASE("codegen: TMA tiles compile without spills with a tensor map per B operand and consecutive A") {
  for (const char *example : {"moe_mlp", "swiglu_moe"})
    for (const char *preset_name : {"megablocks", "scattermoe"})
      for (bool persistent : {false, true}) {
        Example ex = make_example(example, small());
        Schedule s = preset(preset_name);
        s.tma("*", true).persistent("*", persistent);
        cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, s);
        check_resources(c, std::string(example) + " / " + preset_name + " / tma");
        CHECK(c.source.source.find(persistent ? "Cfg::tile(ring, Cfg::tma_loads("
                                              : "Cfg::mainloop(smem, Cfg::tma_loads(") != std::string::npos);
        // Every GEMM's B operands travel as tensor maps, not pointers.
        for (const GeneratedKernel &k : c.source.kernels) {
          if (k.grid.kind != GridShape::Kind::routed_tiles && k.grid.kind != GridShape::Kind::dense_tiles)
            continue;
          const GemmStep *g = nullptr;
          for (const Step &st : c.program.steps)
            if (auto *gs = std::get_if<GemmStep>(&st); gs && gs->name == k.step)
              g = gs;
          REQUIRE(g != nullptr);
          // B: [K, N] per expert; A: every row of [rows, K] when its rows
          // are consecutive (tile order or dense), else gathered by cp.async.
          int maps = 0;
          for (const KernelArg &a : k.args) {
            if (a.kind != KernelArg::Kind::tma)
              continue;
            ++maps;
            if (a.name == g->a)
              CHECK((a.rows == 0 && a.cols == g->k.extent()));
            else
              CHECK((a.rows == g->k.extent() && a.cols == g->n.extent()));
          }
          CHECK(maps == static_cast<int>(g->b.size()) + (g->a_rows == RowMap::direct));
        }
      }
  // The plain wgmma loop (two blocks per SM at 128x128, 3 stages) loads
  // through TMA too; mma.sync ignores it.
  Example ex = make_example("moe_mlp", small());
  Schedule s = preset("scattermoe");
  s.mma("*", MmaKind::wgmma).stages("*", 3).tma("*", true);
  cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, s);
  check_resources(c, "moe_mlp / scattermoe / plain wgmma / tma");
  CHECK(c.source.source.find("WgmmaConfig<128, 128, 3, 1>") != std::string::npos);
  CHECK(c.source.source.find("Cfg::mainloop_tma(") != std::string::npos);
  CHECK(c.source.source.find("__launch_bounds__(256, 2)") != std::string::npos);
  s.mma("*", MmaKind::mma_sync).tile("*", 128, 128, 32);
  c = cuda::compile_layer(ex.pipeline, s);
  CHECK(c.source.source.find("mainloop_tma") == std::string::npos);
}

TEST_CASE("codegen: tma_store sends tile-order bf16 outputs through TMA and leaves the others alone") {
  for (const char *example : {"moe_mlp", "swiglu_moe", "dense_mlp"})
    for (const char *preset_name : {"megablocks", "scattermoe"})
      for (MmaKind mma : {MmaKind::wgmma_ws, MmaKind::wgmma}) {
        Example ex = make_example(example, small());
        Schedule s = preset(preset_name);
        s.mma("*", mma).stages("*", 3).tma("*", true).tma_store("*", true);
        cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, s);
        check_resources(c, std::string(example) + " / " + preset_name + " / tma_store");
        for (const Step &st : c.program.steps) {
          auto *g = std::get_if<GemmStep>(&st);
          if (!g)
            continue;
          const GeneratedKernel *k = nullptr;
          for (const GeneratedKernel &x : c.source.kernels)
            if (x.step == g->name)
              k = &x;
          REQUIRE(k != nullptr);
          // h (bf16, in tile order) and the dense MLP's output go through a
          // tensor map of themselves; y (f32, scattered to pairs or tokens)
          // and logits (f32) keep their pointers.
          bool out_map = false, out_pointer = false;
          for (const KernelArg &a : k->args) {
            out_map |= a.kind == KernelArg::Kind::tma && a.name == g->output;
            out_pointer |= a.kind == KernelArg::Kind::tensor && a.name == g->output;
          }
          const bool expect = c.program.tensor(g->output).dtype == DType::bf16 && g->extra.empty() &&
                              (!g->route || g->out_rows == RowMap::direct);
          CHECK((expect || g->output != "h"));
          const std::string what = std::string(example) + " / " + preset_name + " / " + g->name;
          INFO(what);
          CHECK(out_map == expect);
          CHECK(out_pointer == !expect);
        }
        CHECK(c.source.source.find("Cfg::template out_store<128>(") != std::string::npos); // the whole tile
        CHECK(c.source.source.find("Cfg::template out_put4<128>(s_out, warp, lane, pi,") !=
              std::string::npos); // by stmatrix
      }
  // Persistent blocks stage in a buffer past the ring (the ring holds the
  // next tile), free again once the previous copy has read it.
  Example ex = make_example("moe_mlp", small());
  Schedule s = preset("scattermoe");
  s.mma("*", MmaKind::wgmma_ws).stages("*", 3).tma("*", true).tma_store("*", true).persistent("*", true);
  cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, s);
  check_resources(c, "moe_mlp / persistent tma_store");
  CHECK(c.source.source.find("Cfg::out_reuse(ring.out)") != std::string::npos);
  CHECK(c.source.source.find("Cfg::out_done()") != std::string::npos);
  for (const GeneratedKernel &k : c.source.kernels)
    if (k.name == "gemm_h") // three stages of 128 x 64 and 64 x 128, and the 128 x 128 output tile
      CHECK(k.shared_bytes >= 3 * (128 * 64 + 64 * 128) * 2 + 128 * 128 * 2);
}

TEST_CASE("codegen: two-block clusters compile without spills and need the TMA warp-specialised loop") {
  for (const char *example : {"moe_mlp", "swiglu_moe"})
    for (const char *preset_name : {"megablocks", "scattermoe"}) {
      Example ex = make_example(example, small());
      Schedule s = preset(preset_name);
      s.tma("*", true).cluster("*", 2);
      cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, s);
      check_resources(c, std::string(example) + " / " + preset_name + " / cluster");
      CHECK(c.source.source.find("__cluster_dims__(2, 1, 1)") != std::string::npos);
      CHECK(c.source.source.find("Cfg::mainloop_tma_pair(") != std::string::npos);
      for (const GeneratedKernel &k : c.source.kernels)
        if (k.grid.kind == GridShape::Kind::routed_tiles || k.grid.kind == GridShape::Kind::dense_tiles)
          CHECK(k.grid.cluster_m == 2);
    }
  Example ex = make_example("moe_mlp", small());
  Schedule s = preset("scattermoe");
  s.tma("*", false).cluster("*", 2);
  CHECK_THROWS_WITH_AS(cuda::compile_layer(ex.pipeline, s), doctest::Contains("add mma(\"logits\", wgmma_ws) and tma"),
                       UserError);
  s.tma("*", true).block(256).tile("h", 64, 128, 64);
  CHECK_THROWS_WITH_AS(cuda::compile_layer(ex.pipeline, s),
                       doctest::Contains("need the routing block (256) to be tile_m or twice it, not tile_m 64"),
                       UserError);
  // block = 2 tile_m: a pair is the two halves of one routing tile (one
  // expert), sharing whenever the second half holds rows.
  s.tile("h", 128, 128, 64);
  cuda::CompiledLayer halves = cuda::compile_layer(ex.pipeline, s);
  check_resources(halves, "moe_mlp / scattermoe / cluster over 256-row blocks");
  CHECK(halves.source.source.find("const bool share = rt_route_tile_rows[tile] > Cfg::BM;") != std::string::npos);
  CHECK_THROWS_WITH_AS(s.cluster("*", 4), doctest::Contains("use 1 (none) or 2"), UserError);
  // Persistent clusters: the pair walks items together, with an even grid.
  s.persistent("*", true);
  cuda::CompiledLayer pairs = cuda::compile_layer(ex.pipeline, s);
  check_resources(pairs, "moe_mlp / scattermoe / persistent clusters");
  CHECK(pairs.source.source.find("Cfg::pair_tile_tma(") != std::string::npos);
  CHECK(pairs.source.source.find("Cfg::pair_done(tile_counter);") != std::string::npos);
  for (const GeneratedKernel &k : pairs.source.kernels)
    if (k.grid.kind == GridShape::Kind::routed_tiles)
      CHECK((k.grid.persistent && k.grid.cluster_m == 2));
}

TEST_CASE("codegen: a dense GEMM's fused extra output is stored at its own row") {
  // The z-loss's exp(logits) fuses into the router GEMM's epilogue when the
  // outputs and gradients are lowered as one program; its store must be at
  // row (p0 + lr), not p0 + lr * N (a missing bracket once).
  ExampleShape s = small();
  s.tokens = 150;
  testing::WholeGradient w = testing::outputs_and_gradients(make_aux_loss_example("moe_mlp", s), s);
  KernelProgram p = lower(w.example.pipeline, preset("scattermoe"));
  const GemmStep &logits = gemm(p, "logits");
  REQUIRE(logits.extra.size() == 1);
  std::string src = generate_cuda(p).source;
  CHECK(src.find("g_" + logits.extra[0].output + " + (p0 + lr) * N") != std::string::npos);
  CHECK(src.find("p0 + lr * N") == std::string::npos);
}

TEST_CASE("codegen: the dense MLP compiles through the same GEMM path") {
  Example ex = make_example("dense_mlp", small());
  cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, preset("megablocks"));
  CHECK(count_steps<GemmStep>(c.program) == 2);
  CHECK(count_steps<RoutingStep>(c.program) == 0);
  check_resources(c, "dense_mlp");
}

TEST_CASE("codegen: a tile that does not divide d = f = 2880 compiles (masked)") {
  ExampleShape s = small();
  s.d = s.f = 2880;
  Example ex = make_example("swiglu_moe", s);
  cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, preset("scattermoe"));
  check_resources(c, "swiglu_moe 2880");
  // wgmma: the wide stores skip a quad's columns past N and bound the rest.
  CHECK(c.source.source.find("if (N % Cfg::BN != 0 && col - (lane & 3) * 2 >= N) continue;") != std::string::npos);
  CHECK(c.source.source.find(" + out_row * N, col, v0, v1, w0, w1, N);") != std::string::npos);
  CHECK(c.source.source.find("constexpr int N = 2880;") != std::string::npos); // 2880 % 128: the test stays
}

TEST_CASE("codegen: tile and stage and warp sweeps compile without spills") {
  struct Case {
    int m, n, k, stages, wm, wn, block;
  };
  for (Case cs : {Case{64, 128, 32, 3, 2, 2, 64}, Case{128, 64, 64, 3, 4, 1, 128}, Case{128, 256, 32, 3, 2, 4, 128},
                  Case{64, 64, 64, 2, 2, 2, 256}, Case{256, 128, 32, 3, 4, 2, 256}}) {
    Schedule s("sweep");
    s.permutation(Permutation::scattered)
        .block(cs.block)
        .tile("*", cs.m, cs.n, cs.k)
        .stages("*", cs.stages)
        .warps("*", cs.wm, cs.wn);
    Example ex = make_example("moe_mlp", small());
    cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, s);
    check_resources(c, s.to_text());
  }
}

TEST_CASE("codegen: wgmma and warp-specialised wgmma tilings compile without spills") {
  struct Case {
    MmaKind mma;
    int m, n, stages;
  };
  for (Case cs :
       {Case{MmaKind::wgmma, 64, 256, 3}, Case{MmaKind::wgmma, 128, 64, 3}, Case{MmaKind::wgmma_ws, 128, 128, 4},
        Case{MmaKind::wgmma_ws, 128, 256, 4}, Case{MmaKind::wgmma_ws, 64, 128, 5}}) {
    Schedule s("wgmma_sweep");
    s.permutation(Permutation::scattered).tile("*", cs.m, cs.n, 64).warps("*", cs.m / 16, 1).stages("*", cs.stages);
    s.mma("*", cs.mma);
    if (cs.n == 256) // SwiGLU's h holds two accumulators: keep it to 128 columns
      s.tile("h", cs.m, 128, 64);
    for (const char *example : {"moe_mlp", "swiglu_moe"}) {
      Example ex = make_example(example, small());
      cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, s);
      check_resources(c, s.to_text());
    }
  }
}

TEST_CASE("lowering: megablocks copies routed rows into padded blocks and scattermoe gathers in the GEMM") {
  Example ex = make_example("moe_mlp", small());
  KernelProgram mb = lower(ex.pipeline, preset("megablocks"));
  CHECK(count_steps<GatherStep>(mb) == 1);
  CHECK(gemm(mb, "h").a_rows == RowMap::direct);
  CHECK(mb.tensor("h").layout == RowLayout::padded);
  CHECK(mb.tensor("o").layout == RowLayout::padded);
  CHECK(gemm(mb, "o").out_rows == RowMap::direct);

  KernelProgram sm = lower(ex.pipeline, preset("scattermoe"));
  CHECK(count_steps<GatherStep>(sm) == 0);
  CHECK(gemm(sm, "h").a_rows == RowMap::gather_token);
  CHECK(sm.tensor("h").layout == RowLayout::padded);     // only a GEMM reads h: kept in tile order
  CHECK(sm.find("o") == nullptr);                        // the gate is fused: o_gated instead
  CHECK(sm.tensor("o_gated").layout == RowLayout::pair); // scattered back for the combine
  CHECK(gemm(sm, "o_gated").out_rows == RowMap::gather_pair);
}

TEST_CASE("lowering: gate fusion moves gate(r) into the last GEMM's epilogue") {
  Example ex = make_example("moe_mlp", small());
  KernelProgram sm = lower(ex.pipeline, preset("scattermoe")); // gate in epilogue
  CHECK(to_string(gemm(sm, "o_gated").epilogue) == "route_gate(r) * acc0(r, i)");
  KernelProgram mb = lower(ex.pipeline, preset("megablocks")); // gate in combine
  CHECK(to_string(gemm(mb, "o").epilogue) == "acc0(r, i)");
}

TEST_CASE("lowering: SwiGLU's two projections share one GEMM and unfused splits them") {
  Example ex = make_example("swiglu_moe", small());
  KernelProgram fused = lower(ex.pipeline, preset("megablocks"));
  CHECK(gemm(fused, "h").b.size() == 2);
  CHECK(to_string(gemm(fused, "h").epilogue) == "silu(acc0(r, j)) * acc1(r, j)");

  Schedule s = preset("megablocks");
  s.fuse_epilogue("h", false);
  KernelProgram split = lower(ex.pipeline, s);
  CHECK(gemm(split, "h_acc0").b.size() == 1);
  CHECK(gemm(split, "h_acc1").b.size() == 1);
  CHECK(split.tensor("h_acc0").dtype == DType::f32);
  bool has_epilogue = false;
  for (const Step &st : split.steps)
    if (auto *p = std::get_if<PointwiseStep>(&st))
      has_epilogue |= p->output == "h" && to_string(p->body) == "silu(h_acc0(r, j)) * h_acc1(r, j)";
  CHECK(has_epilogue);
  cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, s);
  check_resources(c, "swiglu unfused");
}

TEST_CASE("lowering: a router bias runs in the router GEMM's epilogue") {
  Example ex = biased_moe(small(), false, Bias::ramp);
  KernelProgram p = lower(ex.pipeline, preset("megablocks"));
  CHECK(to_string(gemm(p, "logits").epilogue) == "acc0(t, e) + bias(e)");
  cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, preset("megablocks"));
  check_resources(c, "biased router");
}

TEST_CASE("codegen errors: what the CUDA backend cannot compile says why") {
  // Router probabilities stored as bf16 cannot feed the device top-k.
  {
    Dim T = Dim::dynamic("T"), D("D", 64), E("E", 8);
    Var t("t", T), e("e", E), i("i", D);
    Input x("x", {T, D});
    Param wr("wr", {D, E});
    Func logits("logits", DType::f32), probs("probs", DType::bf16), y("y");
    logits(t, e) = sum(i, x(t, i) * wr(i, e));
    probs(t, e) = softmax(e, logits(t, e));
    Route route = top_k(probs, e, 2);
    y(t) = combine(route, t, route.gate(route.pair()));
    CHECK_THROWS_WITH_AS(lower(Pipeline({y}), preset("megablocks")),
                         doctest::Contains("the device routing needs f32 probabilities"), UserError);
  }
  // An expert_sum whose factors read both output indices together.
  {
    Example ex = make_example("moe_mlp", small());
    Func h = ex.pipeline.func("h");
    const RoutingNode &rn = *ex.pipeline.routes()[0];
    Route route(ex.pipeline.routes()[0], ex.pipeline.func("route_gate"));
    Var e("e", rn.expert_dim()), j("j", h.args()[1].dim()), j2("j2", h.args()[1].dim());
    Func g("g");
    g(e, j, j2) = expert_sum(route, e, h(route.pair(), j) * h(route.pair(), j2) * h(route.pair(), j));
    CHECK_NOTHROW(lower(Pipeline({g}), preset("megablocks")));
    Func bad("bad");
    bad(e, j, j2) = expert_sum(route, e, h(route.pair(), j) * (h(route.pair(), j2) + h(route.pair(), j)));
    CHECK_THROWS_WITH_AS(lower(Pipeline({bad}), preset("megablocks")),
                         doctest::Contains("so the expert_sum is not a product of two row-indexed matrices"),
                         UserError);
  }
}

TEST_CASE("codegen: the benchmarks' best schedules compile without serialised wgmmas at their widths") {
  // ptxas serialises every wgmma of a kernel when one sits under a branch
  // inside a group (warning C7520), which costs most of the MMA rate; at
  // the tests' small widths some kernels have it (a K of one or two k-tiles
  // unrolls the loop), so this looks at the shapes the schedules are for:
  // mbpaper's best schedule (GeLU, d = 1024, f = 4096, 64 experts, k = 1)
  // and SwiGLU's two-B projection at a mixtral-like width.
  Schedule best =
      Schedule::load(testing::source_file("benchmarks/schedules/forward/tuned_tma_persist_pair_o_gelu.sched"));
  check_resources(cuda::compile_layer(make_example("moe_mlp", testing::shape(4096, 1024, 4096, 64, 1)).pipeline, best),
                  "moe_mlp / tuned_tma_persist_pair_o at mbpaper's widths", true);
  check_resources(
      cuda::compile_layer(make_example("swiglu_moe", testing::shape(4096, 4096, 14336, 8, 2)).pipeline, scattermoe()),
      "swiglu_moe / scattermoe at mixtral's widths", true);
}

TEST_CASE("lowering: contractions the kernels cannot read directly are decomposed") {
  // Attention's softmax wraps a contraction: the contraction becomes a GEMM
  // Func of its own and the softmax reads it.
  Example att = make_example("attention", small());
  KernelProgram a = lower(att.pipeline, preset("megablocks"));
  CHECK(count_steps<GemmStep>(a) >= 2);
  // An f32 operand: a bf16 copy (an element-wise step) feeds the GEMM.
  {
    Dim T = Dim::dynamic("T"), D("D", 64), F("F", 64);
    Var t("t", T), i("i", D), j("j", F);
    Input x("x", {T, D}, DType::f32);
    Param w("w", {D, F});
    Func y("y");
    y(t, j) = sum(i, x(t, i) * w(i, j));
    KernelProgram p = lower(Pipeline({y}), preset("megablocks"));
    CHECK(p.tensor("y_a").dtype == DType::bf16);
    CHECK(count_steps<PointwiseStep>(p) == 1);
    CHECK(std::get<GemmStep>(p.steps.back()).a == "y_a");
  }
  // A transposed B operand: a transpose step writes w^T first.
  {
    Dim T = Dim::dynamic("T"), D("D", 64), F("F", 64);
    Var t("t", T), i("i", D), j("j", F);
    Input x("x", {T, D});
    Param w("w", {F, D});
    Func y("y");
    y(t, j) = sum(i, x(t, i) * w(j, i));
    Schedule sync = preset("megablocks");
    sync.mma("*", MmaKind::mma_sync);
    KernelProgram p = lower(Pipeline({y}), sync);
    CHECK(count_steps<TransposeStep>(p) == 1);
    CHECK(std::get<GemmStep>(p.steps.back()).b[0] == "w_T");
    CHECK(p.tensor("w_T").dims[0].name() == "D");
    // The wgmma loops read it in place: no transpose step.
    KernelProgram q = lower(Pipeline({y}), preset("megablocks"));
    CHECK(count_steps<TransposeStep>(q) == 0);
    CHECK(std::get<GemmStep>(q.steps.back()).b_trans);
    cuda::CompiledLayer c = cuda::compile_layer(Pipeline({y}), preset("megablocks"));
    CHECK(c.source.source.find("B read transposed") != std::string::npos);
  }
}

TEST_CASE("codegen: step and [a == b] (the gradient nodes) compile for sm_90a") {
  Example ex = gradient_nodes_layer(small());
  cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, preset("scattermoe"));
  check_resources(c, "gradient nodes");
  CHECK(c.source.source.find("mf::step(") != std::string::npos);
  CHECK(c.source.source.find(" == ") != std::string::npos);
}

namespace {

size_t count_of(const std::string &text, const std::string &what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1))
    ++n;
  return n;
}

const GeneratedKernel &kernel_named(const cuda::CompiledLayer &c, const std::string &name) {
  for (const GeneratedKernel &k : c.source.kernels)
    if (k.name == name)
      return k;
  FAIL("no kernel " << name);
  throw 0;
}

// The name of the kernel that writes tensor `out` (merged steps are named
// after all their outputs).
std::string kernel_writing(const cuda::CompiledTraining &c, const std::string &out) {
  for (const Step &s : c.training.program.steps) {
    std::vector<std::string> outs = step_outputs(s);
    if (std::find(outs.begin(), outs.end(), out) != outs.end())
      return step_name(s);
  }
  FAIL("no step writes " << out);
  throw 0;
}

} // namespace

TEST_CASE("codegen: a k = 1 combine in the GEMM epilogue compiles for sm_90a without spills") {
  ExampleShape s = small();
  s.topk = 1;
  ExampleShape mbpaper = s; // the benchmark's layer: d = 1024, f = 4096, E = 64
  mbpaper.d = 1024;
  mbpaper.f = 4096;
  mbpaper.experts = 64;
  struct Case {
    const char *example;
    ExampleShape shape;
  };
  for (const Case &cs : {Case{"moe_mlp", s}, Case{"swiglu_moe", s}, Case{"moe_mlp", mbpaper}})
    for (const char *preset_name : {"megablocks", "scattermoe"}) {
      const char *example = cs.example;
      INFO(example << " / " << preset_name << " / d = " << cs.shape.d);
      Example ex = make_example(example, cs.shape);
      cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, preset(preset_name));
      check_resources(c, std::string(example) + " / " + preset_name + " / k = 1");
      // No combine kernel: o's GEMM writes y at row r (= t for k = 1).
      for (const GeneratedKernel &k : c.source.kernels)
        CHECK(k.step != "pointwise_y");
      // h = gelu(acc) in tile order reads no pair index: no sorted_pair
      // lookup in its epilogue (rows below `rows` are real pairs); y's
      // epilogue reads route_gate(r) and stores at row r, so it looks r up.
      std::string gemm_h = kernel_source(c, "gemm_h");
      CHECK(gemm_h.find("const int r = -1;  // unread") != std::string::npos);
      std::string gemm_o = kernel_source(c, "gemm_o");
      CHECK(gemm_o.find("const int r = -1;  // unread") == std::string::npos);
      CHECK(gemm_o.find("g_y + out_row * N") != std::string::npos);
      CHECK(gemm_o.find("out_row = r;") != std::string::npos);
    }
}

TEST_CASE("codegen: the blocked permutation's padded copy moves four chunks a thread on wide rows") {
  // d = 1024: 128 chunks of 16 bytes a row, 32 threads a row copying four
  // each; d = 120: 15 chunks, one a thread. The launch grid counts the
  // kernel's threads a row, so a wrong span would skip or repeat rows.
  for (auto [d, per_thread, span] : {std::tuple{1024, 4, 32}, std::tuple{120, 1, 15}}) {
    INFO("d = " << d);
    Example ex = make_example("swiglu_moe", testing::shape(64, d, 128, 8, 2));
    cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, preset("megablocks"));
    check_resources(c, "megablocks, d = " + std::to_string(d));
    const std::string src = kernel_source(c, "gather_x_padded_route");
    CHECK(src.find("uint4 v[" + std::to_string(per_thread) + "];") != std::string::npos);
    CHECK(src.find("idx / " + std::to_string(span) + ",") != std::string::npos);
    CHECK(kernel_named(c, "gather_x_padded_route").grid.chunks_per_row == span);
  }
}

TEST_CASE("codegen: element-wise steps move eight elements per thread where the innermost extent allows") {
  // The training step's element-wise kernels over (pair, column): eight
  // consecutive columns per thread, 16-byte loads of the matrices read
  // along them and one store; per-pair dot products keep a warp each.
  for (bool bf16 : {false, true}) {
    Example ex = make_example("swiglu_moe", small());
    Schedule s = bench::tuned_wide(true);
    s.bf16_activations(bf16);
    cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), s);
    INFO((bf16 ? "bf16" : "f32") << " activations");
    check_resources(c.layer, "swiglu_moe training, tuned_wide");
    for (const char *name : {"pointwise_d_x_s_a_d_x_s_a2", "pointwise_d_x", "pointwise_y"}) {
      INFO(name);
      const GeneratedKernel &k = kernel_named(c.layer, name);
      CHECK(k.grid.elements_per_thread == 8);
      CHECK(k.grid.threads_per_element == 1);
      std::string src = kernel_source(c.layer, name);
      CHECK(src.find("mf::store8(") != std::string::npos);
      CHECK(src.find("mf::load8(") != std::string::npos);
    }
    // d_o = gate(r) * d_y(token(r), i): the renormalised gate made again
    // from two scalar reads (it is not kept), d_y one eight-wide load. The
    // gate's gradient sum(i, d_y(token(r), i) * o(r, i)) rides along as a
    // row sum: a warp per pair, eight columns per lane, d_y loaded once for
    // both, the lanes' sums added by shuffles and stored by lane 0.
    std::string d_o = kernel_source(c.layer, "pointwise_d_o_d_route_gate");
    CHECK(d_o.find("g_route_gate_sum[") != std::string::npos);
    CHECK(d_o.find("g_route_gate[") == std::string::npos);
    CHECK(count_of(d_o, "mf::load8(g_d_y + ") == 1);
    CHECK(count_of(d_o, "mf::load8(g_o + ") == 1);
    CHECK(d_o.find("__shfl_xor_sync(") != std::string::npos);
    CHECK(d_o.find("if (lane == 0)") != std::string::npos);
    const GeneratedKernel &rows = kernel_named(c.layer, "pointwise_d_o_d_route_gate");
    CHECK(rows.grid.kind == GridShape::Kind::padded_rows);
    CHECK(rows.grid.chunks_per_row == 32);
    // SwiGLU's two derivatives in one kernel (merge_sibling_pointwise): d_h
    // and the pre-activation are loaded once for both, and both are stored
    // (padding rows' zeros, then the values).
    std::string dh = kernel_source(c.layer, "pointwise_d_x_s_a_d_x_s_a2");
    CHECK(count_of(dh, "mf::load8(g_d_h + ") == 1);
    CHECK(count_of(dh, "mf::load8(g_h_silu_in + ") == 1);
    CHECK(count_of(dh, "mf::store8(g_d_x_s_a + ") == 2);
    CHECK(count_of(dh, "mf::store8(g_d_x_s_a2 + ") == 2);
  }
}

TEST_CASE("codegen: tanh takes the special-function unit's form in values stored as bf16") {
  // In a bf16 result tanh.approx's ~2^-11 is under the result's rounding; an
  // f32 result keeps tanhf.
  for (DType dtype : {DType::f32, DType::bf16}) {
    Dim T = Dim::dynamic("T"), D("D", 64);
    Var t("t", T), i("i", D);
    Input x("x", {T, D});
    Func y("y", dtype);
    y(t, i) = tanh(x(t, i)) * x(t, i);
    cuda::CompiledLayer c = cuda::compile_layer(Pipeline({y}), preset("scattermoe"));
    INFO(dtype_name(dtype) << " output");
    check_resources(c, "tanh");
    CHECK(count_of(c.source.source, "mf::tanh_fast(") == (dtype == DType::bf16 ? 1 : 0));
    CHECK(count_of(c.source.source, "tanhf(") == (dtype == DType::bf16 ? 0 : 1));
  }
  // GeLU's derivative as autodiff writes it: three tanh of one argument per
  // element of d_h, in the training step's bf16 per-pair gradient; in the
  // lean mode beside the gate's f32 gradient, a row sum of the same kernel
  // that reads no tanh.
  Example ex = make_example("moe_mlp", small());
  for (bool lean : {false, true}) {
    Schedule s = bench::tuned_wide(false);
    if (lean)
      s.recompute_elementwise(true).gate_gradient_from_dh(true);
    INFO((lean ? "lean" : "store"));
    cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), s);
    check_resources(c.layer, "moe_mlp training, tuned_wide");
    const std::string src =
        kernel_source(c.layer, lean ? "pointwise_d_x_s_a_d_route_gate_h_gated" : "pointwise_d_x_s_a");
    CHECK(count_of(src, "mf::tanh_fast(") == 3);
    CHECK(count_of(src, "tanhf(") == 0);
  }
}

TEST_CASE("codegen: padded_elementwise: zero-padded element-wise results, read by TMA, compile without spills") {
  // tuned_wide (padded_elementwise): d_o, dH1 and dH3 come from element-wise
  // kernels over the padded rows (zeros on padding), h from the forward
  // GEMM's epilogue with its padding rows zeroed; the dH / dX GEMMs then
  // read their A by TMA, and the expert reductions both operands, x through
  // one padded copy of its gathered rows.
  Example ex = make_example("swiglu_moe", small());
  for (bool recompute : {false, true}) {
    Schedule s = bench::tuned_wide(true);
    s.recompute(recompute);
    cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), s);
    check_resources(c.layer, std::string("tuned_wide") + (recompute ? " / recompute" : ""));
    const KernelProgram &p = c.training.program;
    for (const char *t : {"d_o", "d_x_s_a", "d_x_s_a2", "h"}) {
      INFO(t);
      CHECK(p.tensor(t).layout == RowLayout::padded);
      CHECK(p.tensor(t).zero_padding);
    }
    auto source = [&](const std::string &kernel) { return kernel_source(c.layer, kernel); };
    for (const char *g : {"gemm_d_w1_d_w3", "gemm_d_w2"}) { // dW1 and dW3 merged (merge_weight_gradients)
      CHECK(source(g).find("A and B by TMA") != std::string::npos);
      CHECK(source(g).find("Cfg::tile<true, true>(ring") != std::string::npos); // persistent (tuned_wide)
    }
    // dW1 and dW3 read x through one padded copy (zero padding).
    CHECK(p.tensor("x_rows_route").zero_padding);
    CHECK(source("gather_x_rows_route").find("make_uint4(0, 0, 0, 0);  // padding") != std::string::npos);
    CHECK(source("pointwise_d_o_d_route_gate").find("a padding row: zeros") != std::string::npos);
    CHECK(source("gemm_h_silu_in_h_rhs").find("padding rows: zeros") != std::string::npos);
    for (const Step &st : p.steps)
      if (auto *g = std::get_if<GemmStep>(&st); g && (g->output == "d_h" || g->output == "d_x_s"))
        CHECK(g->a_rows == RowMap::direct);
  }
  // Without it, the same tensors stay in pair order.
  cuda::CompiledTraining plain = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), preset("scattermoe"));
  CHECK(plain.training.program.tensor("d_x_s_a").layout == RowLayout::pair);
  CHECK_FALSE(plain.training.program.tensor("d_x_s_a").zero_padding);
}

TEST_CASE("codegen: persistent expert reductions store their tiles by TMA, one matrix per expert") {
  // tma_store on the weight gradients: the tile is staged past the ring and
  // stored through a [E, M, N] map at the tile's expert; whole beside 3
  // stages, in two halves of 128 columns beside 4 (a whole 128 x 256 tile
  // does not fit there). tuned_wide has it; without tma_store, plain stores.
  // The reductions apart here (tuned_wide merges dW1 and dW3, whose stores
  // test_merge_reductions.cpp checks).
  Example ex = make_example("swiglu_moe", small());
  for (int stages : {3, 4}) {
    INFO(stages << " stages");
    Schedule s = bench::tuned_wide(true).merge_weight_gradients(false);
    for (const char *g : {"d_w1", "d_w3", "d_w2"})
      s.tma_store(g, true).stages(g, stages);
    cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), s);
    check_resources(c.layer, "tuned_wide with TMA-stored weight gradients");
    const std::string cols = stages == 3 ? "256" : "128";
    for (const char *g : {"gemm_d_w1", "gemm_d_w3", "gemm_d_w2"}) {
      INFO(g);
      std::string src = kernel_source(c.layer, g);
      CHECK(src.find("Cfg::ring(smem, Cfg::BM * " + cols + " * 2)") != std::string::npos);
      CHECK(src.find("Cfg::out_reuse(ring.out)") != std::string::npos);
      CHECK(src.find("out_store<" + cols + ">(") != std::string::npos);
      CHECK(src.find(", (int)expert);") != std::string::npos);
      CHECK(src.find("Cfg::out_done();") != std::string::npos);
      CHECK(kernel_named(c.layer, g).shared_bytes <= Schedule::max_shared_bytes);
      const std::string out = g + 5; // gemm_d_w1 writes d_w1
      bool map = false;
      for (const KernelArg &a : kernel_named(c.layer, g).args)
        if (a.kind == KernelArg::Kind::tma && a.name == out)
          map = a.rows == c.training.program.tensor(out).dims[1].extent(); // one [M, N] matrix per expert
      CHECK(map);
    }
  }
  Schedule plain_stores = bench::tuned_wide(true);
  plain_stores.tma_store("d_w1", false);
  cuda::CompiledTraining plain = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), plain_stores);
  CHECK(kernel_source(plain.layer, "gemm_d_w1").find("out_store<") == std::string::npos);
  CHECK(kernel_source(plain.layer, "gemm_d_w2").find("out_store<") != std::string::npos);
}

TEST_CASE("codegen: a GEMM's fused outputs leave by TMA too, zero-padded ones with their padding rows") {
  // SwiGLU's forward GEMM writes h_silu_in, h_rhs and h, each through its own
  // map: a block per tile stages all three in its idle ring at once and
  // waits for the copies' reads after the last; a persistent block stages
  // one at a time past its ring. h is zero-padded (the down-projection reads
  // it by TMA), so every box of the tile is stored, zeros past `rows`.
  Example ex = make_example("swiglu_moe", small());
  for (bool persistent : {false, true}) {
    INFO((persistent ? "persistent" : "a block per tile"));
    Schedule s = bench::tuned_wide(true);
    s.tma_store("h", true).persistent("h", persistent);
    cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), s);
    check_resources(c.layer, "tuned_wide with h stored by TMA");
    std::string src = kernel_source(c.layer, "gemm_h_silu_in_h_rhs");
    CHECK(count_of(src, "out_store<128>(") == 3);
    CHECK(count_of(src, ", p0, Cfg::BM, n0") == 3); // every box: h's padding rows get zeros
    CHECK(count_of(src, persistent ? "Cfg::out_reuse(ring.out)" : "s_ring + ") == 3);
    CHECK(count_of(src, ", N, true);") == (persistent ? 0 : 1)); // one wait, after the last
    for (const char *out : {"h_silu_in", "h_rhs", "h"}) {
      bool map = false;
      for (const KernelArg &a : kernel_named(c.layer, "gemm_h_silu_in_h_rhs").args)
        map |= a.kind == KernelArg::Kind::tma && a.name == out;
      CHECK(map);
    }
  }
}

TEST_CASE("codegen: chain_summed_gemms: SwiGLU's input gradient is one GEMM over both reductions") {
  // tuned_wide (and its lean mode) with chain_summed_gemms: dH1 W1^T and
  // dH3 W3^T run as one GEMM whose ring loads the first product's k-tiles,
  // then the second's, each A and B through its own TMA map; the combine
  // over a token's pairs reads one per-pair tensor of width d. A block per
  // tile (tuned_wide) or persistent; within the register and spill bounds.
  Example ex = make_example("swiglu_moe", small());
  for (int mode : {0, 1, 2}) {
    INFO("mode " << mode);
    Schedule s = bench::tuned_wide(true);
    s.chain_summed_gemms(true);
    if (mode == 1)
      s.recompute_elementwise(true).gate_gradient_from_dh(true);
    if (mode == 2)
      s.persistent("*", true);
    cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), s);
    check_resources(c.layer, "tuned_wide with chain_summed_gemms");
    int chained = 0;
    std::string name;
    for (const Step &st : c.training.program.steps)
      if (const auto *g = std::get_if<GemmStep>(&st); g && g->chained) {
        ++chained;
        name = g->name;
        CHECK(g->chained->a == "d_x_s_a");
        CHECK(g->a == "d_x_s_a2");
      }
    REQUIRE(chained == 1);
    CHECK(c.training.program.find("d_x_s") == nullptr);
    const std::string src = kernel_source(c.layer, name);
    CHECK(count_of(src, mode == 2 ? "Cfg::tile(ring, Cfg::chain_loads(" : "Cfg::mainloop(smem, Cfg::chain_loads(") ==
          1);
    bool a2 = false, b2 = false;
    for (const KernelArg &a : kernel_named(c.layer, name).args) {
      a2 |= a.kind == KernelArg::Kind::tma && a.name == "d_x_s_a";
      b2 |= a.kind == KernelArg::Kind::tma && a.name == "w1";
    }
    CHECK(a2);
    CHECK(b2);
  }
  // Where the loop cannot take both products: a user error naming the fix.
  Schedule plain = bench::tuned_wide(true);
  plain.chain_summed_gemms(true).tma("*", false);
  CHECK_THROWS_WITH_AS(cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), plain),
                       doctest::Contains("definition 'd_x': chain_summed_gemms runs its two products (d_x_s_a2 x w3, "
                                         "d_x_s_a x w1) in the warp-specialised loop"),
                       UserError);
}

TEST_CASE("codegen: gate_gradient_from_dh: the dH GEMM reads dy's rows and the gate gradient reads h, not o") {
  // tuned_wide with the gate's gradient taken from the dH GEMM: its A is
  // dy's rows unscaled, a per-pair copy in the padded order made by d_o's
  // kernel (padded_elementwise: read by TMA), or without padded_elementwise
  // dy in bf16 gathered by token inside the GEMM; its output is the ungated
  // dy W2^T. The gate gradient is a warp's dot product of h (kept or made
  // again) and that per pair, beside the activation's backward; the
  // forward's o is not kept.
  Example ex = make_example("swiglu_moe", small());
  for (int mode : {0, 1, 2}) {
    const bool lean = mode == 1, padded = mode != 2;
    INFO((lean ? "recompute_elementwise" : "h kept") << (padded ? "" : ", not padded_elementwise"));
    Schedule s = bench::tuned_wide(true);
    s.gate_gradient_from_dh(true).recompute_elementwise(lean).padded_elementwise(padded);
    if (!padded) // (chain_summed_gemms reads its A operands in tile order)
      s.persistent("*", false).tma_store("*", false).chain_summed_gemms(false);
    cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), s);
    check_resources(c.layer, "tuned_wide with gate_gradient_from_dh");
    const std::vector<std::string> &saved = c.training.saved;
    CHECK(std::find(saved.begin(), saved.end(), "o") == saved.end());
    const GemmStep &dh = gemm(c.training.program, "d_h_ungated");
    CHECK(dh.a == (padded ? "d_y_rows" : "d_y_bf16"));
    CHECK(dh.a_rows == (padded ? RowMap::direct : RowMap::gather_token));
    if (padded) {
      CHECK(c.training.program.tensor("d_y_rows").layout == RowLayout::padded);
      std::string rows = kernel_source(c.layer, kernel_writing(c, "d_y_rows"));
      CHECK(count_of(rows, "mf::load8(g_d_y + ") == 1); // one read of dy (for d_o too, when made)
      // Made again, h is scaled by the gate where it is made, for dW2 to read
      // against dy's copy: d_o is not made at all, nor h stored unscaled.
      CHECK((c.training.program.find("d_o") == nullptr) == lean);
      if (lean) {
        CHECK(c.training.program.find("h_re") == nullptr);
        const GemmStep &dw2 = gemm(c.training.program, "d_w2");
        CHECK(dw2.a == "h_gated");
        CHECK(dw2.b == std::vector<std::string>{"d_y_rows"});
        CHECK(kernel_writing(c, "h_gated") == kernel_writing(c, "d_x_s_a"));
      }
    }
    // The gate gradient rides along the activation's backward, which reads
    // d_h_ungated and the pre-activations anyway: h is the value made there
    // (kept, h is read; made again, nothing more is read).
    const std::string merged = kernel_writing(c, "d_route_gate");
    CHECK(merged == kernel_writing(c, "d_x_s_a"));
    std::string gate = kernel_source(c.layer, merged);
    CHECK(count_of(gate, "mf::load8(g_d_h_ungated + ") == 1);
    CHECK(count_of(gate, "mf::load8(g_h + ") == (lean ? 0 : 1));
    CHECK(gate.find("g_o + ") == std::string::npos);
    CHECK(kernel_named(c.layer, merged).grid.threads_per_element == 32); // a warp per row
  }
}

TEST_CASE("codegen: the backward's GEMMs over transposed weights read them by TMA") {
  // dH = dO W2^T and dX = dH1 W1^T read W^T in place, stored [N, K] per
  // expert: boxes of 64 rows n x 64 k, K-major as wgmma takes B^T.
  Example ex = make_example("swiglu_moe", small());
  cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), bench::tuned_wide(true));
  check_resources(c.layer, "swiglu_moe training, tuned_wide");
  // (tuned_wide chains dX's two products into one GEMM: chain_summed_gemms)
  for (const auto &[gemm, w] :
       {std::pair{"gemm_d_h", "w2"}, {"gemm_d_x_s2_d_x_s", "w3"}, {"gemm_d_x_s2_d_x_s", "w1"}}) {
    INFO(gemm);
    std::string src = kernel_source(c.layer, gemm);
    CHECK(src.find("B read transposed ([N, K])") != std::string::npos);
    CHECK(src.find("const __grid_constant__ mf::TmaDesc tma_" + std::string(w)) != std::string::npos);
    bool b_map = false;
    for (const KernelArg &a : kernel_named(c.layer, gemm).args)
      if (a.kind == KernelArg::Kind::tma && a.name == w) {
        b_map = true;
        CHECK(a.rows == (std::string(w) == "w2" ? small().f : small().d)); // [N, K]: N rows
      }
    CHECK(b_map);
  }
}

TEST_CASE("codegen: sqrt and rsqrt (RMSNorm) compile, forward and training") {
  ExampleShape s = small();
  Example ex = rmsnorm_layer(s);
  cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, preset("megablocks"));
  check_resources(c, "rmsnorm");
  CHECK(c.source.source.find("rsqrtf(") != std::string::npos);
  CHECK(c.source.source.find("sqrtf(") != std::string::npos);
  cuda::CompiledTraining t = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), preset("megablocks"));
  check_resources(t.layer, "rmsnorm training");
}

TEST_CASE("codegen: a few long reductions run a block per element") {
  // The router bias's gradient: d_bias(e) = sum over every token of
  // d_logits(t, e), E = 8 elements: a block of 256 threads each.
  Example ex = biased_moe(small(), false, Bias::none);
  cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), preset("scattermoe"));
  check_resources(c.layer, "biased_gelu training");
  const GeneratedKernel &k = kernel_named(c.layer, "pointwise_d_bias");
  CHECK(k.grid.threads_per_element == k.threads);
  std::string src = kernel_source(c.layer, "pointwise_d_bias");
  CHECK(src.find("mf::block_sum(") != std::string::npos);
  CHECK(src.find("+= blockDim.x") != std::string::npos);
  CHECK(src.find("if (threadIdx.x == 0) ") != std::string::npos);
  // Per-pair dot products are many: a warp each (beside d_o, whose kernel
  // reads the same rows of d_y).
  CHECK(kernel_named(c.layer, kernel_writing(c, "d_route_gate")).grid.threads_per_element == 32);
}

TEST_CASE("codegen: the router's weight gradient (K = the tokens) splits K over the grid's y") {
  for (const char *p : {"megablocks", "scattermoe"})
    for (bool wide : {false, true}) {
      INFO(p << (wide ? " / tuned_wide" : ""));
      Example ex = make_example("moe_mlp", small());
      Schedule s = wide ? bench::tuned_wide(false) : preset(p);
      cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), s);
      check_resources(c.layer, "moe_mlp training");
      const GeneratedKernel &k = kernel_named(c.layer, "gemm_d_wr");
      CHECK(k.grid.split_k);
      CHECK(k.grid.split_k_dim.is_dynamic());
      CHECK(k.zero_first == "d_wr");
      std::string src = kernel_source(c.layer, "gemm_d_wr");
      CHECK(src.find("mf::add2(") != std::string::npos);
      CHECK(src.find("const int k_begin = (int)blockIdx.y * k_slice;") != std::string::npos);
      // Every other GEMM keeps one block per tile and plain stores.
      for (const GeneratedKernel &other : c.layer.source.kernels)
        if (other.name != "gemm_d_wr") {
          INFO(other.name);
          CHECK_FALSE(other.grid.split_k);
          CHECK(other.zero_first.empty());
        }
    }
}

TEST_CASE("codegen: softmax runs a warp per row and compiles without spills") {
  // The router's softmax over E = 64 experts: two columns per lane, in
  // registers. Under a capacity swiglu_moe's renormalised gates read the
  // probabilities, so its softmax stays a step (without one it runs in the
  // routing: lower.h).
  ExampleShape s = small();
  s.experts = 64;
  Example moe = make_example("swiglu_moe", s);
  cuda::CompiledLayer c = cuda::compile_layer(moe.pipeline, Schedule(preset("scattermoe")).capacity(1.25));
  check_resources(c, "swiglu_moe router softmax");
  CHECK(kernel_named(c, "pointwise_probs").grid.threads_per_element == 32);
  std::string probs = kernel_source(c, "pointwise_probs");
  CHECK(probs.find("mf::warp_max(row_max)") != std::string::npos);
  CHECK(probs.find("mf::warp_sum(row_sum)") != std::string::npos);
  CHECK(probs.find("float xs[2]") != std::string::npos);
  // Every row shape: registers (short), strided passes (long, dynamic), rows
  // from two variables.
  for (const std::string &what : testing::softmax_row_kinds()) {
    INFO(what);
    Example ex = testing::softmax_rows(what);
    cuda::CompiledLayer sc = cuda::compile_layer(ex.pipeline, preset("megablocks"));
    check_resources(sc, "softmax " + what);
    const GeneratedKernel &k = kernel_named(sc, "pointwise_p");
    CHECK(k.grid.threads_per_element == 32);
    CHECK(k.grid.count.size() == (what == "3d" ? 2u : 1u));
    std::string src = kernel_source(sc, "pointwise_p");
    CHECK(src.find("mf::warp_max(row_max)") != std::string::npos);
    bool in_registers = what == "short" || what == "3d";
    CHECK((src.find("float xs[3]") != std::string::npos) == in_registers);
    CHECK((src.find(" += 32)") != std::string::npos) == !in_registers);
  }
}

TEST_CASE("codegen: outputs of wgmma tiles are stored two column groups at a time") {
  // h and o_gated (bf16) go out through mf::store2x2, bounded by N; so do
  // the router's 8 logits in a 128-wide tile and a 2880-wide h (partial last
  // tiles). f32 outputs: the k = 1 case, y.
  Example ex = make_example("moe_mlp", small());
  const std::string src = cuda::compile_layer(ex.pipeline, preset("scattermoe")).source.source;
  CHECK(src.find("mf::store2x2(g_h + out_row * N, col, v0, v1, w0, w1, N);") != std::string::npos);
  CHECK(src.find("mf::store2x2(g_o_gated + out_row * N, col, v0, v1, w0, w1, N);") != std::string::npos);
  CHECK(src.find("mf::store2x2(g_logits + out_row * N, col, v0, v1, w0, w1, N);") != std::string::npos); // N = 8
  ExampleShape s = small();
  s.d = s.f = 2880;
  Example masked = make_example("moe_mlp", s);
  CHECK(cuda::compile_layer(masked.pipeline, preset("scattermoe"))
            .source.source.find("mf::store2x2(g_h + out_row * N, col, v0, v1, w0, w1, N);") != std::string::npos);
  ExampleShape one = small();
  one.topk = 1;
  Example k1 = make_example("moe_mlp", one);
  CHECK(cuda::compile_layer(k1.pipeline, preset("scattermoe")).source.source.find("mf::store2x2(g_y + out_row * N") !=
        std::string::npos);
}

TEST_CASE("codegen: every example compiles under its default schedule, forward and training, without spills") {
  // What `moeforge run` / `train` and MoELayer run on a GPU with no schedule
  // named (nothing tuned): a layer the CUDA target refused or spilled under
  // it (moa's training did, until padded_elementwise left its reductions
  // over the tokens in pair order) would fail a user at the first step.
  for (const std::string &name : example_names()) {
    Example ex = make_example(name, testing::shape(64, 128, 256, 8, 2));
    const Func out = ex.pipeline.func(ex.output);
    testing::check_resources(cuda::compile_layer(ex.pipeline, default_schedule(ex.pipeline, {})),
                             name + " forward, default");
    testing::check_resources(cuda::compile_training(ex.pipeline, out, default_schedule(ex.pipeline, {out})).layer,
                             name + " training, default");
  }
}
