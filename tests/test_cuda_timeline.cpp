// The GEMM timeline (MOEFORGE_TIMELINE): the summary of synthetic stamps,
// the stamped source compiling for sm_90a within its resources, and on a GPU
// every GEMM block reporting its phases in order (and the stamped kernels
// still computing the same result).
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>

#include "backends/cuda/runtime/layer.h"
#include "backends/cuda/runtime/timeline.h"
#include "cuda_resources.h"
#include "examples/examples.h"
#include "gpu_test.h"
#include "layer_compare.h"
#include "schedules/presets.h"

using namespace moeforge;

namespace {

// MOEFORGE_TIMELINE set for one scope.
struct TimelineOn {
  TimelineOn() { ::setenv("MOEFORGE_TIMELINE", "1", 1); }
  ~TimelineOn() { ::unsetenv("MOEFORGE_TIMELINE"); }
};

void put(std::vector<uint64_t> &raw, int block, std::initializer_list<uint64_t> stamps) {
  int i = 0;
  for (uint64_t v : stamps)
    raw[static_cast<size_t>(block) * cuda::kTimelineSlots + i++] = v;
}

ExampleShape small() { return testing::shape(300, 128, 256, 8, 2); }

} // namespace

TEST_CASE("timeline: phases, SM busy time and gaps from synthetic stamps") {
  std::vector<uint64_t> raw(5 * cuda::kTimelineSlots, 0);
  // Two blocks on SM 7, one after the other (a 1000 ns gap); one on SM 3;
  // block 3 left at entry (a surplus tile); block 4 never ran.
  put(raw, 0, {1000, 2000, 3000, 9000, 11000, 7});
  put(raw, 1, {12000, 13000, 14000, 20000, 22000, 7});
  put(raw, 2, {1000, 1500, 0, 9500, 10500, 3});
  put(raw, 3, {500, 0, 0, 0, 0, 3});
  cuda::TimelineSummary s = cuda::summarize_timeline(raw, 5);
  CHECK(s.blocks == 3);
  CHECK(s.early_exits == 1);
  CHECK(s.sms == 2);
  CHECK(s.span_us == doctest::Approx(21.0)); // 1000 .. 22000 ns
  CHECK(s.setup_us == doctest::Approx((1.0 + 1.0 + 0.5) / 3));
  CHECK(s.first_stage_us == doctest::Approx((1.0 + 1.0 + 0.0) / 3));
  // Block 2 has no first-stage stamp: its main loop counts from the call.
  CHECK(s.main_loop_us == doctest::Approx((6.0 + 6.0 + 8.0) / 3));
  CHECK(s.max_main_loop_us == doctest::Approx(8.0));
  CHECK(s.epilogue_us == doctest::Approx((2.0 + 2.0 + 1.0) / 3));
  CHECK(s.busy == doctest::Approx((10.0 + 10.0 + 9.5) / (2 * 21.0)));
  CHECK(s.gap_us == doctest::Approx(1.0));
  std::string line = cuda::format_timeline("gemm_h", s);
  CHECK(line.find("gemm_h: 3 blocks (+1 early exits) on 2 SMs") == 0);
  CHECK(line.find("gap between blocks 1.00 us") != std::string::npos);
}

TEST_CASE("timeline: tiles that noted their rows are split into tiles of at most 64 rows and fuller ones") {
  std::vector<uint64_t> raw(4 * cuda::kTimelineSlots, 0);
  put(raw, 0, {1000, 2000, 3000, 9000, 11000, 7, 129}); // 128 rows: main loop 6 us
  put(raw, 1, {1000, 2000, 3000, 7000, 8000, 8, 66});   // 65 rows: still both warpgroups, 4 us
  put(raw, 2, {1000, 2000, 3000, 5000, 6000, 9, 65});   // 64 rows: 2 us
  put(raw, 3, {1000, 2000, 3000, 6000, 7000, 10, 0});   // no note: in neither
  cuda::TimelineSummary s = cuda::summarize_timeline(raw, 4);
  CHECK(s.blocks == 4);
  CHECK(s.half_tiles == 1);
  CHECK(s.full_tiles == 2);
  CHECK(s.half_main_loop_us == doctest::Approx(2.0));
  CHECK(s.full_main_loop_us == doctest::Approx(5.0));
  CHECK(cuda::format_timeline("gemm_h", s)
            .find("main loop of tiles <= 64 rows 2.00 us (1), of fuller tiles 5.00 us (2)") != std::string::npos);
}

TEST_CASE("timeline: stamps out of order or missing are not counted as finished blocks") {
  std::vector<uint64_t> raw(2 * cuda::kTimelineSlots, 0);
  put(raw, 0, {5000, 4000, 0, 6000, 7000, 1}); // called before entry
  put(raw, 1, {5000, 6000, 0, 0, 7000, 1});    // no main-loop end
  cuda::TimelineSummary s = cuda::summarize_timeline(raw, 2);
  CHECK(s.blocks == 0);
  CHECK(s.span_us == 0);
}

TEST_CASE("timeline: the stamped GEMMs compile for sm_90a within their resources, and only when asked") {
  Example ex = make_example("moe_mlp", small());
  Schedule s = preset("scattermoe");
  s.mma("*", MmaKind::wgmma_ws).tma("*", true);
  cuda::CompiledLayer plain = cuda::compile_layer(ex.pipeline, s);
  CHECK(plain.source.source.find("MF_STAMP") == std::string::npos);
  TimelineOn on;
  cuda::CompiledLayer stamped = cuda::compile_layer(ex.pipeline, s);
  CHECK(stamped.source.source.find("#define MF_TIMELINE") != std::string::npos);
  CHECK(stamped.source.source.find("MF_STAMP(4)") != std::string::npos);
  CHECK(stamped.source.source.find("MF_NOTE_ROWS(rows)") != std::string::npos);
  testing::check_resources(stamped, "moe_mlp / timeline");
}

TEST_SUITE("gpu") {
  TEST_CASE("cuda gpu: a timeline build reports every GEMM's blocks with their phases in order") {
    MOEFORGE_REQUIRE_GPU();
    static cuda::Device device;
    TimelineOn on;
    Example ex = make_example("moe_mlp", small());
    Schedule s = preset("scattermoe");
    s.mma("*", MmaKind::wgmma_ws).tma("*", true);
    cuda::CompiledLayer c = cuda::compile_layer(ex.pipeline, s, device.arch_specific());
    cuda::CudaLayer layer(device, c, small().tokens);
    layer.upload(ex.random_inputs(small(), 3));
    cuda::Stream stream;
    std::vector<std::string> lines = layer.timeline(stream);
    REQUIRE(lines.size() == 3); // logits, h, o
    for (const std::string &line : lines) {
      INFO(line);
      // Some blocks finished, on at least one SM, with a positive span.
      CHECK(line.find(": 0 blocks") == std::string::npos);
      CHECK(line.find("span 0.0 us") == std::string::npos);
    }
  }
}
