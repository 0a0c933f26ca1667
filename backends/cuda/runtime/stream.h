// Streams, events (GPU timing) and CUDA graphs captured from a stream.
//
// Everything here needs the device's context to be current on the calling
// thread (construct a Device first). Objects are move-only RAII owners of
// their driver handle.
#pragma once

#include "backends/cuda/runtime/driver.h"

#include <functional>

namespace moeforge::cuda {

// An asynchronous stream. Non-blocking with respect to the legacy default
// stream, so nothing outside moeforge serialises with it implicitly; that
// is also what stream capture into a graph requires.
class Stream {
public:
  Stream();
  // A stream whose blocks the scheduler starts before those of streams of
  // normal priority wherever both wait for an SM: for short transfers that
  // should not queue behind a long GEMM's blocks.
  struct HighPriority {};
  explicit Stream(HighPriority);
  // Another library's stream (PyTorch's current one, say), used but never
  // destroyed here; 0 is the legacy default stream.
  static Stream borrow(CUstream handle);
  ~Stream();
  Stream(Stream &&other) noexcept;
  Stream &operator=(Stream &&other) noexcept;
  Stream(const Stream &) = delete;
  Stream &operator=(const Stream &) = delete;

  CUstream handle() const { return stream_; }
  // Waits for all work queued so far; a kernel fault surfaces here.
  void synchronize() const;
  // Work queued here after this call starts once `event`'s point in its own
  // stream is reached (no host synchronisation).
  void wait(const class Event &event) const;

private:
  explicit Stream(std::nullptr_t) {} // no stream yet (borrow fills it in)
  CUstream stream_ = nullptr;
  bool owned_ = true;
};

// A point in a stream's work. Two of them time the work between them.
class Event {
public:
  Event();
  ~Event();
  Event(Event &&other) noexcept;
  Event &operator=(Event &&other) noexcept;
  Event(const Event &) = delete;
  Event &operator=(const Event &) = delete;

  CUevent handle() const { return event_; }
  void record(const Stream &stream);
  void synchronize() const;

private:
  CUevent event_ = nullptr;
};

// Milliseconds of GPU time between two recorded events (waits for `end`).
float elapsed_ms(const Event &start, const Event &end);

// An instantiated CUDA graph: a recorded sequence of stream work replayed
// with one launch. Kernel arguments are baked in at capture time, so replay
// reads and writes the same buffers.
class CudaGraph {
public:
  CudaGraph() = default;
  ~CudaGraph();
  CudaGraph(CudaGraph &&other) noexcept;
  CudaGraph &operator=(CudaGraph &&other) noexcept;
  CudaGraph(const CudaGraph &) = delete;
  CudaGraph &operator=(const CudaGraph &) = delete;

  // Records what `work` queues on `stream` (nothing runs during capture) and
  // instantiates it. If `work` throws, capture is ended and the error passes on.
  static CudaGraph capture(Stream &stream, const std::function<void()> &work);

  void launch(const Stream &stream) const;
  bool empty() const { return exec_ == nullptr; }

private:
  friend CudaGraph end_capture(Stream &stream);
  CUgraph graph_ = nullptr;
  CUgraphExec exec_ = nullptr;
};

// The two halves of CudaGraph::capture, for callers that cannot wrap the
// captured work in one function. Capture mode is thread-local: other threads
// may keep using the driver while this one captures.
void begin_capture(Stream &stream);
CudaGraph end_capture(Stream &stream);

// Whether work queued on `stream` is being recorded into a graph (by
// moeforge or by another library, torch.cuda.graph say) rather than run.
bool is_capturing(const Stream &stream);

} // namespace moeforge::cuda
