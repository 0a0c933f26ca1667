// Training on the CUDA backend: the backward pass derived from the algebra,
// lowered (transposed operands, expert reductions, reductions kept as loops)
// and compiled. Without a GPU: every preset x example x memory choice
// compiles through NVRTC for sm_90a without spills. On the GPU: forward and
// backward against the Eigen reference of the same training algebra (every
// gradient and every intermediate the program keeps, outputs poisoned with
// NaN first), including the MoE edge cases.
#include <doctest/doctest.h>

#include <random>

#include "backends/cuda/runtime/training_layer.h"
#include "benchmarks/train_schedule.h"
#include "cuda_resources.h"
#include "cuda_training_step.h"
#include "dsl/training.h"
#include "examples/aux_loss_example.h"
#include "examples/biased_moe.h"
#include "examples/norm_layers.h"
#include "gpu_test.h"
#include "layer_compare.h"
#include "lowering/default_schedule.h"
#include "schedules/presets.h"
#include "training_compare.h"
#include "whole_gradient.h"

using namespace moeforge;
using testing::check_resources;
using testing::kernel_source;

namespace {

using testing::Outcome;
using testing::shape;

using testing::training_example;
using testing::training_preset;
using testing::upstream_gradient;

Outcome train_and_compare(const Example &ex, const TensorMap &inputs, int64_t tokens, const Schedule &schedule) {
  return testing::cuda_train_and_compare(ex, inputs, tokens, schedule);
}

// The layer with its auxiliary losses through cuda::TrainingLayer: d_y
// random, the losses' 0-D seeds 1.0; every output, gradient and kept
// intermediate against the reference of the training algebra.
Outcome train_aux_and_compare(const AuxLossLayer &a, TensorMap inputs, int64_t tokens, const Schedule &schedule) {
  static cuda::Device device;
  std::vector<Func> outputs = a.output_funcs();
  cuda::CompiledTraining compiled =
      cuda::compile_training(a.example.pipeline, outputs, schedule, device.arch_specific());
  const TrainingProgram &tp = compiled.training;
  REQUIRE(tp.outputs == a.outputs);
  cuda::TrainingLayer layer(device, compiled, tokens);
  std::mt19937_64 rng(11);
  inputs[tp.seeds[0]] = random_tensor({tokens, a.example.pipeline.func(tp.outputs[0]).args()[1].dim().extent()}, rng,
                                      -1.0, 1.0, /*bf16=*/false);
  for (size_t k = 1; k < tp.seeds.size(); ++k)
    inputs[tp.seeds[k]] = HostTensor(std::vector<int64_t>{}, 1.0);
  layer.upload(inputs);
  layer.poison();
  for (size_t k = 0; k < tp.outputs.size(); ++k)
    layer.upload_upstream_gradient(tp.outputs[k], inputs.at(tp.seeds[k]));
  cuda::Stream stream;
  layer.forward(stream);
  layer.backward(stream);
  stream.synchronize();
  Example t = a.example;
  t.pipeline = training_algebra(a.example.pipeline, outputs).pipeline;
  for (const std::string &o : tp.outputs)
    CHECK(layer.output(o).data == layer.download(o).data);
  return testing::compare_with_reference(t, inputs, tp.program, layer, schedule.to_text(), 2e-2,
                                         /*floor_fraction=*/1e-3);
}

} // namespace

TEST_CASE("cuda training: every preset x example x memory choice compiles for sm_90a without spills") {
  ExampleShape s = shape(64, 64, 128, 8, 2);
  for (const char *name : {"moe_mlp", "swiglu_moe"})
    for (const char *p : {"megablocks", "scattermoe", "megablocks+lean", "scattermoe+padded+lean",
                          "scattermoe+padded+lean+chain+atomic+gather", "scattermoe+padded+lean+chain+split",
                          "scattermoe+padded+lean+chain+upstream+boundary"})
      for (bool recompute : {false, true}) {
        Example ex = make_example(name, s);
        cuda::CompiledTraining c =
            cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), training_preset(p, recompute));
        check_resources(c.layer, std::string(name) + " / " + p + (recompute ? " / recompute" : ""));
        // The backward has the expert reductions, reading A (M-major) and B in
        // place (rows by cp.async; by TMA in the padded order).
        CHECK(c.layer.source.source.find("k_begin") != std::string::npos);
        if (std::string(p).find("+padded") == std::string::npos)
          CHECK(c.layer.source.source.find("A and B by rows") != std::string::npos);
        CHECK(c.layer.source.source.find("over the padded rows of route") == std::string::npos);
        CHECK(c.training.forward_steps < c.training.program.steps.size());
      }
}

