// A layer's entry points (ranges of its program's steps: the training
// forward and backward, or the forward alone) replayed as one CUDA graph
// each instead of one launch per kernel, for calls short enough that the
// launches show (a 2 ms training step of ~30 kernels; a decoding forward of
// a few tokens, whose kernels take microseconds each).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <utility>

#include "backends/cuda/runtime/layer.h"
#include "backends/cuda/runtime/stream.h"

namespace moeforge::cuda {

class GraphReplay {
public:
  // Each entry point keeps the graphs of its last few address sets: a layer
  // a model runs at two sets in turn (two micro-batches, a module used
  // twice, an allocator handing back blocks in a cycle) replays both
  // instead of capturing at every call.
  static constexpr size_t kGraphsPerEntry = 4;
  // What the calls did, counted since the replay was made (for benchmarks
  // and tests: a loop at steady addresses should replay).
  struct Counts {
    uint64_t replayed = 0, captured = 0, eager = 0;
  };

  // Enqueues steps [begin, end) of `layer` on `stream`, checking first for
  // a NaN or infinite routing score of earlier work (raised naming `entry`,
  // the caller's entry point: "forward()").
  // A graph holds TMA descriptors by value, so it is keyed by the steps'
  // signature (CudaLayer::signature: the token count and every address the
  // steps touch): the first call at a signature runs eagerly, the second
  // captures, later ones replay. Eagerly always while `on` is false, and
  // while `stream` is being captured by someone else (a step inside
  // torch.cuda.graph is queued into that capture).
  void run(CudaLayer &layer, size_t begin, size_t end, const Stream &stream, const char *entry, bool on);
  const Counts &counts() const { return counts_; }

private:
  // One entry point's graphs, most recently used first, each with the
  // signature it was captured at; and the signatures it last ran eagerly at
  // (a second call at one captures).
  struct Entry {
    std::deque<std::pair<uint64_t, CudaGraph>> graphs;
    std::deque<uint64_t> eager_at;
  };
  std::map<std::pair<size_t, size_t>, Entry> entries_;
  Counts counts_;
  std::unique_ptr<Stream> capture_stream_; // graphs are recorded here (the legacy stream cannot be captured)
};

} // namespace moeforge::cuda
