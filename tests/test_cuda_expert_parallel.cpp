// The expert-parallel layer (backends/cuda/parallel/expert_parallel_layer.h): both
// sides compile for sm_90a through NVRTC without a GPU; on GPUs, one rank and
// two ranks train a step whose output and every gradient match the float64
// reference of the unsplit layer over all ranks' tokens (the router's
// gradient summed over the ranks, each expert's from its owner), under the
// routing the device chose, outputs poisoned first.
#include <doctest/doctest.h>

#if MOEFORGE_HAVE_NCCL

#include <cmath>
#include <random>

#include "backends/cuda/parallel/expert_parallel_layer.h"
#include "backends/cuda/parallel/nccl.h"
#include "benchmarks/train_schedule.h"
#include "cuda_resources.h"
#include "dsl/training.h"
#include "examples/examples.h"
#include "gpu_test.h"
#include "schedules/presets.h"
#include "tests/expert_parallel_emulation.h"
#include "user_error.h"

using namespace moeforge;

namespace {

bool has(const std::string &s, const std::string &part) { return s.find(part) != std::string::npos; }

// What one rank's step left: its outputs and gradients, and its routing.
struct RankStep {
  HostTensor y, d_x, d_wr;
  TensorMap expert_grads; // this rank's experts
  std::vector<int32_t> experts;
  int64_t received = 0;
};

// One training step of `example` over `devices` (rank q on devices[q]) with
// `tokens` tokens per rank, compared with the reference of the unsplit layer.
void check_step(const std::string &example, const Schedule &schedule, const std::vector<int> &devices, int64_t tokens,
                bool skewed, uint64_t seed, bool overlap = true) {
  CAPTURE(example);
  CAPTURE(schedule.to_text());
  CAPTURE(skewed);
  CAPTURE(overlap);
  const int R = static_cast<int>(devices.size());
  const ExampleShape s{tokens * R, 8, 2, 64, 128};
  Example ex = make_example(example, s);
  TensorMap in = ex.random_inputs(s, seed);
  if (skewed) { // a router that favours expert 0 (rank 0's) and never picks expert 5
    // Rows of positive values, so that a weight column of one sign moves
    // every token's logit the same way (all values stay bf16-exact).
    for (double &v : in["x"].data)
      v = std::fabs(v);
    for (int64_t i = 0; i < s.d; ++i) {
      in["wr"].at({i, 0}) = 0.125;
      in["wr"].at({i, 5}) = -0.5;
    }
  }
  std::mt19937_64 rng(seed + 7);
  HostTensor dy = random_tensor(in.at("x").shape, rng);

  cuda::CompiledExpertParallel compiled =
      cuda::compile_expert_parallel(ex.pipeline, Schedule(schedule).expert_parallel(R));
  std::vector<cuda::Communicator> comms = cuda::Communicator::for_devices(devices);
  std::vector<RankStep> got(R);
  cuda::on_each_rank(devices, [&](int q) {
    cuda::Device device(devices[q]);
    cuda::Stream stream;
    cuda::ExpertParallelLayer layer(device, compiled, comms[q], tokens);
    layer.overlap(overlap);
    TensorMap mine = in;
    mine["x"] = testing::row_slice(in.at("x"), q * tokens, (q + 1) * tokens);
    layer.upload(mine);
    layer.upload_upstream_gradient("y", testing::row_slice(dy, q * tokens, (q + 1) * tokens));
    layer.poison();
    layer.forward(stream);
    layer.backward(stream);
    stream.synchronize();
    RankStep &r = got[q];
    r.y = layer.output("y");
    r.d_x = layer.gradient("x");
    r.d_wr = layer.gradient("wr");
    for (const std::string &w : compiled.split.expert_params)
      r.expert_grads[w] = layer.gradient(w);
    r.experts = layer.token_layer().routed_experts(compiled.split.route);
    r.received = layer.received_rows();
  });

  // The reference over every rank's tokens, routed as the devices chose.
  std::vector<int32_t> experts;
  for (const RankStep &r : got)
    experts.insert(experts.end(), r.experts.begin(), r.experts.end());
  TrainingAlgebra whole = training_algebra(ex.pipeline, ex.pipeline.func("y"));
  TensorMap whole_in = in;
  whole_in["d_y"] = dy;
  EvalOptions given;
  given.given[compiled.split.route] = experts;
  EvalResult want = evaluate(whole.pipeline, whole_in, Precision::f64, given);

  std::vector<HostTensor> ys, dxs;
  HostTensor d_wr = got[0].d_wr;
  int64_t rows = 0;
  for (int q = 0; q < R; ++q) {
    ys.push_back(got[q].y);
    dxs.push_back(got[q].d_x);
    if (q > 0)
      for (int64_t i = 0; i < d_wr.size(); ++i)
        d_wr.data[i] += got[q].d_wr.data[i];
    rows += got[q].received;
  }
  CHECK(rows == s.tokens * s.topk);
  CHECK(max_normalized_error(testing::row_concat(ys), want["y"]) < 1e-2);
  CHECK(max_normalized_error(testing::row_concat(dxs), want["d_x"]) < 2e-2);
  CHECK(max_normalized_error(d_wr, want["d_wr"]) < 2e-2);
  for (const std::string &w : compiled.split.expert_params) {
    CAPTURE(w);
    std::vector<HostTensor> parts;
    for (int q = 0; q < R; ++q)
      parts.push_back(got[q].expert_grads.at(w));
    CHECK(max_normalized_error(testing::row_concat(parts), want["d_" + w]) < 2e-2);
  }
  if (skewed && R == 2)
    CHECK(got[0].received > got[1].received);
}

std::vector<Schedule> schedules(const std::string &example) {
  return {preset("scattermoe"), preset("megablocks"), bench::tuned_wide(example == "swiglu_moe")};
}

} // namespace