TEST_CASE("cuda training: the default schedule with the backward's memory choices compiles for sm_90a without spills") {
  for (const char *name : {"moe_mlp", "swiglu_moe"})
    for (const ExampleShape &s : {shape(64, 64, 128, 8, 2), shape(64, 256, 256, 16, 4)}) {
      Example ex = make_example(name, s);
      const Func out = ex.pipeline.func(ex.output);
      Schedule sch = default_schedule(ex.pipeline, {out});
      sch.atomic_combine(true).gather_in_gemms(true);
      cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, out, sch);
      check_resources(c.layer, std::string(name) + " / d = " + std::to_string(s.d));
      // The experts' input-gradient GEMM adds onto the router's share; no
      // padded copy of x or dy is made.
      int onto = 0;
      for (const Step &st : c.training.program.steps) {
        if (const auto *g = std::get_if<GemmStep>(&st))
          onto += g->out_add_onto_written;
        CHECK(!std::holds_alternative<GatherStep>(st));
      }
      CHECK(onto == 1);
      // dy's rows alone gathered: dW2 walks persistently with its A (the
      // gated h) by TMA and its B (dy's token rows) by cp.async.
      Schedule upstream = default_schedule(ex.pipeline, {out});
      upstream.gather_upstream_in_gemms(true);
      cuda::CompiledTraining u = cuda::compile_training(ex.pipeline, out, upstream);
      check_resources(u.layer, std::string(name) + " / upstream / d = " + std::to_string(s.d));
      CHECK(kernel_source(u.layer, "gemm_d_w2").find("Cfg::tile<true, false>(ring") != std::string::npos);
    }
}

TEST_CASE("cuda training: the RMSNorm-prologue MoE compiles for sm_90a without spills, forward and training") {
  ExampleShape s = shape(64, 64, 128, 8, 2);
  Example ex = make_example("rmsnorm_moe", s);
  for (const char *p : {"megablocks", "scattermoe"})
    for (bool recompute : {false, true}) {
      INFO(p << (recompute ? " / recompute" : ""));
      check_resources(cuda::compile_layer(ex.pipeline, preset(p)), std::string("rmsnorm_moe / ") + p);
      cuda::CompiledTraining c =
          cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), training_preset(p, recompute));
      check_resources(c.layer, std::string("rmsnorm_moe training / ") + p);
    }
}

TEST_CASE("cuda training: the shared-expert MoE compiles for sm_90a without spills, forward and training") {
  ExampleShape s = shape(64, 64, 128, 8, 2);
  Example ex = make_example("shared_expert_moe", s);
  for (const char *p : {"megablocks", "scattermoe"}) {
    INFO(p);
    check_resources(cuda::compile_layer(ex.pipeline, preset(p)), std::string("shared_expert_moe / ") + p);
    for (bool recompute : {false, true}) {
      cuda::CompiledTraining c =
          cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), training_preset(p, recompute));
      check_resources(c.layer, std::string("shared_expert_moe training / ") + p);
      // The shared expert's SwiGLU is one dense two-B GEMM, as the routed one is a grouped one.
      int dense_two_b = 0;
      for (size_t i = 0; i < c.training.forward_steps; ++i)
        if (auto *g = std::get_if<GemmStep>(&c.training.program.steps[i]))
          dense_two_b += g->b.size() == 2 && !g->route;
      CHECK(dense_two_b == 1);
    }
  }
}

