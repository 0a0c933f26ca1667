#include "backends/cuda/runtime/stream.h"

#include "dsl/error.h"

#include <utility>

namespace moeforge::cuda {

Stream::Stream() { MOEFORGE_CU(cuStreamCreate, &stream_, CU_STREAM_NON_BLOCKING); }

Stream::Stream(HighPriority) {
  int least = 0, greatest = 0; // numerically lower is higher priority
  MOEFORGE_CU(cuCtxGetStreamPriorityRange, &least, &greatest);
  MOEFORGE_CU(cuStreamCreateWithPriority, &stream_, CU_STREAM_NON_BLOCKING, greatest);
}

Stream Stream::borrow(CUstream handle) {
  Stream s(nullptr);
  s.stream_ = handle;
  s.owned_ = false;
  return s;
}

Stream::~Stream() {
  // Destructors must not throw; a failure here would mean the context is
  // already gone, and there is nothing left to free.
  if (stream_ && owned_)
    driver().cuStreamDestroy(stream_);
}

Stream::Stream(Stream &&other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)), owned_(std::exchange(other.owned_, true)) {}

Stream &Stream::operator=(Stream &&other) noexcept {
  std::swap(stream_, other.stream_);
  std::swap(owned_, other.owned_);
  return *this;
}

void Stream::wait(const Event &event) const { MOEFORGE_CU(cuStreamWaitEvent, stream_, event.handle(), 0); }

void Stream::synchronize() const { MOEFORGE_CU(cuStreamSynchronize, stream_); }

Event::Event() { MOEFORGE_CU(cuEventCreate, &event_, CU_EVENT_DEFAULT); }

Event::~Event() {
  if (event_)
    driver().cuEventDestroy(event_);
}

Event::Event(Event &&other) noexcept : event_(std::exchange(other.event_, nullptr)) {}

Event &Event::operator=(Event &&other) noexcept {
  std::swap(event_, other.event_);
  return *this;
}

void Event::record(const Stream &stream) { MOEFORGE_CU(cuEventRecord, event_, stream.handle()); }

void Event::synchronize() const { MOEFORGE_CU(cuEventSynchronize, event_); }

float elapsed_ms(const Event &start, const Event &end) {
  end.synchronize();
  float ms = 0.0f;
  MOEFORGE_CU(cuEventElapsedTime, &ms, start.handle(), end.handle());
  return ms;
}

CudaGraph::~CudaGraph() {
  if (exec_)
    driver().cuGraphExecDestroy(exec_);
  if (graph_)
    driver().cuGraphDestroy(graph_);
}

CudaGraph::CudaGraph(CudaGraph &&other) noexcept
    : graph_(std::exchange(other.graph_, nullptr)), exec_(std::exchange(other.exec_, nullptr)) {}

CudaGraph &CudaGraph::operator=(CudaGraph &&other) noexcept {
  std::swap(graph_, other.graph_);
  std::swap(exec_, other.exec_);
  return *this;
}

bool is_capturing(const Stream &stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  MOEFORGE_CU(cuStreamIsCapturing, stream.handle(), &status);
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

void begin_capture(Stream &stream) {
  MOEFORGE_CU(cuStreamBeginCapture, stream.handle(), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
}

CudaGraph end_capture(Stream &stream) {
  CudaGraph g;
  MOEFORGE_CU(cuStreamEndCapture, stream.handle(), &g.graph_);
  MOEFORGE_CU(cuGraphInstantiate, &g.exec_, g.graph_, 0);
  return g;
}

CudaGraph CudaGraph::capture(Stream &stream, const std::function<void()> &work) {
  begin_capture(stream);
  try {
    work();
  } catch (...) {
    // Leave the stream usable: end the (now invalid) capture, drop its graph.
    CUgraph partial = nullptr;
    if (driver().cuStreamEndCapture(stream.handle(), &partial) == CUDA_SUCCESS && partial)
      driver().cuGraphDestroy(partial);
    throw;
  }
  return end_capture(stream);
}

void CudaGraph::launch(const Stream &stream) const {
  internal_check(exec_ != nullptr) << "launching an empty CudaGraph";
  MOEFORGE_CU(cuGraphLaunch, exec_, stream.handle());
}

} // namespace moeforge::cuda
