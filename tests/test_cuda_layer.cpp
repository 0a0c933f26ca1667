// The CUDA backend against the Eigen reference, on the GPU: every preset x
// example, the MoE edge cases, skewed routing, an untiled dimension, and a
// whole forward captured in a CUDA graph. Outputs are poisoned (NaN) before
// each run, so an element no kernel writes fails the comparison. Skips
// visibly without a GPU.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "backends/cuda/runtime/layer.h"
#include "backends/reference/evaluate.h"
#include "cuda_forward_compare.h"
#include "dsl/error.h"
#include "examples/biased_moe.h"
#include "gpu_test.h"
#include "layer_compare.h"
#include "schedules/presets.h"
#include "softmax_layers.h"

using namespace moeforge;

namespace {

using testing::cuda_forward_and_compare;
using testing::EdgeCase;
using testing::Outcome;
using testing::shape;

double normalized_error(const HostTensor &a, const HostTensor &b) {
  REQUIRE(a.shape == b.shape);
  return max_normalized_error(a, b);
}

// Both MoE examples under both presets at shape s, inputs from `seed`.
void check_every_preset(const ExampleShape &s, uint64_t seed) {
  for (const char *name : {"moe_mlp", "swiglu_moe"})
    for (const char *p : {"megablocks", "scattermoe"}) {
      Example ex = make_example(name, s);
      Outcome o = cuda_forward_and_compare(ex, ex.random_inputs(s, seed), s.tokens, preset(p));
      INFO(name << " / " << p);
      CHECK(o.routing_mismatches == 0);
      CHECK(o.y_error <= 1e-2);
    }
}

// Every example at every shape under every schedule, inputs from `seed`.
void check_schedules(const std::vector<ExampleShape> &shapes, const std::vector<const char *> &examples,
                     const std::vector<Schedule> &schedules, uint64_t seed) {
  for (const ExampleShape &s : shapes)
    for (const char *example : examples) {
      Example ex = make_example(example, s);
      for (const Schedule &sch : schedules) {
        Outcome o = cuda_forward_and_compare(ex, ex.random_inputs(s, seed), s.tokens, sch);
        INFO(example << " T=" << s.tokens << " " << sch.to_text());
        CHECK(o.routing_mismatches == 0);
        CHECK(o.y_error <= 1e-2);
      }
    }
}

} // namespace