TEST_CASE("cuda expert parallel: both sides and the row kernels compile for sm_90a (no GPU needed)") {
  for (const char *example : {"moe_mlp", "swiglu_moe"}) {
    Example ex = make_example(example, ExampleShape{256, 8, 2, 64, 128});
    for (const Schedule &sch : schedules(example)) {
      CAPTURE(example);
      CAPTURE(sch.to_text());
      cuda::CompiledExpertParallel c = cuda::compile_expert_parallel(ex.pipeline, Schedule(sch).expert_parallel(2));
      CHECK(!c.row_kernels.cubin.empty());
      CHECK(c.dispatch_end > 0);
      CHECK(c.dispatch_end < c.token.training.forward_steps);
      CHECK(c.backward_split > c.token.training.forward_steps);
      CHECK(c.backward_split < c.token.training.program.steps.size());
      CHECK(c.returned_gradients_end > c.token.training.forward_steps);
      CHECK(c.returned_gradients_end <= c.backward_split);
      CHECK(c.row_gradients_end > c.experts.training.forward_steps);
      CHECK(c.row_gradients_end < c.experts.training.program.steps.size()); // the weight gradients come after
      // The expert side runs the layer's expert GEMMs and nothing of the router.
      std::ostringstream os;
      os << c.experts.training.program;
      CHECK(has(os.str(), "gemm_h"));
      CHECK(!has(os.str(), "wr"));
    }
  }
  Example ex = make_example("moe_mlp", ExampleShape{256, 8, 2, 64, 128});
  CHECK(has(testing::user_error_of(
                [&] { cuda::compile_expert_parallel(ex.pipeline, preset("scattermoe").expert_parallel(3)); }),
            "do not split evenly over 3 ranks"));
  Schedule capped = preset("scattermoe");
  capped.capacity(1.25).expert_parallel(2);
  CHECK(has(testing::user_error_of([&] { cuda::compile_expert_parallel(ex.pipeline, capped); }),
            "capacity factor with the experts spread over ranks"));
  // One layer refuses a schedule that spreads its experts, on every backend.
  CHECK(has(testing::user_error_of([&] { cuda::compile_layer(ex.pipeline, preset("scattermoe").expert_parallel(2)); }),
            "compile it with cuda::compile_expert_parallel"));
}

TEST_CASE("cuda expert parallel: exchange_chunks runs the expert GEMMs round by round (no GPU needed)") {
  for (const char *example : {"moe_mlp", "swiglu_moe"}) {
    Example ex = make_example(example, ExampleShape{256, 8, 2, 64, 128});
    for (const Schedule &sch : {preset("scattermoe"), bench::tuned_wide(std::string(example) == "swiglu_moe")}) {
      CAPTURE(example);
      CAPTURE(sch.to_text());
      cuda::CompiledExpertParallel c =
          cuda::compile_expert_parallel(ex.pipeline, Schedule(sch).expert_parallel(2).exchange_chunks(4));
      CHECK(c.chunks == 4);
      const KernelProgram &p = c.experts.training.program;
      REQUIRE(c.chunk_begin < c.chunk_end);
      REQUIRE(c.chunk_end <= c.experts.training.forward_steps);
      // Before the rounds, nothing reads the received rows; in them, routed
      // GEMMs over a window; no other GEMM (the backward's) has one.
      for (size_t i = 0; i < p.steps.size(); ++i) {
        CAPTURE(step_name(p.steps[i]));
        const auto *g = std::get_if<GemmStep>(&p.steps[i]);
        const bool round = i >= c.chunk_begin && i < c.chunk_end;
        CHECK((g && g->windowed) == round);
        if (i < c.chunk_begin)
          for (const std::string &read : step_reads(p.steps[i]))
            CHECK(read != c.split.dispatched.front().expert_side);
      }
      CHECK(has(c.experts.layer.source.source, "the window's w_tile-th tile of the route"));
      testing::check_resources(c.experts.layer, std::string(example) + " experts, windowed");
      // Nothing follows the GEMMs on the expert side: each round returns at once.
      CHECK(c.chunk_end == c.experts.training.forward_steps);
      CHECK(c.return_per_chunk);
    }
  }
  Example ex = make_example("moe_mlp", ExampleShape{256, 8, 2, 64, 128});
  // Each round is a group of a rank's experts: at most E / R rounds.
  CHECK(has(testing::user_error_of([&] {
              cuda::compile_expert_parallel(ex.pipeline, preset("scattermoe").expert_parallel(2).exchange_chunks(5));
            }),
            "this layer has 4 a rank (8 over 2): use at most 4 chunks"));
  // The blocked permutation gathers the received rows in a pass of its own,
  // which does not run over a window of tiles.
  CHECK(has(testing::user_error_of([&] {
              cuda::compile_expert_parallel(ex.pipeline, preset("megablocks").expert_parallel(2).exchange_chunks(2));
            }),
            "is not a GEMM over the route's tiles"));
  // One layer has no exchange to divide.
  CHECK(has(testing::user_error_of(
                [&] { cuda::compile_layer(ex.pipeline, Schedule(preset("scattermoe")).exchange_chunks(2)); }),
            "exchange_chunks(2) divides an expert-parallel layer's row exchange, and one layer has none"));
}

