// The LLVM CPU backend against the Eigen reference: every preset x example,
// the dense MLP, the MoE edge cases, an untiled dimension, repeated runs and
// the compile cache. Outputs are poisoned (NaN) before each run, so an
// element no step writes fails the comparison.
#include <doctest/doctest.h>

#include "cpu_compare.h"
#include "dsl/error.h"
#include "examples/gradient_nodes.h"
#include "examples/norm_layers.h"
#include "softmax_layers.h"

using namespace moeforge;
using namespace moeforge::cpu_test;

TEST_SUITE("cpu") {
  TEST_CASE("cpu layer: every preset x example matches the reference") {
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (const std::string &p : preset_names()) {
        ExampleShape s = shape(200, 64, 128, 8, 2);
        Example ex = make_example(name, s);
        Outcome o = run_and_compare(ex, ex.random_inputs(s, 11), s.tokens, preset(p));
        INFO(name << " / " << p);
        CHECK(o.routing_mismatches == 0);
        CHECK(o.y_error <= 1e-2);
      }
  }

  TEST_CASE("cpu layer: the dense MLP (no routing) matches the reference") {
    ExampleShape s = shape(150, 64, 128, 1, 1);
    Example ex = make_example("dense_mlp", s);
    for (const std::string &p : preset_names()) {
      Outcome o = run_and_compare(ex, ex.random_inputs(s, 5), s.tokens, preset(p));
      INFO(p);
      CHECK(o.y_error <= 1e-2);
    }
  }

  // Attention's scores q k^T have a column per token: a GEMM whose N is
  // dynamic, over several column blocks (300 tokens, 128-wide tiles) and a
  // partial last one.
  TEST_CASE("cpu layer: attention (a GEMM over a dynamic column extent) matches the reference") {
    for (int64_t tokens : {24, 300}) {
      ExampleShape s = shape(tokens, 64, 128, 1, 1);
      Example ex = make_example("attention", s);
      Outcome o = run_and_compare(ex, ex.random_inputs(s, 8), s.tokens, preset("megablocks"));
      INFO("T = " << tokens);
      CHECK(o.y_error <= 1e-2);
    }
  }

  TEST_CASE("cpu layer: MoE edge cases under every preset") {
    testing::check_edge_cases(64, 128, preset_names(),
                              [](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &p) {
                                return run_and_compare(ex, in, tokens, preset(p));
                              });
  }

  TEST_CASE("cpu layer: dimensions no tile divides (d = f = 72 with 64-wide tiles)") {
    ExampleShape s = shape(90, 72, 72, 8, 2);
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (const char *perm : {"blocked", "scattered"}) {
        Example ex = make_example(name, s);
        Schedule sch(std::string("untiled_") + perm);
        sch.permutation(std::string(perm) == "blocked" ? Permutation::blocked : Permutation::scattered)
            .block(64)
            .tile("*", 64, 64, 32);
        Outcome o = run_and_compare(ex, ex.random_inputs(s, 9), s.tokens, sch);
        INFO(name << " / " << perm);
        CHECK(o.y_error <= 1e-2);
      }
  }

  TEST_CASE("cpu layer: a cached JIT serves an identical layer built anew") {
    // The cache is keyed by IR text, so a second, separately built pipeline
    // with the same algebra gets the first one's functions; its arguments must
    // still name its own routes (the first pipeline is gone by then).
    ExampleShape s = shape(96, 64, 128, 8, 2);
    std::shared_ptr<const cpu::JitProgram> first_jit;
    {
      Example gone = make_example("moe_mlp", s);
      first_jit = cpu::compile_cpu_layer(gone.pipeline, preset("scattermoe")).jit;
    }
    Example ex = make_example("moe_mlp", s);
    Outcome o = run_and_compare(ex, ex.random_inputs(s, 5), s.tokens, preset("scattermoe"));
    CHECK(cpu::compile_cpu_layer(ex.pipeline, preset("scattermoe")).jit.get() == first_jit.get());
    CHECK(o.routing_mismatches == 0);
    CHECK(o.y_error <= 1e-2);
  }

  TEST_CASE("cpu layer: a second run rewrites everything and programs are compiled once") {
    ExampleShape s = shape(64, 64, 64, 8, 2);
    Example ex = make_example("swiglu_moe", s);
    cpu::CompiledCpuLayer a = cpu::compile_cpu_layer(ex.pipeline, preset("megablocks"));
    cpu::CompiledCpuLayer b = cpu::compile_cpu_layer(ex.pipeline, preset("megablocks"));
    CHECK(a.jit.get() == b.jit.get()); // the cache hit: one JIT for the same IR
    cpu::CpuLayer layer(a, s.tokens);
    TensorMap in = ex.random_inputs(s, 2);
    layer.upload(in);
    layer.run();
    HostTensor first = layer.download("y");
    layer.poison();
    layer.run();
    CHECK(normalized_error(layer.download("y"), first) == 0.0);
    // A different token count reuses the same compiled program.
    ExampleShape s2 = s;
    s2.tokens = 37;
    cpu::CpuLayer other(a, s2.tokens);
    TensorMap in2 = ex.random_inputs(s2, 3);
    other.upload(in2);
    other.poison();
    other.run();
    CHECK(normalized_error(other.download("y"), evaluate(ex.pipeline, in2)["y"]) <= 1e-2);
  }

  TEST_CASE("cpu layer: a k = 1 MoE whose combine runs in the GEMM epilogue matches the reference") {
    // k = 1: y(t, i) is written by o's GEMM at row r = t (no pointwise_y).
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (const std::string &p : preset_names())
        for (int64_t tokens : {int64_t(200), int64_t(5)}) {
          ExampleShape s = shape(tokens, 64, 128, 8, 1);
          Example ex = make_example(name, s);
          cpu::CompiledCpuLayer c = cpu::compile_cpu_layer(ex.pipeline, preset(p));
          INFO(name << " / " << p << " / T = " << tokens);
          CHECK(c.jit->ir.find("@moeforge_pointwise_y(") == std::string::npos);
          Outcome o = run_and_compare(ex, ex.random_inputs(s, 21), s.tokens, preset(p));
          CHECK(o.routing_mismatches == 0);
          CHECK(o.y_error <= 1e-2);
        }
    // Skewed routing with renormalised gates (each gate is 1 for k = 1).
    ExampleShape s = shape(300, 64, 128, 16, 1);
    Example ex = biased_moe(s, true, Bias::ramp, true);
    for (const std::string &p : preset_names()) {
      Outcome o = run_and_compare(ex, biased_inputs(ex, s, Bias::ramp, 4), s.tokens, preset(p));
      INFO(p);
      CHECK(o.routing_mismatches == 0);
      CHECK(o.y_error <= 1e-2);
    }
  }

  TEST_CASE("cpu layer: softmax rows of every shape match the reference") {
    // The layers the CUDA tests run a warp per row on (softmax_layers.h).
    for (const std::string &what : testing::softmax_row_kinds()) {
      ExampleShape s = shape(45, 1, 1, 1, 1); // only the token count matters
      Example ex = testing::softmax_rows(what);
      Outcome o = run_and_compare(ex, ex.random_inputs(s, 8), s.tokens, preset("megablocks"), 1e-5);
      INFO(what);
      CHECK(o.y_error <= 1e-5); // f32 end to end
    }
  }

  TEST_CASE("cpu layer: the generated LLVM IR has one function per step") {
    ExampleShape s = shape(64, 64, 64, 8, 2);
    Example ex = make_example("moe_mlp", s);
    std::string ir = cpu::cpu_llvm_ir(ex.pipeline, preset("megablocks"));
    CHECK(ir.find("define void @moeforge_gemm_h(ptr") != std::string::npos);
    CHECK(ir.find("define void @moeforge_gather_x_padded_") != std::string::npos);
    CHECK(ir.find("define void @moeforge_pointwise_y(ptr") != std::string::npos);
    std::string opt = cpu::cpu_llvm_ir(ex.pipeline, preset("megablocks"), /*optimised=*/true);
    CHECK(opt.find("define void @moeforge_gemm_h(") != std::string::npos);
    // The K loop was vectorised (8 or 16 lanes, as the host's vector units allow).
    CHECK((opt.find("<8 x float>") != std::string::npos || opt.find("<16 x float>") != std::string::npos));
  }
}