TEST_CASE("cuda training: the GLU variants compile for sm_90a without spills, one two-B GEMM each") {
  ExampleShape s = shape(64, 64, 128, 8, 2);
  for (const char *name : {"geglu_moe", "reglu_moe"}) {
    Example ex = make_example(name, s);
    cuda::CompiledTraining c = cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), preset("scattermoe"));
    check_resources(c.layer, name);
    int two_b = 0;
    for (size_t i = 0; i < c.training.forward_steps; ++i)
      if (auto *g = std::get_if<GemmStep>(&c.training.program.steps[i]))
        two_b += g->b.size() == 2;
    CHECK(two_b == 1);
  }
}

TEST_CASE("cuda training: per-expert biases compile for sm_90a without spills") {
  ExampleShape s = shape(64, 64, 128, 8, 2);
  for (const char *p : {"megablocks", "scattermoe"})
    for (bool recompute : {false, true}) {
      Example ex = make_example("expert_bias_moe", s);
      cuda::CompiledTraining c =
          cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), training_preset(p, recompute));
      check_resources(c.layer, std::string("expert_bias_moe / ") + p + (recompute ? " / recompute" : ""));
      // The biases' gradients: loops over each expert's rows, eight columns a thread.
      for (const GeneratedKernel &k : c.layer.source.kernels)
        if (k.name == "pointwise_d_b1" || k.name == "pointwise_d_b2")
          CHECK(k.grid.elements_per_thread == 8);
      CHECK(c.layer.source.source.find("pointwise_d_b1(") != std::string::npos);
      CHECK(c.layer.source.source.find("pointwise_d_b2(") != std::string::npos);
    }
}

TEST_CASE("cuda training: with the auxiliary losses, every preset compiles for sm_90a without spills") {
  ExampleShape s = shape(64, 64, 128, 8, 2);
  for (const char *name : {"moe_mlp", "swiglu_moe"})
    for (const char *p : {"megablocks", "scattermoe"}) {
      AuxLossLayer a = make_aux_loss_example(name, s);
      cuda::CompiledTraining c = cuda::compile_training(a.example.pipeline, a.output_funcs(), preset(p));
      check_resources(c.layer, std::string(name) + "_aux / " + p);
      CHECK(c.training.outputs == std::vector<std::string>{"y", "lb_loss", "z_loss"});
      CHECK(c.training.seeds == std::vector<std::string>{"d_y", "d_lb_loss", "d_z_loss"});
      CHECK(c.training.forward_steps < c.training.program.steps.size());
      // The losses are forward outputs: the forward computes them.
      for (const char *loss : {"lb_loss", "z_loss"}) {
        bool in_forward = false;
        for (size_t i = 0; i < c.training.forward_steps; ++i)
          in_forward |= step_output(c.training.program.steps[i]) == loss;
        CHECK_MESSAGE(in_forward, loss << " is not computed by the forward");
      }
    }
}

TEST_CASE("cuda training: recompute keeps less for the backward") {
  Example ex = make_example("swiglu_moe", shape(64, 64, 128, 8, 2));
  TrainingProgram store =
      lower_training(ex.pipeline, ex.pipeline.func(ex.output), training_preset("megablocks", false));
  TrainingProgram re = lower_training(ex.pipeline, ex.pipeline.func(ex.output), training_preset("megablocks", true));
  CHECK(std::find(store.saved.begin(), store.saved.end(), "h") != store.saved.end());
  CHECK(std::find(re.saved.begin(), re.saved.end(), "h") == re.saved.end());
  CHECK(std::find(re.recomputed.begin(), re.recomputed.end(), "h") != re.recomputed.end());
  // o, the second GEMM's output, is read by the gate gradient and stays stored.
  CHECK(std::find(re.saved.begin(), re.saved.end(), "o") != re.saved.end());
  CHECK(saved_bytes(re, 1000) < saved_bytes(store, 1000) / 2);
  // The lean mode keeps neither h nor o: the pre-activations and the
  // routing's probabilities (and the layer input, an input).
  for (const char *p : {"megablocks+lean", "scattermoe+padded+lean"}) {
    TrainingProgram lean = lower_training(ex.pipeline, ex.pipeline.func(ex.output), training_preset(p, false));
    INFO(p);
    std::vector<std::string> saved = lean.saved;
    std::sort(saved.begin(), saved.end());
    CHECK(saved == std::vector<std::string>{"h_rhs", "h_silu_in", "probs", "route_gate_sum"});
    CHECK(saved_bytes(lean, 1000) < saved_bytes(store, 1000));
  }
}

