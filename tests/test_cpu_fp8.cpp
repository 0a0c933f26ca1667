// Schedule::fp8 on the CPU backend: a GEMM's operands rounded by dsl/fp8.h's
// block rule give the reference's FP8 values (EvalOptions::fp8) within bf16
// storage's error, and differ from the unrounded reference by FP8's; the
// training step takes it on every product; the CUDA backend refuses it,
// naming it.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/fp8_operands.h"
#include "cpu_compare.h"
#include "lowering/default_schedule.h"
#include "lowering/gemm_plan.h"
#include "lowering/lower.h"
#include "lowering/training.h"
#include "user_error.h"

using namespace moeforge;
using namespace moeforge::cpu_test;

namespace {

// `func` by the float64 reference under the layer's routing, with the
// schedule's FP8 operands rounded and without.
struct References {
  HostTensor rounded, exact;
};
References references(const Pipeline &p, const TensorMap &in, const Schedule &s, std::vector<int32_t> experts,
                      const std::string &func) {
  EvalOptions exact;
  exact.given["route"] = std::move(experts);
  EvalOptions rounded = exact;
  rounded.fp8 = s.fp8_funcs(p);
  return {evaluate(p, in, Precision::f64, rounded)[func], evaluate(p, in, Precision::f64, exact)[func]};
}

} // namespace

