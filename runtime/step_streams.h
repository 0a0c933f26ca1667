// Which steps of a kernel program may run side by side, and on which stream
// (Schedule::concurrent_steps).
//
// A program's steps are listed in an order that is correct one after the
// other; many of them share no memory (a training backward's weight
// gradients and its input gradient; the router's small kernels beside the
// expert GEMMs). Run on several streams, an independent step fills the
// machine while another kernel's last wave leaves most of it idle: a GEMM of
// 2048 tiles on 132 SMs runs 15.5 waves, the last half empty.
//
// Two steps conflict when one writes bytes the other reads or writes, by
// address ranges rather than tensor names, so tensors that share memory by
// lifetime (reuse_memory) or that a caller bound to the same memory are
// ordered too. A barrier step (a routing step, whose tables every later
// kernel reads) conflicts with every step. Target-independent (the CPU tests
// check it); the CUDA runtime enqueues by it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "lowering/kernel_program.h"

namespace moeforge {

// A half-open byte range [first, second) of device memory.
using ByteRange = std::pair<uint64_t, uint64_t>;

struct StepAccess {
  std::vector<ByteRange> reads, writes;
  bool barrier = false;
};

struct StreamPlan {
  struct Placement {
    int stream = 0;            // 0: the caller's stream; 1.. the layer's own
    std::vector<size_t> waits; // steps on other streams that must finish first
    bool record = false;       // a later step, or the final join, waits for this one
  };
  std::vector<Placement> steps;
  int streams = 1;           // streams used, the caller's included
  std::vector<size_t> joins; // the last step of every other stream: the caller's stream waits for them at the end
  // Before its first step every other stream waits for the work queued on the
  // caller's stream before the program (a "fork" point), so a program never
  // overtakes what its caller queued ahead of it.
};

// The accesses of program steps [begin, end): each tensor a step reads or
// writes (step_reads, step_outputs; the program's tensors, not a GEMM
// epilogue's accumulators) at the bytes `range_of` gives it; a routing step
// is a barrier.
std::vector<StepAccess> step_accesses(const KernelProgram &p, size_t begin, size_t end,
                                      const std::function<ByteRange(const std::string &)> &range_of);

// Whether step `a` (earlier) and step `b` (later) must stay in that order.
bool steps_conflict(const StepAccess &a, const StepAccess &b);

// Places steps on at most `max_streams` streams. Every conflicting pair stays
// ordered (same stream, or a wait on the earlier step or on one ordered after
// it); a step goes to a stream whose last step its dependencies already
// order before it (no false dependency), else to an unused stream, else to
// the stream whose last step was queued earliest.
// max_streams = 1 gives every step stream 0 with no waits.
StreamPlan plan_streams(const std::vector<StepAccess> &steps, int max_streams);

// Whether step i finishes before step j starts under `plan`.
bool ordered_before(const StreamPlan &plan, size_t i, size_t j);

// At most this many streams run one program's steps (the caller's included):
// beyond a GEMM and the work that fills its last wave, more streams only add
// waits.
inline constexpr int kMaxStepStreams = 8;

// The order in which a program's steps run under concurrent_steps, before
// memory is placed: the entry points [0, b1), [b1, b2), ... (a training
// program's forward and backward) one after the other, the steps of each
// placed by plan_streams with every tensor on bytes of its own. The memory
// plan lets two tensors share bytes only when every step touching one runs
// before every step touching the other in this order.
class StepOrder {
public:
  StepOrder(const KernelProgram &p, const std::vector<size_t> &boundaries, int max_streams);
  // Whether step i (program index) finishes before step j starts.
  bool before(size_t i, size_t j) const { return i < j && before_[i][j]; }

private:
  std::vector<std::vector<char>> before_;
};

} // namespace moeforge
