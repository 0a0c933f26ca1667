#include "benchmarks/dense_roof.h"

#include "backends/cuda/runtime/cublas_gemm.h"
#include "backends/cuda/runtime/device.h"
#include "dsl/error.h"

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

namespace moeforge::bench {

namespace {

constexpr int kReps = 20;
constexpr uint32_t kBf16OnePair = 0x3f803f80u; // two bf16 1.0 values

using Key = std::tuple<int64_t, int64_t, int64_t, bool, RoofData>; // rows, d, f, swiglu, inputs

Key key_of(const RoofShape &s, RoofData data) { return {s.rows(), s.d, s.f, s.swiglu, data}; }

cuda::DeviceBuffer bf16_buffer(int64_t rows, int64_t cols) {
  return cuda::DeviceBuffer(static_cast<size_t>(rows) * static_cast<size_t>(cols) * 2);
}

// bf16 in [-1, 1) from a fixed xorshift stream (rounded to nearest even),
// or 1.0 everywhere.
void fill_inputs(std::initializer_list<cuda::DeviceBuffer *> buffers, RoofData data) {
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (cuda::DeviceBuffer *b : buffers) {
    if (data == RoofData::ones) {
      b->fill32(kBf16OnePair);
      continue;
    }
    std::vector<uint16_t> host(b->bytes() / 2);
    for (uint16_t &v : host) {
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      const float x = float(state >> 40) * 0x1p-23f - 1.0f; // 24 random bits: [-1, 1)
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      v = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
    b->upload(host);
  }
}

// The forward's two GEMMs and their buffers (inputs: fill_inputs): H1 = X W1, Y = H W2.
struct ForwardGemms {
  int64_t rows, d, f, f1;
  cuda::DeviceBuffer x, w1, h1, h, w2, y;
  ForwardGemms(const RoofShape &s, RoofData data)
      : rows(s.rows()), d(s.d), f(s.f), f1(s.f1()), x(bf16_buffer(rows, d)), w1(bf16_buffer(d, f1)),
        h1(bf16_buffer(rows, f1)), h(bf16_buffer(rows, f)), w2(bf16_buffer(f, d)), y(bf16_buffer(rows, d)) {
    fill_inputs({&x, &w1, &h, &w2}, data);
  }
  void enqueue(const cuda::CublasHandle &handle, const cuda::Stream &stream) {
    cuda::gemm_nn(handle, stream, rows, f1, d, x.ptr(), w1.ptr(), h1.ptr());
    cuda::gemm_nn(handle, stream, rows, d, f, h.ptr(), w2.ptr(), y.ptr());
  }
};

} // namespace

namespace {

// `warm` calls of `work`, drained (an idle gap of microseconds, too short
// for the clock to move, so that the samples cover only timed calls), then
// `reps` calls between two events with the clocks read over them.
double warm_then_time(const cuda::Stream &s, int warm, int reps, const std::function<void()> &work,
                      cuda::ClockSampler *clocks, cuda::ClockReading *reading) {
  for (int i = 0; i < warm; ++i)
    work();
  s.synchronize();
  cuda::Event a, b;
  if (clocks)
    clocks->start();
  a.record(s);
  for (int i = 0; i < reps; ++i)
    work();
  b.record(s);
  b.synchronize();
  if (clocks)
    *reading = clocks->stop();
  return cuda::elapsed_ms(a, b) / reps;
}

} // namespace

double time_ms(const cuda::Stream &s, int reps, const std::function<void()> &work, cuda::ClockSampler *clocks,
               cuda::ClockReading *reading) {
  return warm_then_time(s, 1, reps, work, clocks, reading);
}

double roof_forward_ms(const RoofShape &s, RoofData data) {
  static std::map<Key, double> cache;
  if (auto it = cache.find(key_of(s, data)); it != cache.end())
    return it->second;
  ForwardGemms fwd(s, data);
  cuda::CublasHandle handle;
  cuda::Stream stream;
  double ms = time_ms(stream, kReps, [&] { fwd.enqueue(handle, stream); });
  return cache[key_of(s, data)] = ms;
}

double time_ms_steady(const cuda::Stream &s, double call_ms, double warm_ms, double timed_ms,
                      const std::function<void()> &work, cuda::ClockSampler *clocks, cuda::ClockReading *reading) {
  const int warm = std::max(1, static_cast<int>(warm_ms / call_ms));
  const int reps = std::max(1, static_cast<int>(timed_ms / call_ms));
  return warm_then_time(s, warm, reps, work, clocks, reading);
}

namespace {

// A roof's buffers (ForwardGemms, TrainingGemms), allocated and filled with
// random inputs by the first call for the shape and kept for the process.
template <typename Gemms> Gemms &kept(const RoofShape &s) {
  static std::map<Key, std::unique_ptr<Gemms>> buffers;
  std::unique_ptr<Gemms> &g = buffers[key_of(s, RoofData::random)];
  if (!g)
    g = std::make_unique<Gemms>(s, RoofData::random);
  return *g;
}

// `gemms` at the card's steady state (time_ms_steady); three calls first
// set the call counts.
template <typename Gemms>
double steady_ms(Gemms &gemms, double warm_ms, double timed_ms, cuda::ClockSampler *clocks,
                 cuda::ClockReading *reading) {
  cuda::CublasHandle handle;
  cuda::Stream stream;
  auto work = [&] { gemms.enqueue(handle, stream); };
  const double call_ms = time_ms(stream, 3, work);
  return time_ms_steady(stream, call_ms, warm_ms, timed_ms, work, clocks, reading);
}

} // namespace

double roof_forward_ms_now(const RoofShape &s, cuda::ClockSampler *clocks, cuda::ClockReading *reading) {
  ForwardGemms &fwd = kept<ForwardGemms>(s);
  cuda::CublasHandle handle;
  cuda::Stream stream;
  return time_ms(
      stream, kReps, [&] { fwd.enqueue(handle, stream); }, clocks, reading);
}

double roof_forward_ms_steady(const RoofShape &s, double warm_ms, double timed_ms, cuda::ClockSampler *clocks,
                              cuda::ClockReading *reading) {
  return steady_ms(kept<ForwardGemms>(s), warm_ms, timed_ms, clocks, reading);
}

namespace {

// The training roof's GEMMs: the forward's two and the backward's four on
// fixed upstream gradients (dY, and dH1 after the activation's backward).
struct TrainingGemms {
  ForwardGemms fwd;
  cuda::DeviceBuffer dy, dh1, dh, dw2, dx, dw1;
  TrainingGemms(const RoofShape &s, RoofData data)
      : fwd(s, data), dy(bf16_buffer(fwd.rows, s.d)), dh1(bf16_buffer(fwd.rows, fwd.f1)),
        dh(bf16_buffer(fwd.rows, s.f)), dw2(bf16_buffer(s.f, s.d)), dx(bf16_buffer(fwd.rows, s.d)),
        dw1(bf16_buffer(s.d, fwd.f1)) {
    fill_inputs({&dy, &dh1}, data);
  }
  void enqueue(const cuda::CublasHandle &handle, const cuda::Stream &stream) {
    const int64_t rows = fwd.rows, d = fwd.d, f = fwd.f, f1 = fwd.f1;
    fwd.enqueue(handle, stream);                                                   // H1 = X W1, Y = H W2
    cuda::gemm_nt(handle, stream, rows, f, d, dy.ptr(), fwd.w2.ptr(), dh.ptr());   // dH = dY W2^T
    cuda::gemm_tn(handle, stream, f, d, rows, fwd.h.ptr(), dy.ptr(), dw2.ptr());   // dW2 = H^T dY
    cuda::gemm_nt(handle, stream, rows, d, f1, dh1.ptr(), fwd.w1.ptr(), dx.ptr()); // dX = dH1 W1^T
    cuda::gemm_tn(handle, stream, d, f1, rows, fwd.x.ptr(), dh1.ptr(), dw1.ptr()); // dW1 = X^T dH1
  }
};

} // namespace

double roof_forward_backward_ms(const RoofShape &s, RoofData data) {
  static std::map<Key, double> cache;
  if (auto it = cache.find(key_of(s, data)); it != cache.end())
    return it->second;
  TrainingGemms gemms(s, data);
  cuda::CublasHandle handle;
  cuda::Stream stream;
  double ms = time_ms(stream, kReps, [&] { gemms.enqueue(handle, stream); });
  return cache[key_of(s, data)] = ms;
}

double roof_forward_backward_ms_steady(const RoofShape &s, double warm_ms, double timed_ms, cuda::ClockSampler *clocks,
                                       cuda::ClockReading *reading) {
  // Kept as the forward's are (mixtral's: about 4 GiB).
  return steady_ms(kept<TrainingGemms>(s), warm_ms, timed_ms, clocks, reading);
}

namespace {

// The expert-batched roof's GEMMs: each expert's rows of X and H, and its
// W1 and W2, back to back (gemm_nn_batched).
struct ExpertBatchedGemms {
  int64_t experts, rows_each, d, f, f1;
  cuda::DeviceBuffer x, w1, h1, h, w2, y;
  ExpertBatchedGemms(const RoofShape &s, int64_t e)
      : experts(e), rows_each(s.rows() / e), d(s.d), f(s.f), f1(s.f1()), x(bf16_buffer(s.rows(), d)),
        w1(bf16_buffer(e * d, f1)), h1(bf16_buffer(s.rows(), f1)), h(bf16_buffer(s.rows(), f)),
        w2(bf16_buffer(e * f, d)), y(bf16_buffer(s.rows(), d)) {
    fill_inputs({&x, &w1, &h, &w2}, RoofData::random);
  }
  void enqueue(const cuda::CublasHandle &handle, const cuda::Stream &stream) {
    cuda::gemm_nn_batched(handle, stream, experts, rows_each, f1, d, x.ptr(), w1.ptr(), h1.ptr());
    cuda::gemm_nn_batched(handle, stream, experts, rows_each, d, f, h.ptr(), w2.ptr(), y.ptr());
  }
};

ExpertBatchedGemms &kept_batched(const RoofShape &s, int64_t experts) {
  user_check(experts > 0 && s.rows() % experts == 0)
      << "the expert-batched roof splits T*k = " << s.rows() << " rows into " << experts
      << " experts of equal rows: T*k must be a positive multiple of the expert count";
  static std::map<std::pair<Key, int64_t>, std::unique_ptr<ExpertBatchedGemms>> buffers;
  std::unique_ptr<ExpertBatchedGemms> &g = buffers[{key_of(s, RoofData::random), experts}];
  if (!g)
    g = std::make_unique<ExpertBatchedGemms>(s, experts);
  return *g;
}

} // namespace

double expert_batched_forward_ms_now(const RoofShape &s, int64_t experts, cuda::ClockSampler *clocks,
                                     cuda::ClockReading *reading) {
  ExpertBatchedGemms &gemms = kept_batched(s, experts);
  cuda::CublasHandle handle;
  cuda::Stream stream;
  return time_ms(
      stream, kReps, [&] { gemms.enqueue(handle, stream); }, clocks, reading);
}

double expert_batched_forward_ms_steady(const RoofShape &s, int64_t experts, double warm_ms, double timed_ms,
                                        cuda::ClockSampler *clocks, cuda::ClockReading *reading) {
  return steady_ms(kept_batched(s, experts), warm_ms, timed_ms, clocks, reading);
}

RoofTimes dense_roof(const RoofShape &shape) { return {roof_forward_ms(shape), roof_forward_backward_ms(shape)}; }

} // namespace moeforge::bench