TEST_SUITE("gpu") {
  TEST_CASE("cuda training: gradients of every preset x example match the reference") {
    MOEFORGE_REQUIRE_GPU();
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (const char *p :
           {"megablocks", "scattermoe", "scattermoe+padded", "megablocks+lean", "scattermoe+padded+lean",
            "scattermoe+padded+lean+chain", "scattermoe+padded+lean+chain+atomic+gather",
            "scattermoe+padded+lean+chain+split", "scattermoe+padded+lean+chain+atomic+gather+split",
            "scattermoe+padded+lean+chain+upstream+boundary", "scattermoe+padded+lean+chain+atomic+boundary"})
        for (bool recompute : {false, true}) {
          ExampleShape s = shape(200, 64, 128, 8, 2);
          Example ex = make_example(name, s);
          INFO(name << " / " << p << (recompute ? " / recompute" : ""));
          Outcome o = train_and_compare(ex, ex.random_inputs(s, 7), s.tokens, training_preset(p, recompute));
          CHECK(o.routing_mismatches == 0);
        }
  }

  // The default schedule (warp-specialised wgmma with TMA operands, the lean
  // memory mode) as it is and with the backward's memory choices: the input
  // gradient added atomically onto the router's share, token rows gathered
  // inside the GEMMs, an activation gradient written over dy W2^T's bytes;
  // dy's rows copied per pair (gather_upstream_in_gemms off; on in the
  // default); y, dy and dx in f32 (bf16_boundary off; on in the default);
  // the backward's input gradient alone added up atomically, x's rows
  // gathered too (atomic_input_gradient, gather_in_gemms).
  TEST_CASE("cuda training: the default schedule with atomic_combine and gather_in_gemms") {
    MOEFORGE_REQUIRE_GPU();
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (int mode : {0, 1, 2, 3, 4})
        for (const ExampleShape &s : {shape(200, 64, 128, 8, 2), shape(300, 256, 128, 128, 8)}) {
          Example ex = make_example(name, s);
          const Func out = ex.pipeline.func(ex.output);
          Schedule sch = default_schedule(ex.pipeline, {out});
          sch.atomic_combine(mode == 1)
              .gather_in_gemms(mode == 1 || mode == 4)
              .gather_upstream_in_gemms(mode == 0 || mode == 3);
          sch.atomic_input_gradient(mode == 4);
          if (mode == 3)
            sch.bf16_boundary(false);
          INFO(name << " / E = " << s.experts << "\n" << sch.to_text());
          Outcome o = train_and_compare(ex, ex.random_inputs(s, 9), s.tokens, sch);
          CHECK(o.routing_mismatches == 0);
        }
  }

  // bench_moe_train's tuned_wide schedule (bench::tuned_wide: warp-specialised
  // wgmma, 128 x 256 tiles for every single-B GEMM, the backward's expert
  // reductions included) on dims no tile divides (the last column tile of each GEMM
  // partial, stored by the wide epilogue with its column bound) and on many
  // experts with a small f, as real models use.
  TEST_CASE("cuda training: wide wgmma tiles on dims no tile divides and on 128 experts") {
    MOEFORGE_REQUIRE_GPU();
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (ExampleShape s : {shape(300, 200, 328, 8, 2), shape(700, 136, 200, 128, 4)})
        for (int memory : {0, 1, 2}) {
          // 0: tuned_wide as timed; 1: recompute; 2: the lean mode (h made
          // again element-wise, the gate's gradient from the dH GEMM).
          Example ex = make_example(name, s);
          Schedule w = bench::tuned_wide(std::string(name) == "swiglu_moe");
          w.recompute(memory == 1).recompute_elementwise(memory == 2).gate_gradient_from_dh(memory == 2);
          INFO(name << " d " << s.d << " f " << s.f << " E " << s.experts << " memory " << memory);
          Outcome o = train_and_compare(ex, ex.random_inputs(s, 9), s.tokens, w);
          CHECK(o.routing_mismatches == 0);
        }
  }

  TEST_CASE("cuda training: persistent GEMMs in the forward and the backward") {
    MOEFORGE_REQUIRE_GPU();
    ExampleShape s = shape(300, 64, 128, 8, 2);
    // The expert reductions are persistent too: every expert's tiles, empty
    // experts' included, on one ring per block, both operands by cp.async
    // (mode 0) or, with padded_elementwise, by TMA; with tma_store and bf16 weight gradients as well,
    // their tiles and the forward's (SwiGLU's three fused outputs one after
    // another through one buffer) leave by TMA. Mode 3: tuned_wide, whose
    // 128 x 256 weight-gradient tiles beside 4 stages are staged in halves
    // (the second past N = 128 here: nothing to store).
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (int mode : {0, 1, 2, 3, 4, 5, 6, 7, 8}) {
        const bool padded = mode > 0, stored = mode >= 2;
        Example ex = make_example(name, s);
        Schedule p = mode >= 3 ? bench::tuned_wide(std::string(name) == "swiglu_moe") : preset("scattermoe");
        p.padded_elementwise(padded);
        // Mode 4: tuned_wide's own mix (persistent only where it says), h's
        // fused outputs stored by TMA from a block per tile, all at once, and
        // h made again in the backward instead of kept (recompute_elementwise).
        // Mode 5: that, and the gate's gradient from the dH GEMM, whose A is
        // then dy's rows unscaled (gate_gradient_from_dh): o not kept. Mode
        // 6: the gate's gradient so with h kept, the gradient's row sum then
        // moving to the later kernel of the activation's backward.
        // Modes 7 and 8: tuned_wide and its lean mode with SwiGLU's input
        // gradient as one GEMM over both reductions (chain_summed_gemms), a
        // block per tile, then persistent.
        if (mode < 4 || mode == 8)
          p.persistent("*", true);
        p.recompute_elementwise(mode == 4 || mode == 5 || mode == 8).gate_gradient_from_dh(mode >= 5 && mode != 7);
        p.chain_summed_gemms(mode >= 7);
        if (mode >= 3)
          p.tma_store("h", true);
        if (mode == 2)
          p.bf16_weight_gradients(true).tma_store("*", true).stages("*", 3);
        INFO(name << (padded ? " / padded_elementwise" : "") << (stored ? " / tma_store" : "")
                  << (mode == 3   ? " (tuned_wide, persistent, halves)"
                      : mode == 4 ? " (tuned_wide)"
                      : mode == 5 ? " (tuned_wide, lean)"
                      : mode == 6 ? " (tuned_wide, gate_gradient_from_dh)"
                      : mode == 7 ? " (tuned_wide, chain_summed_gemms)"
                      : mode == 8 ? " (tuned_wide, lean, chain_summed_gemms, persistent)"
                                  : ""));
        Outcome o = train_and_compare(ex, ex.random_inputs(s, 5), s.tokens, p);
        CHECK(o.routing_mismatches == 0);
      }
  }

  TEST_CASE("cuda training: mma.sync GEMMs with materialised weight transposes") {
    MOEFORGE_REQUIRE_GPU();
    ExampleShape s = shape(200, 64, 128, 8, 2);
    Example ex = make_example("swiglu_moe", s);
    Schedule sync = preset("megablocks");
    sync.mma("*", MmaKind::mma_sync);
    Outcome o = train_and_compare(ex, ex.random_inputs(s, 3), s.tokens, sync);
    CHECK(o.routing_mismatches == 0);
  }

  // 3000 tokens: the router's weight gradient x^T d_logits (K = T) runs as
  // slices of K over the grid's y, the last one partial and one past K
  // (CudaLayer sizes the slices), every slice adding into the zeroed d_wr.
  TEST_CASE("cuda training: the router's weight gradient split over the tokens") {
    MOEFORGE_REQUIRE_GPU();
    ExampleShape s = shape(3000, 64, 128, 8, 2);
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (bool wide : {false, true}) {
        Example ex = make_example(name, s);
        Schedule sch = wide ? bench::tuned_wide(std::string(name) == "swiglu_moe") : preset("scattermoe");
        INFO(name << (wide ? " / tuned_wide" : " / scattermoe"));
        Outcome o = train_and_compare(ex, ex.random_inputs(s, 4), s.tokens, sch);
        CHECK(o.routing_mismatches == 0);
      }
  }

  // reuse_memory: the layer holds one arena smaller than its tensors one
  // buffer each; the gradients match the reference after two backwards on
  // one forward (what the forward keeps is never reused); an intermediate
  // whose bytes later steps reuse cannot be downloaded.
  TEST_CASE("cuda training: tensors sharing memory by lifetime") {
    MOEFORGE_REQUIRE_GPU();
    static cuda::Device device;
    ExampleShape s = shape(500, 64, 128, 8, 2);
    Example ex = make_example("swiglu_moe", s);
    Schedule shared = preset("scattermoe"), separate = preset("scattermoe");
    shared.reuse_memory(true);
    cuda::CompiledTraining a =
        cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), shared, device.arch_specific());
    cuda::CompiledTraining b =
        cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), separate, device.arch_specific());
    cuda::TrainingLayer la(device, a, s.tokens), lb(device, b, s.tokens);
    CHECK(la.layer().activation_bytes() < lb.layer().activation_bytes());
    TensorMap in = ex.random_inputs(s, 8);
    HostTensor dy = upstream_gradient(ex, in, 12);
    cuda::Stream stream;
    for (cuda::TrainingLayer *l : {&la, &lb}) {
      l->upload(in);
      l->poison();
      l->upload_upstream_gradient(dy);
      l->forward(stream);
      l->backward(stream);
      l->backward(stream); // again, on what the forward kept
    }
    stream.synchronize();
    CHECK(la.output().data == lb.output().data);
    for (const char *w : {"x", "w1", "w3", "w2"}) {
      INFO(w);
      CHECK(la.gradient(w).data == lb.gradient(w).data);
    }
    // d_wr's K slices add in whatever order they finish.
    CHECK(max_normalized_error(la.gradient("wr"), lb.gradient("wr")) < 1e-5);
    CHECK_THROWS_WITH_AS(la.download("d_x_s_a"), doctest::Contains("shares its memory with other tensors"), UserError);
    Outcome o = train_and_compare(ex, in, s.tokens, shared);
    CHECK(o.routing_mismatches == 0);
  }

  TEST_CASE("cuda training: the shared-expert MoE") {
    MOEFORGE_REQUIRE_GPU();
    for (const char *p : {"megablocks", "scattermoe"}) {
      ExampleShape s = shape(300, 64, 128, 8, 2);
      Example ex = make_example("shared_expert_moe", s);
      INFO(p);
      Outcome o = train_and_compare(ex, ex.random_inputs(s, 19), s.tokens, preset(p));
      CHECK(o.routing_mismatches == 0);
    }
  }

  TEST_CASE("cuda training: deepseek_moe (group-limited device routing, selection bias, scaled gates)") {
    MOEFORGE_REQUIRE_GPU();
    for (const char *p : {"megablocks", "scattermoe"})
      for (bool recompute : {false, true}) {
        ExampleShape s = shape(300, 64, 128, 16, 4);
        Example ex = make_example("deepseek_moe", s);
        INFO(p << (recompute ? " / recompute" : ""));
        Outcome o = train_and_compare(ex, ex.random_inputs(s, 26), s.tokens, training_preset(p, recompute));
        CHECK(o.routing_mismatches == 0);
      }
  }

  TEST_CASE("cuda training: the RMSNorm-prologue MoE") {
    MOEFORGE_REQUIRE_GPU();
    for (const char *p : {"megablocks", "scattermoe"})
      for (bool recompute : {false, true}) {
        ExampleShape s = shape(300, 64, 128, 8, 2);
        Example ex = make_example("rmsnorm_moe", s);
        INFO(p << (recompute ? " / recompute" : ""));
        Outcome o = train_and_compare(ex, ex.random_inputs(s, 25), s.tokens, training_preset(p, recompute));
        CHECK(o.routing_mismatches == 0);
      }
  }

  TEST_CASE("cuda training: the GLU variants (GeGLU, ReGLU)") {
    MOEFORGE_REQUIRE_GPU();
    for (const char *name : {"geglu_moe", "reglu_moe"}) {
      ExampleShape s = shape(300, 64, 128, 8, 2);
      Example ex = make_example(name, s);
      INFO(name);
      Outcome o = train_and_compare(ex, ex.random_inputs(s, 7), s.tokens, preset("scattermoe"));
      CHECK(o.routing_mismatches == 0);
    }
  }

  TEST_CASE("cuda training: per-expert biases on both expert GEMMs") {
    MOEFORGE_REQUIRE_GPU();
    for (const char *p : {"megablocks", "scattermoe"})
      for (bool recompute : {false, true}) {
        ExampleShape s = shape(300, 64, 128, 8, 2);
        Example ex = make_example("expert_bias_moe", s);
        INFO(p << (recompute ? " / recompute" : ""));
        Outcome o = train_and_compare(ex, ex.random_inputs(s, 6), s.tokens, training_preset(p, recompute));
        CHECK(o.routing_mismatches == 0);
      }
  }

  TEST_CASE("cuda training: RMSNorm through sqrt and rsqrt") {
    MOEFORGE_REQUIRE_GPU();
    ExampleShape s = shape(300, 64, 128, 1, 1);
    Example ex = rmsnorm_layer(s);
    train_and_compare(ex, ex.random_inputs(s, 2), s.tokens, preset("megablocks"));
  }

  TEST_CASE("cuda training: the MoE edge cases") {
    MOEFORGE_REQUIRE_GPU();
    testing::check_edge_cases(64, 128,
                              {"megablocks", "scattermoe", "scattermoe+padded", "megablocks+lean",
                               "scattermoe+padded+lean", "scattermoe+padded+lean+chain",
                               "scattermoe+padded+lean+chain+split", "scattermoe+padded+lean+chain+upstream+boundary"},
                              [](const Example &ex, const TensorMap &in, int64_t tokens, const std::string &p) {
                                return train_and_compare(ex, in, tokens, training_preset(p, false));
                              });
  }

  TEST_CASE("cuda training: the auxiliary losses and their gradients (0-D reductions over tokens and pairs)") {
    MOEFORGE_REQUIRE_GPU();
    static cuda::Device device;
    for (const char *name : {"moe_mlp", "swiglu_moe"}) {
      ExampleShape s = shape(150, 64, 128, 8, 2);
      // Every output's upstream gradient, random, shaped like the output.
      testing::WholeGradient w = testing::outputs_and_gradients(make_aux_loss_example(name, s), s);
      const Example &t = w.example;
      const TensorMap &in = w.inputs;
      cuda::CompiledLayer c = cuda::compile_layer(t.pipeline, preset("scattermoe"), device.arch_specific());
      cuda::CudaLayer layer(device, c, s.tokens);
      layer.upload(in);
      layer.poison();
      cuda::Stream stream;
      layer.enqueue(stream);
      stream.synchronize();
      INFO(name);
      Outcome o = testing::compare_with_reference(t, in, c.program, layer, "scattermoe", 2e-2, 1e-3);
      CHECK(o.routing_mismatches == 0);
    }
  }

  TEST_CASE("cuda training: backward before forward and an unknown gradient are user errors") {
    MOEFORGE_REQUIRE_GPU();
    static cuda::Device device;
    ExampleShape s = shape(64, 64, 128, 8, 2);
    Example ex = make_example("moe_mlp", s);
    cuda::CompiledTraining c =
        cuda::compile_training(ex.pipeline, ex.pipeline.func(ex.output), preset("megablocks"), device.arch_specific());
    cuda::TrainingLayer layer(device, c, s.tokens);
    layer.upload(ex.random_inputs(s, 1));
    cuda::Stream stream;
    CHECK_THROWS_WITH_AS(layer.backward(stream), doctest::Contains("run forward() first"), UserError);
    layer.forward(stream);
    CHECK_THROWS_WITH_AS(layer.backward(stream), doctest::Contains("upstream gradient of output 'y' (input 'd_y')"),
                         UserError);
    layer.upload_upstream_gradient(HostTensor({s.tokens, s.d}));
    CHECK_NOTHROW(layer.backward(stream));
    stream.synchronize();
    CHECK_THROWS_WITH_AS(layer.gradient("nope"), doctest::Contains("depends on x, wr, w1, w2"), UserError);
  }

  TEST_CASE("cuda training: moe_mlp and swiglu_moe with the auxiliary losses through TrainingLayer") {
    MOEFORGE_REQUIRE_GPU();
    for (const char *name : {"moe_mlp", "swiglu_moe"})
      for (const char *p : {"megablocks", "scattermoe", "scattermoe+padded+lean+boundary"})
        for (bool recompute : {false, true}) {
          ExampleShape s = shape(150, 64, 128, 8, 2);
          AuxLossLayer a = make_aux_loss_example(name, s);
          INFO(name << " / " << p << (recompute ? " / recompute" : ""));
          Outcome o = train_aux_and_compare(a, a.example.random_inputs(s, 8), s.tokens, training_preset(p, recompute));
          CHECK(o.routing_mismatches == 0);
        }
  }

  TEST_CASE("cuda training: a missing upstream gradient and an unknown output are user errors") {
    MOEFORGE_REQUIRE_GPU();
    static cuda::Device device;
    ExampleShape s = shape(64, 64, 128, 8, 2);
    AuxLossLayer a = make_aux_loss_example("moe_mlp", s);
    cuda::CompiledTraining c =
        cuda::compile_training(a.example.pipeline, a.output_funcs(), preset("megablocks"), device.arch_specific());
    cuda::TrainingLayer layer(device, c, s.tokens);
    layer.upload(a.example.random_inputs(s, 1));
    layer.poison();
    HostTensor one(std::vector<int64_t>{}, 1.0);
    layer.upload_upstream_gradient(HostTensor({s.tokens, s.d})); // the first output's: y
    cuda::Stream stream;
    layer.forward(stream);
    CHECK_THROWS_WITH_AS(layer.backward(stream),
                         doctest::Contains("backward() without the upstream gradient of output 'lb_loss' (input "
                                           "'d_lb_loss'): call upload_upstream_gradient(\"lb_loss\", ...) first"),
                         UserError);
    layer.upload_upstream_gradient("lb_loss", one);
    CHECK_THROWS_WITH_AS(layer.backward(stream), doctest::Contains("upstream gradient of output 'z_loss'"), UserError);
    // upload_repeated of a seed by its name counts as its upload (benchmarks).
    layer.upload_repeated("d_z_loss", one);
    CHECK_NOTHROW(layer.backward(stream));
    stream.synchronize();
    layer.poison();
    layer.forward(stream);
    CHECK_THROWS_WITH_AS(layer.backward(stream), doctest::Contains("upstream gradient of output 'y'"), UserError);
    CHECK_THROWS_WITH_AS(layer.upload_upstream_gradient("loss", one),
                         doctest::Contains("upload_upstream_gradient: no output 'loss': the training step's outputs "
                                           "are 'y', 'lb_loss', 'z_loss'"),
                         UserError);
    CHECK_THROWS_WITH_AS(layer.output("d_y"), doctest::Contains("output(): no output 'd_y'"), UserError);
    stream.synchronize();
  }

  TEST_CASE("cuda training: the dense MLP (no routing)") {
    MOEFORGE_REQUIRE_GPU();
    ExampleShape s = shape(100, 64, 128, 8, 2);
    Example ex = make_example("dense_mlp", s);
    train_and_compare(ex, ex.random_inputs(s, 5), s.tokens, preset("megablocks"));
  }
}
