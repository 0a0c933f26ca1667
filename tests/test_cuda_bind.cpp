// Another framework's device memory in and out of a training layer:
// bind() (the layer reads and writes the caller's memory, no copy) and
// copy_in / copy_out (device-to-device on a stream), what moeforge.torch
// uses. Each is checked bit for bit against the same layer run through
// upload() and download(), the caller's output and gradient memory poisoned
// first; mistakes (wrong size, a padded tensor, a misaligned address, an
// unknown name) are user errors that say what to change.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <string>

#include "backends/cuda/runtime/training_layer.h"
#include "benchmarks/train_schedule.h"
#include "gpu_test.h"
#include "layer_compare.h"
#include "runtime/program_shapes.h"
#include "schedules/presets.h"
#include "user_error.h"

using namespace moeforge;
using moeforge::testing::shape;

namespace {

// A device buffer holding `t` stored as `dtype`.
cuda::DeviceBuffer device_tensor(const HostTensor &t, DType dtype) {
  std::vector<uint8_t> bytes = encode_values(t.data, dtype);
  cuda::DeviceBuffer b(bytes.size());
  b.upload(bytes);
  return b;
}

bool has_text(const std::string &text, const std::string &part) { return text.find(part) != std::string::npos; }

} // namespace

TEST_SUITE("gpu") {
  TEST_CASE("cuda bind: a layer reading and writing the caller's memory matches upload and download bit for bit") {
    MOEFORGE_REQUIRE_GPU();
    cuda::Device device;
    ExampleShape s = shape(200, 64, 128, 8, 2);
    Example ex = make_example("moe_mlp", s);
    TensorMap inputs = ex.random_inputs(s, 21);
    std::mt19937_64 rng(22);
    HostTensor dy = random_tensor({s.tokens, s.d}, rng);
    for (bool reuse : {false, true}) {
      INFO("reuse_memory " << reuse);
      Schedule schedule = preset("scattermoe");
      schedule.reuse_memory(reuse);
      cuda::CompiledTraining compiled =
          cuda::compile_training(ex.pipeline, ex.pipeline.func("y"), schedule, device.arch_specific());
      cuda::Stream stream;

      // The plain way.
      cuda::TrainingLayer plain(device, compiled, s.tokens);
      plain.upload(inputs);
      plain.upload_upstream_gradient(dy);
      plain.forward(stream);
      plain.backward(stream);
      stream.synchronize();

      // Everything bound to memory the test owns.
      cuda::TrainingLayer bound(device, compiled, s.tokens);
      std::map<std::string, cuda::DeviceBuffer> mine;
      for (const auto &[name, t] : inputs)
        mine.emplace(name, device_tensor(t, bound.info(name).dtype));
      mine.emplace("d_y", device_tensor(dy, bound.info("d_y").dtype));
      for (const char *name : {"y", "d_x", "d_wr", "d_w1", "d_w2"}) {
        mine.emplace(name, cuda::DeviceBuffer(bound.info(name).bytes));
        mine.at(name).fill32(cuda::kPoisonNaN);
      }
      for (auto &[name, b] : mine)
        if (name.rfind("d_", 0) != 0 || name == "d_y")
          bound.bind(name, b.ptr(), b.bytes());
      for (const char *of : {"x", "wr", "w1", "w2"})
        bound.bind_gradient(of, mine.at(std::string("d_") + of).ptr(), mine.at(std::string("d_") + of).bytes());
      bound.forward(stream);
      bound.backward(stream);
      stream.synchronize();
      for (const char *name : {"y", "d_x", "d_wr", "d_w1", "d_w2"}) {
        INFO(name);
        HostTensor want = plain.download(name);
        // What the layer reads back through its binding, and the test's own
        // bytes: both exactly the plain layer's values.
        CHECK(max_normalized_error(bound.download(name), want) == 0.0);
        CHECK(mine.at(name).download<uint8_t>() == encode_values(want.data, bound.info(name).dtype));
      }

      // copy_in / copy_out: the same values through device-to-device copies.
      cuda::TrainingLayer copied(device, compiled, s.tokens);
      for (const auto &[name, t] : inputs)
        copied.copy_in(name, mine.at(name).ptr(), mine.at(name).bytes(), stream);
      copied.copy_in("d_y", mine.at("d_y").ptr(), mine.at("d_y").bytes(), stream);
      copied.forward(stream);
      copied.backward(stream);
      cuda::DeviceBuffer y(copied.info("y").bytes), dw1(copied.info("d_w1").bytes);
      y.fill32(cuda::kPoisonNaN);
      dw1.fill32(cuda::kPoisonNaN);
      copied.copy_out("y", y.ptr(), y.bytes(), stream);
      copied.copy_gradient("w1", dw1.ptr(), dw1.bytes(), stream);
      stream.synchronize();
      CHECK(y.download<uint8_t>() == encode_values(plain.download("y").data, copied.info("y").dtype));
      CHECK(dw1.download<uint8_t>() == encode_values(plain.download("d_w1").data, copied.info("d_w1").dtype));
    }
  }

  TEST_CASE("cuda bind: inputs uploaded as storage bytes give the host upload's output bit for bit") {
    MOEFORGE_REQUIRE_GPU();
    cuda::Device device;
    ExampleShape s = shape(300, 64, 128, 8, 2);
    Example ex = make_example("swiglu_moe", s);
    cuda::CompiledLayer compiled = cuda::compile_layer(ex.pipeline, preset("megablocks"), device.arch_specific());
    cuda::Stream stream;
    cuda::CudaLayer host(device, compiled, s.tokens), bytes(device, compiled, s.tokens);
    host.upload(ex.random_inputs(s, 31));
    for (const BufferPtr &b : ex.pipeline.buffers()) {
      int64_t elements = 1;
      for (int64_t e : ex.input_shape(*b, s))
        elements *= e;
      const double a = ex.init_range(b->name);
      bytes.upload_bytes(b->name, encode_hashed_random(elements, 31, random_stream(b->name), -a, a,
                                                       b->dtype == DType::bf16, bytes.info(b->name).dtype));
    }
    for (cuda::CudaLayer *l : {&host, &bytes}) {
      l->poison();
      l->enqueue(stream);
    }
    stream.synchronize();
    CHECK(host.download("y").data == bytes.download("y").data);
    CHECK(!std::isnan(bytes.download("y").data[0]));
    CHECK(has_text(testing::user_error_of([&] { bytes.upload_bytes("x", std::vector<uint8_t>(10)); }),
                   "upload_bytes of 'x': 10 bytes given, the layer holds 38400 (bf16 values of its shape)"));
    CHECK(has_text(testing::user_error_of([&] { bytes.upload_bytes("y", std::vector<uint8_t>(10)); }),
                   "'y' is not an Input or Param of the layer"));
  }

  TEST_CASE("cuda bind: replayed graphs give the eager step's bits, and a bind that moves a tensor captures again") {
    MOEFORGE_REQUIRE_GPU();
    cuda::Device device;
    ExampleShape s = shape(200, 64, 128, 8, 2);
    Example ex = make_example("swiglu_moe", s);
    std::mt19937_64 rng(23);
    HostTensor dy = random_tensor({s.tokens, s.d}, rng);
    // tuned_wide: TMA loads and stores, whose descriptors a graph holds by value.
    Schedule schedule = bench::tuned_wide(true);
    cuda::CompiledTraining compiled =
        cuda::compile_training(ex.pipeline, ex.pipeline.func("y"), schedule, device.arch_specific());
    cuda::Stream stream;
    const std::vector<std::string> outs = {"y", "d_x", "d_wr", "d_w1", "d_w3", "d_w2"};
    // The eager step on inputs `in`, as bytes per output.
    auto eager = [&](const TensorMap &in) {
      cuda::TrainingLayer l(device, compiled, s.tokens);
      l.upload(in);
      l.upload_upstream_gradient(dy);
      l.forward(stream);
      l.backward(stream);
      stream.synchronize();
      std::map<std::string, HostTensor> got;
      for (const std::string &o : outs)
        got[o] = l.download(o);
      return got;
    };
    TensorMap a = ex.random_inputs(s, 31), b = ex.random_inputs(s, 32);
    const auto want_a = eager(a), want_b = eager(b);

    cuda::TrainingLayer layer(device, compiled, s.tokens);
    layer.replay_graphs(true);
    layer.upload(a);
    layer.upload_upstream_gradient(dy);
    // x bound to memory the test owns, twice over: a's rows, then b's.
    cuda::DeviceBuffer xa = device_tensor(a.at("x"), layer.info("x").dtype);
    cuda::DeviceBuffer xb = device_tensor(b.at("x"), layer.info("x").dtype);
    layer.bind("x", xa.ptr(), xa.bytes());
    auto step_matches = [&](const std::map<std::string, HostTensor> &want, const char *what) {
      layer.poison();
      layer.upload_upstream_gradient(dy);
      layer.forward(stream);
      layer.backward(stream);
      stream.synchronize();
      for (const std::string &o : outs) {
        INFO(what << ": " << o);
        CHECK(max_normalized_error(layer.download(o), want.at(o)) == 0.0);
      }
    };
    // Eager, then captured, then replayed: the same bits each time.
    for (const char *what : {"first step (eager)", "second (captured)", "third (replayed)"})
      step_matches(want_a, what);
    // The same address bound again moves nothing: still replayed.
    const uint64_t epoch = layer.layer().bind_epoch();
    layer.bind("x", xa.ptr(), xa.bytes());
    CHECK(layer.layer().bind_epoch() == epoch);
    step_matches(want_a, "the same address bound again");
    // x moved to b's rows (the other Inputs still a's): the graph captured at
    // the old address must not run; the first steps eager, then captured.
    layer.upload(b);
    layer.bind("x", xb.ptr(), xb.bytes());
    CHECK(layer.layer().bind_epoch() == epoch + 1);
    for (const char *what : {"moved (eager)", "moved (captured)", "moved (replayed)"})
      step_matches(want_b, what);
    // Two addresses in turn (a second buffer of b's rows, as a model's two
    // micro-batches or an allocator's cycle give): the new one runs eagerly,
    // then is captured, and from then on both replay, each its own graph.
    cuda::DeviceBuffer xb2 = device_tensor(b.at("x"), layer.info("x").dtype);
    for (int i = 0; i < 4; ++i) {
      layer.bind("x", i % 2 ? xb2.ptr() : xb.ptr(), xb.bytes());
      step_matches(want_b, i % 2 ? "second address" : "first address");
    }
    const cuda::TrainingLayer::GraphCounts settled = layer.graph_counts();
    CHECK(settled.captured >= 3); // a's, b's, and the second address's forward at least
    for (int i = 0; i < 4; ++i) {
      layer.bind("x", i % 2 ? xb2.ptr() : xb.ptr(), xb.bytes());
      step_matches(want_b, i % 2 ? "second address, replayed" : "first address, replayed");
    }
    const cuda::TrainingLayer::GraphCounts later = layer.graph_counts();
    CHECK(later.replayed - settled.replayed == 8); // forward and backward, four steps
    CHECK(later.captured == settled.captured);
    CHECK(later.eager == settled.eager);
  }

  TEST_CASE("cuda bind: mistakes are user errors that say what to change") {
    MOEFORGE_REQUIRE_GPU();
    cuda::Device device;
    ExampleShape s = shape(64, 64, 128, 8, 2);
    Example ex = make_example("moe_mlp", s);
    cuda::Stream stream;
    cuda::DeviceBuffer big(1 << 20);
    for (bool reuse : {false, true}) {
      INFO("reuse_memory " << reuse);
      Schedule schedule = preset("megablocks"); // o stored padded
      schedule.reuse_memory(reuse);
      cuda::CompiledTraining compiled =
          cuda::compile_training(ex.pipeline, ex.pipeline.func("y"), schedule, device.arch_specific());
      cuda::TrainingLayer layer(device, compiled, s.tokens);
      const size_t x_bytes = layer.info("x").bytes;
      CHECK(x_bytes == size_t(64 * 64 * 2));
      CHECK(layer.info("x").shape == std::vector<int64_t>{64, 64});
      CHECK(layer.info("x").contiguous);
      CHECK(layer.info("h").contiguous); // routed rows in pair order: the user's layout
      CHECK(!layer.info("o").contiguous);
      CHECK(has_text(testing::user_error_of([&] { layer.bind("x", big.ptr(), x_bytes / 2); }),
                     "bind of 'x': 4096 bytes given, the layer holds 8192 (bf16 values of its shape)"));
      CHECK(has_text(testing::user_error_of([&] { layer.bind("x", big.ptr() + 2, x_bytes); }), "not 16-byte aligned"));
      CHECK(has_text(testing::user_error_of([&] { layer.bind("nosuch", big.ptr(), x_bytes); }), "nosuch"));
      CHECK(has_text(testing::user_error_of([&] { layer.copy_in("y", big.ptr(), layer.info("y").bytes, stream); }),
                     "copy_in: 'y' is not an Input or Param of the layer"));
      const std::string padded =
          testing::user_error_of([&] { layer.copy_out("o", big.ptr(), layer.info("o").bytes, stream); });
      // 'o' is read by the backward, so it outlives the run under reuse too.
      CHECK(has_text(padded, "'o' is stored padded (routed rows grouped by expert) on the device"));
      if (reuse) { // some backward intermediate shares the arena: never copied out
        int shared = 0;
        for (const TensorDecl &t : compiled.layer.program.tensors)
          if (!t.is_input && layer.info(t.name).contiguous &&
              has_text(testing::user_error_of([&] { layer.copy_out(t.name, big.ptr(), 0, stream); }),
                       "shares its memory with other tensors under reuse_memory(true)"))
            ++shared;
        CHECK(shared > 0);
      }
    }
  }
}