TEST_SUITE("gpu") {
  TEST_CASE("cuda expert parallel: one rank trains as the unsplit layer") {
    MOEFORGE_REQUIRE_GPU();
    std::string why;
    if (!cuda::nccl_available(&why)) {
      MESSAGE("SKIPPED (no GPU): NCCL is not usable: " << why);
      return;
    }
    for (const char *example : {"moe_mlp", "swiglu_moe"})
      for (const Schedule &sch : schedules(example)) {
        check_step(example, sch, {0}, 300, false, 41);
        check_step(example, sch, {0}, 1, false, 42); // one token
      }
    check_step("moe_mlp", preset("scattermoe"), {0}, 257, true, 43); // skewed, expert 5 empty
    check_step("moe_mlp", preset("megablocks"), {0}, 300, false, 44, /*overlap=*/false);
    // The forward's rows in rounds of expert groups (8 experts: 2 or 8 rounds).
    check_step("swiglu_moe", bench::tuned_wide(true).exchange_chunks(2), {0}, 300, false, 45);
    check_step("moe_mlp", preset("scattermoe").exchange_chunks(8), {0}, 257, true, 46); // a round with no rows
    // A windowed GEMM runs over windows listed for the layer's token count.
    Example ex = make_example("moe_mlp", ExampleShape{64, 8, 2, 64, 128});
    cuda::CompiledExpertParallel c =
        cuda::compile_expert_parallel(ex.pipeline, preset("scattermoe").expert_parallel(1).exchange_chunks(2));
    cuda::Device device(0);
    cuda::Stream stream;
    cuda::CudaLayer experts(device, c.experts.layer, 128, c.experts.training.forward_steps);
    const std::string stale = "list them with set_tile_windows() after set_tokens()";
    CHECK(has(testing::user_error_of([&] { experts.enqueue_window(stream, c.chunk_begin, c.chunk_end, 0); }), stale));
    experts.set_tile_windows(c.split.route, {{0}, {1}});
    experts.set_tokens(100);
    CHECK(has(testing::user_error_of([&] { experts.enqueue_window(stream, c.chunk_begin, c.chunk_end, 1); }), stale));
    CHECK(has(testing::user_error_of([&] { experts.set_tile_windows("nope", {{0}}); }), "no route named 'nope'"));
  }

  TEST_CASE("cuda expert parallel: two GPUs train as the unsplit layer, uniform and skewed, an empty expert") {
    MOEFORGE_REQUIRE_GPU();
    std::string why;
    if (!cuda::nccl_available(&why)) {
      MESSAGE("SKIPPED (no GPU): NCCL is not usable: " << why);
      return;
    }
    int count = 0;
    MOEFORGE_CU(cuDeviceGetCount, &count);
    if (count < 2) {
      MESSAGE("SKIPPED (no GPU): needs two GPUs, found " << count);
      return;
    }
    for (const char *example : {"moe_mlp", "swiglu_moe"})
      for (const Schedule &sch : schedules(example)) {
        check_step(example, sch, {0, 1}, 300, false, 51);
        check_step(example, sch, {0, 1}, 300, true, 52);
      }
    check_step("moe_mlp", preset("scattermoe"), {0, 1}, 1, false, 53); // a token per rank
    // The backward's row moves in step order, on the caller's stream alone.
    check_step("swiglu_moe", bench::tuned_wide(true), {0, 1}, 300, true, 54, /*overlap=*/false);
    // The forward's rows in rounds: 2 or 4 groups of each rank's 4 experts,
    // uniform and skewed (rank 1's round of expert 5 has no rows), one
    // token per rank.
    for (int chunks : {2, 4}) {
      CAPTURE(chunks);
      check_step("swiglu_moe", bench::tuned_wide(true).exchange_chunks(chunks), {0, 1}, 300, false, 55);
      check_step("swiglu_moe", bench::tuned_wide(true).exchange_chunks(chunks), {0, 1}, 300, true, 56);
      check_step("moe_mlp", preset("scattermoe").exchange_chunks(chunks), {0, 1}, 300, true, 57);
    }
    check_step("moe_mlp", preset("scattermoe").exchange_chunks(4), {0, 1}, 1, false, 58);
  }
}

#endif // MOEFORGE_HAVE_NCCL