TEST_SUITE("gpu") {
  TEST_CASE("cuda layer: every preset x example matches the reference") {
    MOEFORGE_REQUIRE_GPU();
    check_every_preset(shape(512, 256, 512, 8, 2), 11);
  }

  TEST_CASE("cuda layer: wide rows (the padded copy's four chunks a thread) match the reference") {
    MOEFORGE_REQUIRE_GPU();
    // d = 1024 and 1056: the blocked permutation copies x's rows four 16-byte
    // chunks a thread (132 chunks: 33 threads a row, past a warp).
    check_every_preset(shape(300, 1024, 256, 8, 2), 23);
    check_every_preset(shape(77, 1056, 128, 8, 2), 29);
  }

  TEST_CASE("cuda layer: k = 1 with the combine in the GEMM epilogue matches the reference") {
    MOEFORGE_REQUIRE_GPU();
    // E = 64 as the mbpaper benchmark: y written by o's GEMM at row r = t.
    check_every_preset(shape(700, 256, 512, 64, 1), 17);
    // Skewed routing, renormalised gates, replayed from a CUDA graph after a poison.
    ExampleShape s = shape(333, 128, 256, 16, 1);
    Example ex = biased_moe(s, true, Bias::ramp, true);
    for (const char *p : {"megablocks", "scattermoe"}) {
      Outcome o =
          cuda_forward_and_compare(ex, biased_inputs(ex, s, Bias::ramp, 6), s.tokens, preset(p), /*use_graph=*/true);
      INFO(p);
      CHECK(o.routing_mismatches == 0);
      CHECK(o.y_error <= 1e-2);
    }
  }

  TEST_CASE("cuda layer: softmax a warp per row matches the reference for every row shape") {
    MOEFORGE_REQUIRE_GPU();
    for (const std::string &what : testing::softmax_row_kinds())
      for (int64_t tokens : {int64_t(1), int64_t(45), int64_t(1000)}) {
        ExampleShape s = shape(tokens, 1, 1, 1, 1); // only the token count matters
        Example ex = testing::softmax_rows(what);
        Outcome o = cuda_forward_and_compare(ex, ex.random_inputs(s, 8), s.tokens, preset("megablocks"));
        INFO(what << " / T = " << tokens);
        CHECK(o.y_error <= 1e-5); // f32 end to end
      }
  }

  TEST_CASE("cuda layer: the dense MLP (no routing) matches the reference") {
    MOEFORGE_REQUIRE_GPU();
    ExampleShape s = shape(300, 128, 256, 1, 1);
    Example ex = make_example("dense_mlp", s);
    static cuda::Device device;
    cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, preset("megablocks"), device.arch_specific());
    cuda::CudaLayer layer(device, c, s.tokens);
    TensorMap in = ex.random_inputs(s, 5);
    layer.upload(in);
    layer.poison();
    cuda::Stream st;
    layer.enqueue(st);
    st.synchronize();
    EvalResult ref = evaluate(ex.pipeline, in, Precision::f64);
    CHECK(normalized_error(layer.download("y"), ref["y"]) <= 1e-2);
  }

  TEST_CASE("cuda layer: enqueue() before upload() and download() of an unknown name are user errors") {
    MOEFORGE_REQUIRE_GPU();
    ExampleShape s = shape(64, 128, 256, 8, 2);
    Example ex = make_example("moe_mlp", s);
    static cuda::Device device;
    cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, preset("scattermoe"), device.arch_specific());
    cuda::CudaLayer layer(device, c, s.tokens);
    cuda::Stream st;
    CHECK_THROWS_WITH_AS(layer.enqueue(st), doctest::Contains("enqueue() before upload() of 'x'"), UserError);
    layer.upload(ex.random_inputs(s, 6));
    layer.enqueue(st);
    st.synchronize();
    CHECK(layer.download("y").shape == std::vector<int64_t>{s.tokens, s.d});
    CHECK_THROWS_WITH_AS(layer.download("nope"),
                         doctest::Contains("download(\"nope\"): this layer holds no tensor of that name"), UserError);
  }

  TEST_CASE("cuda layer: MoE edge cases under both presets") {
    MOEFORGE_REQUIRE_GPU();
    testing::check_edge_cases(128, 256, preset_names(),
                              [](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &p) {
                                return cuda_forward_and_compare(ex, in, tokens, preset(p));
                              });
  }

  TEST_CASE("cuda layer: a dimension no tile divides (d = f = 2880)") {
    MOEFORGE_REQUIRE_GPU();
    ExampleShape s = shape(96, 2880, 2880, 8, 2);
    Example ex = make_example("swiglu_moe", s);
    for (const char *p : {"megablocks", "scattermoe"}) {
      Outcome o = cuda_forward_and_compare(ex, ex.random_inputs(s, 9), s.tokens, preset(p));
      INFO(p);
      CHECK(o.y_error <= 1e-2);
    }
  }

  TEST_CASE("cuda layer: other tilings give the same result") {
    MOEFORGE_REQUIRE_GPU();
    ExampleShape s = shape(400, 192, 320, 8, 2);
    Example ex = make_example("swiglu_moe", s);
    Schedule a("small_tiles");
    a.permutation(Permutation::scattered).block(64).tile("*", 64, 64, 64).stages("*", 3).warps("*", 2, 2);
    Schedule b("unfused");
    b.permutation(Permutation::blocked).block(256).tile("*", 128, 64, 32).fuse_epilogue("h", false);
    Schedule c("wgmma_wide");
    c.permutation(Permutation::scattered).block(64).tile("*", 64, 256, 64).warps("*", 4, 1).stages("*", 3);
    c.mma("*", MmaKind::wgmma).tile("h", 64, 128, 64);
    Schedule d("wgmma_narrow");
    d.permutation(Permutation::blocked).block(256).tile("*", 128, 64, 64).warps("*", 8, 1).mma("*", MmaKind::wgmma);
    Schedule e("wgmma_ws");
    e.permutation(Permutation::scattered).tile("*", 128, 128, 64).warps("*", 8, 1).mma("*", MmaKind::wgmma_ws);
    Schedule f("wgmma_ws_blocked");
    f.permutation(Permutation::blocked).block(64).tile("*", 64, 256, 64).warps("*", 4, 1).stages("*", 5);
    f.mma("*", MmaKind::wgmma_ws).tile("h", 64, 128, 64);
    // Persistent blocks walking every tile, scattered and blocked (a routed
    // grid's upper bound leaves tiles to skip), and a dense router GEMM.
    Schedule g("persistent_scattered");
    g.permutation(Permutation::scattered).tile("*", 128, 128, 64).warps("*", 8, 1).mma("*", MmaKind::wgmma_ws);
    g.persistent("*", true);
    Schedule h("persistent_blocked");
    h.permutation(Permutation::blocked).block(64).tile("*", 64, 256, 64).warps("*", 4, 1).stages("*", 5);
    h.mma("*", MmaKind::wgmma_ws).tile("h", 64, 128, 64).persistent("*", true);
    for (const Schedule &sch : {a, b, c, d, e, f, g, h}) {
      Outcome o = cuda_forward_and_compare(ex, ex.random_inputs(s, 4), s.tokens, sch);
      INFO(sch.to_text());
      CHECK(o.y_error <= 1e-2);
    }
  }

  TEST_CASE("cuda layer: TMA B tiles give the same result with K and N tails") {
    MOEFORGE_REQUIRE_GPU();
    // d = 200, f = 328: neither is a multiple of the 64-wide boxes, so the
    // copy engine's zero fill past K and N is what keeps the sums right.
    ExampleShape s = shape(333, 200, 328, 8, 2);
    Schedule a("tma_scattered");
    a.permutation(Permutation::scattered).tile("*", 128, 128, 64).mma("*", MmaKind::wgmma_ws).tma("*", true);
    a.tile("o", 128, 256, 64);
    Schedule b("tma_blocked_persistent");
    b.permutation(Permutation::blocked).block(64).tile("*", 64, 256, 64).stages("*", 5);
    b.mma("*", MmaKind::wgmma_ws).tile("h", 64, 128, 64).persistent("*", true).tma("*", true);
    Schedule c("tma_plain_wgmma");
    c.permutation(Permutation::scattered).tile("*", 128, 128, 64).stages("*", 3).mma("*", MmaKind::wgmma);
    c.tma("*", true);
    Schedule d("tma_plain_wgmma_blocked");
    d.permutation(Permutation::blocked).tile("*", 128, 128, 64).stages("*", 4).mma("*", MmaKind::wgmma);
    d.tma("*", true).tile("h", 128, 64, 64);
    // Two-block clusters sharing B: pairs of one expert multicast, the
    // others (an expert's odd last tile, a pair across experts) run alone.
    Schedule e("tma_cluster_scattered");
    e.permutation(Permutation::scattered).tile("*", 128, 256, 64).mma("*", MmaKind::wgmma_ws).tma("*", true);
    e.cluster("*", 2).tile("h", 128, 128, 64);
    Schedule f("tma_cluster_blocked_b64");
    f.permutation(Permutation::blocked).block(64).tile("*", 64, 256, 64).stages("*", 5);
    f.mma("*", MmaKind::wgmma_ws).tile("h", 64, 128, 64).tma("*", true).cluster("*", 2);
    for (const char *example : {"moe_mlp", "swiglu_moe"}) {
      Example ex = make_example(example, s);
      for (const Schedule &sch : {a, b, c, d, e, f}) {
        Outcome o = cuda_forward_and_compare(ex, ex.random_inputs(s, 5), s.tokens, sch);
        INFO(example << " " << sch.to_text());
        CHECK(o.y_error <= 1e-2);
      }
    }
  }

  TEST_CASE("cuda layer: output tiles stored through TMA match the reference") {
    MOEFORGE_REQUIRE_GPU();
    // tma_store: h (bf16, tile order) leaves each tile through shared memory
    // and the copy engine. d = 200, f = 328: the boxes cross N (dropped
    // columns) and every expert's last tile holds padding rows (staged as
    // zeros); a warpgroup with no rows stores nothing. Under the warp-
    // specialised loop, the plain wgmma loop, clusters and the blocked
    // permutation, and the MoE edge cases.
    Schedule a("tma_store_scattered");
    a.permutation(Permutation::scattered).tile("*", 128, 128, 64).mma("*", MmaKind::wgmma_ws).tma("*", true);
    a.tma_store("*", true);
    Schedule b("tma_store_plain_wgmma_blocked");
    b.permutation(Permutation::blocked).tile("*", 128, 128, 64).stages("*", 3).mma("*", MmaKind::wgmma);
    b.tma("*", true).tile("h", 128, 64, 64).tma_store("*", true);
    // A cluster per pair of row tiles keeps plain stores (its plan says so).
    Schedule c("tma_store_cluster_halves");
    c.permutation(Permutation::scattered).block(256).tile("*", 128, 256, 64).mma("*", MmaKind::wgmma_ws);
    c.tma("*", true).cluster("*", 2).tile("h", 128, 128, 64).tma_store("*", true);
    Schedule d("tma_store_b64");
    d.permutation(Permutation::scattered).block(64).tile("*", 64, 256, 64).stages("*", 5);
    d.mma("*", MmaKind::wgmma_ws).tile("h", 64, 128, 64).tma("*", true).tma_store("*", true);
    // Persistent blocks stage in a buffer of their own (3 stages to fit).
    Schedule e("tma_store_persistent");
    e.permutation(Permutation::scattered).block(256).tile("*", 128, 128, 64).stages("*", 3);
    e.mma("*", MmaKind::wgmma_ws).tma("*", true).persistent("*", true).tma_store("*", true);
    for (const ExampleShape &s : {shape(333, 200, 328, 8, 2), shape(1500, 256, 512, 8, 1)})
      for (const char *example : {"moe_mlp", "swiglu_moe", "dense_mlp"}) {
        Example ex = make_example(example, s);
        for (const Schedule &sch : {a, b, c, d, e}) {
          Outcome o = cuda_forward_and_compare(ex, ex.random_inputs(s, 7), s.tokens, sch);
          INFO(example << " T=" << s.tokens << " " << sch.to_text());
          CHECK(o.y_error <= 1e-2);
        }
      }
    testing::check_edge_cases(128, 256, {"tma_store"},
                              [&](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &) {
                                return cuda_forward_and_compare(ex, in, tokens, a);
                              });
  }

  TEST_CASE("cuda layer: two-block clusters on the halves of 256-row routing tiles match the reference") {
    MOEFORGE_REQUIRE_GPU();
    // block(256) with 128-row tiles: each cluster takes both halves of one
    // expert's routing tile and multicasts B when the second half holds rows;
    // a half-empty routing tile (an expert's last) runs its first half alone.
    // 1500 tokens x k = 2 over 8 experts: ~375 rows each, so every expert has
    // a shared pair and a lone last half; 700 x k = 1 over 16: ~44 rows, so
    // nothing shares. d = 200, f = 328: K and N tails in the boxes.
    Schedule a("cluster_halves_scattered");
    a.permutation(Permutation::scattered).block(256).tile("*", 128, 256, 64).mma("*", MmaKind::wgmma_ws);
    a.tma("*", true).cluster("*", 2).tile("h", 128, 128, 64);
    Schedule b("cluster_halves_blocked");
    b.permutation(Permutation::blocked).block(256).tile("*", 128, 128, 64).mma("*", MmaKind::wgmma_ws);
    b.tma("*", true).cluster("*", 2).stages("*", 3);
    check_schedules({shape(1500, 200, 328, 8, 2), shape(700, 256, 512, 16, 1)}, {"moe_mlp", "swiglu_moe"}, {a, b}, 6);
  }

  TEST_CASE("cuda layer: persistent two-block clusters match the reference") {
    MOEFORGE_REQUIRE_GPU();
    // The pair walks items drawn by rank 0: routing tiles 2m and 2m + 1 in
    // the pair-aligned order (one expert's, sharing B; or two experts' last
    // tiles, each loading its own; or the last of an odd count with an idle
    // partner), or the halves of 256-row routing tiles (an expert's last
    // half-empty tile leaves rank 1 idle). Shapes as the non-persistent
    // cluster tests, plus the dense MLP (an odd count of row tiles) and the
    // MoE edge cases.
    Schedule a("persistent_pairs_scattered");
    a.permutation(Permutation::scattered).tile("*", 128, 256, 64).mma("*", MmaKind::wgmma_ws).tma("*", true);
    a.cluster("*", 2).persistent("*", true).tile("h", 128, 128, 64);
    Schedule b("persistent_pairs_halves_blocked");
    b.permutation(Permutation::blocked).block(256).tile("*", 128, 128, 64).mma("*", MmaKind::wgmma_ws);
    b.tma("*", true).cluster("*", 2).persistent("*", true).stages("*", 3);
    // With TMA stores: each block stages its tile past its own ring (the
    // tile-order outputs: h when scattered, h and o when blocked), a block
    // whose half of the item is empty stores nothing.
    Schedule c = a, d = b;
    c.tma_store("*", true);
    d.tma_store("*", true);
    check_schedules({shape(1500, 200, 328, 8, 2), shape(700, 256, 512, 16, 1), shape(333, 200, 328, 8, 2)},
                    {"moe_mlp", "swiglu_moe", "dense_mlp"}, {a, b, c, d}, 8);
    for (const Schedule &s : {a, d})
      testing::check_edge_cases(128, 256, {"persistent pairs"},
                                [&](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &) {
                                  return cuda_forward_and_compare(ex, in, tokens, s, /*use_graph=*/true);
                                });
  }

  TEST_CASE("cuda layer: a whole forward captured in a CUDA graph replays correctly") {
    MOEFORGE_REQUIRE_GPU();
    // Capture fails on any device-to-host synchronisation inside the step.
    ExampleShape s = shape(700, 128, 256, 8, 2);
    Example ex = make_example("swiglu_moe", s);
    for (const char *p : {"megablocks", "scattermoe"}) {
      Outcome o = cuda_forward_and_compare(ex, ex.random_inputs(s, 21), s.tokens, preset(p), /*use_graph=*/true);
      INFO(p);
      CHECK(o.y_error <= 1e-2);
    }
  }
}