TEST_SUITE("cpu") {
  TEST_CASE("cpu layer: user errors name the problem") {
    ExampleShape s = shape(16, 64, 64, 8, 2);
    Example ex = make_example("moe_mlp", s);
    cpu::CompiledCpuLayer c = cpu::compile_cpu_layer(ex.pipeline, preset("scattermoe"));
    CHECK_THROWS_WITH_AS(cpu::CpuLayer(c, 0), "a layer needs at least one token (got 0)", UserError);
    cpu::CpuLayer layer(c, s.tokens);
    TensorMap in = ex.random_inputs(s, 1);
    in.erase("w2");
    CHECK_THROWS_WITH_AS(layer.upload(in), "no tensor given for input 'w2'", UserError);
    in = ex.random_inputs(shape(17, 64, 64, 8, 2), 1);
    CHECK_THROWS_WITH_AS(layer.upload(in),
                         "input 'x' has shape (17, 64), and at 16 tokens the layer takes (16, 64) (T, D): give it "
                         "that shape, or make the layer for the token count it has",
                         UserError);
    CHECK_THROWS_WITH_AS(layer.routed_experts("nope"), "no route named 'nope' in this layer", UserError);
  }

  // The CPU backend has no 16-byte rows to keep: experts, d and f that are
  // not multiples of 8 run (the CUDA backend asks to pad them).
  TEST_CASE("cpu layer: extents that are not multiples of 8 (E 6, d 100, f 60) match the reference") {
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (const std::string &p : preset_names()) {
        ExampleShape s = shape(150, 100, 60, 6, 2);
        Example ex = make_example(name, s);
        Outcome o = run_and_compare(ex, ex.random_inputs(s, 21), s.tokens, preset(p));
        INFO(name << " / " << p);
        CHECK(o.routing_mismatches == 0);
        CHECK(o.y_error <= 1e-2);
      }
  }

  TEST_CASE("cpu layer: RMSNorm (sqrt and rsqrt) matches the reference") {
    ExampleShape s = shape(150, 64, 128, 1, 1);
    Example ex = rmsnorm_layer(s);
    Outcome o = run_and_compare(ex, ex.random_inputs(s, 3), s.tokens, preset("megablocks"));
    CHECK(o.worst_error <= 1e-5); // f32 end to end
  }

  TEST_CASE("cpu layer: step and [a == b] (the gradient nodes) match the reference") {
    ExampleShape s = shape(77, 24, 8, 8, 2);
    Example ex = gradient_nodes_layer(s);
    for (const char *p : {"megablocks", "scattermoe"}) {
      Outcome o = run_and_compare(ex, ex.random_inputs(s, 13), s.tokens, preset(p));
      INFO(p);
      CHECK(o.routing_mismatches == 0);
      CHECK(o.worst_error <= 1e-5); // f32 end to end: no bf16 rounding here
    }
  }

  TEST_CASE("cpu layer: run() before upload() and download() of an unknown name are user errors") {
    ExampleShape s = shape(32, 64, 128, 8, 2);
    Example ex = make_example("moe_mlp", s);
    cpu::CompiledCpuLayer compiled = cpu::compile_cpu_layer(ex.pipeline, preset("scattermoe"));
    cpu::CpuLayer layer(compiled, s.tokens);
    // Nothing uploaded: run() would compute on zeros.
    CHECK_THROWS_WITH_AS(layer.run(), doctest::Contains("run() before upload() of 'x'"), UserError);
    TensorMap in = ex.random_inputs(s, 3);
    layer.upload("x", in.at("x"));
    CHECK_THROWS_WITH_AS(layer.run(), doctest::Contains("run() before upload() of 'wr'"), UserError);
    // A result before any run computed it (it would read as zeros), then a
    // name the layer lacks.
    CHECK_THROWS_WITH_AS(layer.download("h"), doctest::Contains("download(\"h\"): no step has computed 'h'"),
                         UserError);
    CHECK_THROWS_WITH_AS(layer.download("y"), doctest::Contains("run the layer first"), UserError);
    layer.upload(in);
    layer.run();
    CHECK(layer.download("y").shape == std::vector<int64_t>{s.tokens, s.d});
    // New weights: y is the old inputs' until the next run (never returned
    // as if it were the new one's); the input itself reads back.
    layer.upload("w2", in.at("w2"));
    CHECK_THROWS_WITH_AS(layer.download("y"), doctest::Contains("since the inputs it is made from were last given"),
                         UserError);
    CHECK(layer.download("h").shape.size() == 2); // made from x, w1 and the routing: still this run's
    CHECK(layer.download("w2").shape == in.at("w2").shape);
    layer.run();
    CHECK(layer.download("y").shape == std::vector<int64_t>{s.tokens, s.d});
    CHECK_THROWS_WITH_AS(layer.download("nope"),
                         doctest::Contains("download(\"nope\"): this layer holds no tensor of that name; it holds"),
                         UserError);
  }
}
