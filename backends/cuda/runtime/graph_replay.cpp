#include "backends/cuda/runtime/graph_replay.h"

#include <algorithm>

namespace moeforge::cuda {

void GraphReplay::run(CudaLayer &layer, size_t begin, size_t end, const Stream &stream, const char *entry, bool on) {
  // Before anything is queued, so a graph replay reports it too.
  layer.check_routing_scores(stream, entry);
  Entry &r = entries_[{begin, end}];
  const uint64_t epoch = layer.signature(begin, end);
  auto cached = std::find_if(r.graphs.begin(), r.graphs.end(), [&](const auto &g) { return g.first == epoch; });
  const bool seen = std::find(r.eager_at.begin(), r.eager_at.end(), epoch) != r.eager_at.end();
  if (!on || is_capturing(stream) || (cached == r.graphs.end() && !seen)) {
    layer.enqueue(stream, begin, end);
    ++counts_.eager;
    if (!seen) {
      r.eager_at.push_front(epoch);
      if (r.eager_at.size() > kGraphsPerEntry)
        r.eager_at.pop_back();
    }
    return;
  }
  if (cached == r.graphs.end()) {
    // Recording runs nothing, so a stream of our own can record what then
    // replays on the caller's; enqueue's checks run here as they would
    // eagerly.
    if (!capture_stream_)
      capture_stream_ = std::make_unique<Stream>();
    CudaGraph g = CudaGraph::capture(*capture_stream_, [&] { layer.enqueue(*capture_stream_, begin, end); });
    r.graphs.emplace_front(epoch, std::move(g));
    if (r.graphs.size() > kGraphsPerEntry)
      r.graphs.pop_back();
    ++counts_.captured;
  } else {
    if (cached != r.graphs.begin())
      std::rotate(r.graphs.begin(), cached, cached + 1); // most recently used first
    ++counts_.replayed;
  }
  r.graphs.front().second.launch(stream);
}

} // namespace moeforge::cuda