TEST_SUITE("cpu") {
  TEST_CASE("cpu fp8: the forward's products round their operands as the reference does") {
    const std::unique_ptr<Backend> backend = cpu::make_backend();
    // Widths past one block and ragged (320 = 2.5 x 128, 200), and a strided
    // schedule: the megablocks preset copies x into the padded order, the
    // default gathers it in the GEMM.
    for (int64_t tokens : {1, 37, 200})
      for (const char *base : {"default", "megablocks"}) {
        CAPTURE(tokens);
        CAPTURE(base);
        const ExampleShape s = shape(tokens, 320, 200, 8, 2);
        const Example ex = make_example("swiglu_moe", s);
        Schedule schedule =
            std::string(base) == "default"
                ? default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)}).only_funcs_of(ex.pipeline)
                : preset(base);
        schedule.fp8("h", Fp8Format::e4m3).fp8("o", Fp8Format::e4m3);
        const TensorMap in = ex.random_inputs(s, 17);
        const Outcome o = run_and_compare(ex, in, tokens, schedule, 1e-2);
        CHECK(o.routing_mismatches == 0);

        // Against the reference without the rounding, the same layer is off
        // by FP8's error (2^-4 a value), several times bf16's.
        const std::unique_ptr<Layer> layer = backend->layer(ex.pipeline, schedule, tokens);
        layer->upload(in);
        layer->poison();
        layer->run();
        const References ref = references(ex.pipeline, in, schedule, layer->routed_experts("route"), "y");
        const HostTensor y = layer->download("y");
        const double to_fp8 = normalized_error(y, ref.rounded);
        const double to_exact = normalized_error(y, ref.exact);
        CHECK(to_fp8 < 1e-2);
        CHECK(to_exact > 3 * to_fp8);
      }
  }

  TEST_CASE("cpu fp8: the training step's products in FP8, weight gradients included") {
    // The forward's products and the backward's (dH = dy W2^T, dX over
    // dH1 W1^T + dH3 W3^T and the router's share, the weight gradients over
    // each expert's pairs), against the reference that rounds its own
    // operands. The forward's output is like for like. The backward is not
    // quite: the schedule's exact rewrites move where an FP8 rounding falls
    // (the gate's gradient <dy, o> taken as <h, dy W2^T>, the gate applied
    // after dy W2^T instead of to dy), so the two round different operands
    // of equal exact value and the gradients agree to FP8's error (2^-4 of a
    // value), not bf16's.
    const std::unique_ptr<Backend> backend = cpu::make_backend();
    for (int64_t tokens : {1, 37, 130})
      for (bool all : {false, true}) {
        CAPTURE(tokens);
        CAPTURE(all);
        const ExampleShape st = shape(tokens, 320, 200, 8, 2);
        const Example e = make_example("swiglu_moe", st);
        const Func out = e.pipeline.func(e.output);
        // The default reads dy by each pair's token row in dW2; a per-pair
        // copy lets its blocks follow the expert's pairs.
        Schedule s = default_schedule(e.pipeline, {out}).gather_upstream_in_gemms(false);
        if (all)
          s.fp8("*", Fp8Format::e4m3).fp8("logits", std::nullopt).fp8("d_wr", std::nullopt);
        else
          for (const char *f : {"h", "o", "d_h", "d_x"})
            s.fp8(f, Fp8Format::e4m3);
        const Outcome o = cpu_train_and_compare(e, e.random_inputs(st, 23), tokens, s, 8e-2);
        CHECK(o.routing_mismatches == 0);
        CHECK(o.y_error < 1e-2);
      }
  }

  TEST_CASE("cpu fp8: a weight gradient rounds each expert's pairs in blocks as the reference does") {
    // megablocks' dW2 = sum over an expert's pairs of h(r) d_o(r), both read
    // in pair order: operands the reference holds to the bit (h from an f32
    // accumulator, d_o = gate dy), so the blocks along each expert's pairs
    // are checked like for like. (Other weight gradients read operands made
    // from bf16-stored intermediates; FP8 turns their 2^-9 differences into
    // whole FP8 steps on a few elements in a hundred, as large as the
    // rounding itself once summed: the layouts are checked one level down.)
    const std::unique_ptr<Backend> backend = cpu::make_backend();
    for (int64_t tokens : {37, 300}) {
      CAPTURE(tokens);
      const ExampleShape st = shape(tokens, 64, 96, 4, 2); // 150 pairs an expert at 300 tokens: two blocks
      const Example e = make_example("swiglu_moe", st);
      const Func out = e.pipeline.func(e.output);
      Schedule s = preset("megablocks").padded_elementwise(true).fp8("d_w2", Fp8Format::e4m3);
      TensorMap in = e.random_inputs(st, 29);
      const std::unique_ptr<TrainingLayer> layer = backend->training_layer(e.pipeline, {out}, s, tokens);
      const HostTensor dy = testing::upstream_gradient(e, in, 11);
      layer->upload(in);
      layer->poison();
      layer->upload_upstream_gradient(dy);
      layer->forward();
      layer->backward();
      const Example t = testing::training_example(e);
      in[layer->training().seed] = dy;
      const References ref = references(t.pipeline, in, s, layer->routed_experts("route"), "d_w2");
      const HostTensor got = layer->gradient("w2");
      CHECK(normalized_error(got, ref.rounded) < 1e-5);
      CHECK(normalized_error(got, ref.exact) > 1e-3);
    }
  }

  TEST_CASE("cpu fp8: a weight gradient's operand rounds in blocks of each expert's pairs, in every layout") {
    // Three experts of 0, 300 and 5 pairs; the same values stored padded
    // (segments at multiples of 128), sorted (no padding), in pair order and
    // padded and transposed: each rounds as its expert's pairs gathered in
    // order and rounded in blocks of 128 rows, one column at a time.
    const int64_t cols = 6, experts = 3;
    const std::vector<int32_t> counts{0, 300, 5}, offsets{0, 0, 384, 512}, unpadded{0, 0, 300, 305};
    const int64_t pairs = 305, padded_rows = 512;
    // Pairs in pair order alternate between the experts as a routing would.
    std::vector<int32_t> expert_of(pairs), sorted_pair(padded_rows, -1);
    for (int64_t r = 0; r < pairs; ++r)
      expert_of[static_cast<size_t>(r)] = r % 61 == 0 ? 2 : 1;
    std::vector<int32_t> seen(experts, 0);
    for (int64_t r = 0; r < pairs; ++r) {
      const int32_t e = expert_of[static_cast<size_t>(r)];
      sorted_pair[static_cast<size_t>(offsets[e] + seen[e]++)] = static_cast<int32_t>(r);
    }
    REQUIRE(seen == counts);
    std::mt19937 rng(3);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> value(static_cast<size_t>(pairs * cols)); // pair order
    for (size_t i = 0; i < value.size(); ++i)
      value[i] = bf16_value(bf16_bits(normal(rng) * std::ldexp(1.0f, static_cast<int>(i % 9) - 4)));
    // The expected rounding: each expert's pairs, in order, blocks of 128.
    std::vector<float> want = value;
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t c = 0; c < cols; ++c) {
        std::vector<double> column;
        for (int64_t i = 0; i < counts[e]; ++i)
          column.push_back(value[static_cast<size_t>(sorted_pair[offsets[e] + i] * cols + c)]);
        fp8_round_blocks(column.data(), counts[e], 1, 1, fp8_block, 1, Fp8Format::e4m3);
        for (int64_t i = 0; i < counts[e]; ++i)
          want[static_cast<size_t>(sorted_pair[offsets[e] + i] * cols + c)] = static_cast<float>(column[i]);
      }
    const cpu::ExpertRows route{experts, counts.data(), offsets.data(), unpadded.data(), sorted_pair.data()};
    auto as_bytes = [](const std::vector<float> &v) {
      std::vector<uint8_t> b(v.size() * 4);
      std::memcpy(b.data(), v.data(), b.size());
      return b;
    };
    auto at = [](const std::vector<uint8_t> &b, int64_t i) {
      float f;
      std::memcpy(&f, b.data() + i * 4, 4);
      return f;
    };
    const Dim pairs_dim = Dim::dynamic("pairs"), cols_dim("C", cols);
    struct Layout {
      RowLayout layout;
      RowMap rows;
      int64_t stored_rows;
      // The stored index of pair r's column c.
      std::function<int64_t(int64_t, int64_t)> index;
    };
    std::vector<int64_t> pos(static_cast<size_t>(pairs));
    for (int64_t p = 0; p < padded_rows; ++p)
      if (sorted_pair[static_cast<size_t>(p)] >= 0)
        pos[static_cast<size_t>(sorted_pair[static_cast<size_t>(p)])] = p;
    auto e_of = [&](int64_t r) { return expert_of[static_cast<size_t>(r)]; };
    const std::vector<Layout> layouts = {
        {RowLayout::pair, RowMap::gather_pair, pairs, [&](int64_t r, int64_t c) { return r * cols + c; }},
        {RowLayout::padded, RowMap::direct, padded_rows,
         [&](int64_t r, int64_t c) { return pos[static_cast<size_t>(r)] * cols + c; }},
        {RowLayout::sorted, RowMap::direct, pairs,
         [&](int64_t r, int64_t c) {
           return (unpadded[e_of(r)] + pos[static_cast<size_t>(r)] - offsets[e_of(r)]) * cols + c;
         }},
        {RowLayout::padded_t, RowMap::direct, padded_rows,
         [&](int64_t r, int64_t c) { return c * padded_rows + pos[static_cast<size_t>(r)]; }},
    };
    for (const Layout &l : layouts) {
      CAPTURE(row_layout_name(l.layout));
      std::vector<float> stored(static_cast<size_t>(l.stored_rows * cols), 7.0f); // padding: left as it is
      for (int64_t r = 0; r < pairs; ++r)
        for (int64_t c = 0; c < cols; ++c)
          stored[static_cast<size_t>(l.index(r, c))] = value[static_cast<size_t>(r * cols + c)];
      TensorDecl t;
      t.name = "operand";
      t.dtype = DType::f32;
      t.layout = l.layout;
      t.dims = l.layout == RowLayout::padded_t ? std::vector<Dim>{cols_dim, pairs_dim}
                                               : std::vector<Dim>{pairs_dim, cols_dim};
      const std::vector<int64_t> shape = l.layout == RowLayout::padded_t ? std::vector<int64_t>{cols, l.stored_rows}
                                                                         : std::vector<int64_t>{l.stored_rows, cols};
      const std::vector<uint8_t> in = as_bytes(stored);
      const std::vector<uint8_t> got =
          cpu::fp8_rounded_expert_copy(t, shape, in.data(), in.size(), l.rows, route, Fp8Format::e4m3);
      int64_t moved = 0;
      for (int64_t r = 0; r < pairs; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const float g = at(got, l.index(r, c));
          REQUIRE(g == want[static_cast<size_t>(r * cols + c)]);
          moved += g != value[static_cast<size_t>(r * cols + c)];
        }
      CHECK(moved > pairs); // the rounding happened
      if (l.layout == RowLayout::padded)
        CHECK(at(got, 300 * cols) == 7.0f); // a padding row of expert 1's segment
    }
  }

  TEST_CASE("cpu fp8: a weight gradient reading token rows is refused with the fix") {
    const ExampleShape s = shape(37, 320, 200, 8, 2);
    const Example ex = make_example("swiglu_moe", s);
    const Func out = ex.pipeline.func(ex.output);
    const Schedule base = default_schedule(ex.pipeline, {out});
    REQUIRE(base.gather_upstream_in_gemms());
    const std::string m = testing::user_error_of([&] {
      cpu::make_backend()->training_layer(ex.pipeline, {out}, Schedule(base).fp8("d_w2", Fp8Format::e4m3), 37);
    });
    CHECK(m.find("definition 'd_w2': its weight gradient reads 'd_y' by each pair's token row") != std::string::npos);
    CHECK(m.find("gather_upstream_in_gemms(false)") != std::string::npos);
  }

  TEST_CASE("cpu fp8: the CUDA backend's plan refuses FP8 operands, naming the Func and the choice") {
    const ExampleShape s = shape(64, 256, 256, 8, 2);
    const Example ex = make_example("swiglu_moe", s);
    Schedule schedule = default_schedule(ex.pipeline, {ex.pipeline.func(ex.output)}).only_funcs_of(ex.pipeline);
    schedule.fp8("o", Fp8Format::e5m2);
    const KernelProgram p = lower(ex.pipeline, schedule);
    int refused = 0;
    for (const Step &st : p.steps)
      if (const auto *g = std::get_if<GemmStep>(&st)) {
        if (g->func != "o") {
          CHECK(g->plan_refusal.empty());
          continue;
        }
        ++refused;
        const std::string m = testing::user_error_of([&] { planned(*g); });
        CHECK(m.find("definition 'o': FP8 operands (fp8(\"o\", \"e5m2\")) are not built for the CUDA backend yet") !=
              std::string::npos);
      }
    CHECK(refused == 1);
  }
}
