// The dense roof (design.md): cuBLAS doing the GEMMs of an MoE layer's
// shapes with no routing, as if every token copy went to one expert. One
// implementation, shared by every benchmark that reports `ratio = roof time /
// our time`, so forward and training numbers are measured against the same
// thing.
//
//   forward:  H1[Tk, f1] = X[Tk, d] W1[d, f1]      Y[Tk, d] = H[Tk, f] W2[f, d]
//   backward: dH[Tk, f]  = dY W2^T                  dW2[f, d] = H^T dY
//             dX[Tk, d]  = dH1 W1^T                 dW1[d, f1] = X^T dH1
//
// f1 = 2f for SwiGLU (W1 and W3 side by side), f otherwise. bf16 operands and
// outputs, fp32 accumulation (backends/cuda/runtime/cublas_gemm.h). No gather,
// activation, gate or combine is in the roof. Inputs are random bf16 in
// [-1, 1), as our layers' are: a tensor core's power, so the clock an SM
// holds under a long GEMM, depends on the operands' bits, and inputs of 1.0
// (which the roof read before 2026-11-23) let cuBLAS run faster than on
// real data (RoofData::ones keeps that measurement, for comparison). The
// backward GEMMs read fixed buffers, not the forward's outputs: only the
// GEMM shapes matter here.
//
// A cuda::Device for the GPU must exist (cuBLAS attaches to its primary
// context) before any call. Each time is measured once per shape and process
// and cached; the first call for a shape allocates its buffers (mixtral's
// forward + backward: about 4 GiB) and frees them before returning.
#pragma once

#include "backends/cuda/runtime/device_clocks.h"
#include "backends/cuda/runtime/stream.h"

#include <cstdint>
#include <functional>

namespace moeforge::bench {

struct RoofShape {
  int64_t tokens = 0; // T
  int64_t k = 1;      // top-k: the roof's GEMMs have T * k rows
  int64_t d = 0;      // model dimension
  int64_t f = 0;      // per-expert hidden dimension
  bool swiglu = false;

  int64_t rows() const { return tokens * k; }
  int64_t f1() const { return swiglu ? 2 * f : f; }
  // design.md's FLOP counts: 2 T k d (f1 + f) forward, twice that backward.
  double forward_flops() const { return 2.0 * double(rows()) * double(d) * double(f1() + f); }
  double forward_backward_flops() const { return 3.0 * forward_flops(); }
};

// Average milliseconds of GPU time per call of `work` (which queues on `s`):
// one warm-up call, then `reps` calls between two events; with `clocks`,
// the card's clocks over the timed calls (the warm-up left out) go to
// *reading.
double time_ms(const cuda::Stream &s, int reps, const std::function<void()> &work, cuda::ClockSampler *clocks = nullptr,
               cuda::ClockReading *reading = nullptr);

// Milliseconds per call of `work` at the card's steady state: calls made for
// `warm_ms` first (an estimate `call_ms` a call sets the counts), then timed
// over about `timed_ms`, with the clocks over the timed part into *reading
// when `clocks` is not null. Why: under a long GEMM the card runs into its
// power limit within a few hundred milliseconds and lowers its clock; a
// short burst after an idle pause is timed at a clock a continuous run
// (training) does not keep, and of two bursts of different lengths the
// shorter gains most. After `warm_ms` of the same work both sides are timed
// at the clock their power allows.
double time_ms_steady(const cuda::Stream &s, double call_ms, double warm_ms, double timed_ms,
                      const std::function<void()> &work, cuda::ClockSampler *clocks, cuda::ClockReading *reading);

// The roof's inputs: random bf16 in [-1, 1) (the roof), or all 1.0.
enum class RoofData { random, ones };

// The forward roof: the two forward GEMMs, 20 timed repetitions.
double roof_forward_ms(const RoofShape &shape, RoofData data = RoofData::random);

// The training roof: the two forward GEMMs and the four backward GEMMs in
// one timed loop, 20 repetitions.
double roof_forward_backward_ms(const RoofShape &shape, RoofData data = RoofData::random);

// The forward roof timed now, 20 repetitions, on buffers allocated and
// filled by the first call for the shape and kept for the process: for a
// ratio against a time measured just before it. The card's clock drifts by
// several percent with what it ran in the seconds before, so the roof
// measured once per process (above) can sit at another clock than a
// schedule timed minutes later; timed back to back, after the same idle
// pause, both see the same card. With `clocks`, the card's clocks over the
// timed repetitions go to *reading.
double roof_forward_ms_now(const RoofShape &shape, cuda::ClockSampler *clocks = nullptr,
                           cuda::ClockReading *reading = nullptr);

// The forward roof at the card's steady state (time_ms_steady), on the
// buffers roof_forward_ms_now keeps.
double roof_forward_ms_steady(const RoofShape &shape, double warm_ms, double timed_ms,
                              cuda::ClockSampler *clocks = nullptr, cuda::ClockReading *reading = nullptr);

// The training roof at the card's steady state, on buffers kept for the
// process.
double roof_forward_backward_ms_steady(const RoofShape &shape, double warm_ms, double timed_ms,
                                       cuda::ClockSampler *clocks = nullptr, cuda::ClockReading *reading = nullptr);

// The expert-batched roof: the forward's two GEMMs split into `experts`
// GEMMs of T·k / experts rows each, every one with weights of its own
// (W1 [E, d, f1], W2 [E, f, d]), run by cuBLAS as one strided batch. It is
// the dense roof with what per-expert weights cost and nothing a router
// adds: no routing, gather, activation or combine, no expert's last rows
// padded (every expert has the same rows). So roof time / this time says how
// close the vendor's GEMM comes to the dense roof with an MoE layer's
// weights, a reference for what a routed layer can reach. T·k must be a
// multiple of `experts`. Buffers are kept for the process, as the roof's are.
double expert_batched_forward_ms_now(const RoofShape &shape, int64_t experts, cuda::ClockSampler *clocks = nullptr,
                                     cuda::ClockReading *reading = nullptr);
double expert_batched_forward_ms_steady(const RoofShape &shape, int64_t experts, double warm_ms, double timed_ms,
                                        cuda::ClockSampler *clocks = nullptr, cuda::ClockReading *reading = nullptr);

struct RoofTimes {
  double forward_ms = 0;
  double forward_backward_ms = 0;
};
// Both of the above.
RoofTimes dense_roof(const RoofShape &shape);

} // namespace moeforge::bench
