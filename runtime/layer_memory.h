// Where a compiled layer's intermediates live, for either backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

namespace moeforge {

// owned   buffers of its own for the token count it was made for (or, under
//         Schedule::reuse_memory, one arena planned by lifetime), held for
//         the layer's life; Inputs, Params and outputs too until bound.
// caller  none of its own: the caller gives each step its memory (place()),
//         as a model's framework gives its layers memory from its
//         allocator, and binds every Input, Param and output. Any token
//         count runs (set_tokens) without new memory or compiling.
enum class LayerMemory { owned, caller };

// LayerMemory::caller: the memory a step at some token count needs, in bytes
// (runtime/memory_plan.h, plan_step_memory).
struct StepMemory {
  // What the forward leaves for the backward (a training forward's
  // activations) and every route's tables: kept by the caller from the one's
  // start to the other's end, one set per forward in flight. In parts the
  // caller allocates one by one (runtime/memory_plan.h,
  // caller_memory_layout): the activations, then the small values and the
  // routing tables; a forward alone has the tables' part only.
  std::vector<size_t> saved;
  // What the forward, and the backward, use only while each runs: memory the
  // caller may reuse once the call's work is done.
  size_t workspace_before = 0, workspace_after = 0;

  size_t saved_bytes() const { return std::accumulate(saved.begin(), saved.end(), size_t{0}); }
};

// LayerMemory::caller: where one forward's saved parts are (StepMemory::
// saved, in its order), as addresses: device pointers or host ones.
using SavedParts = std::vector<uint64_t>;

} // namespace moeforge
