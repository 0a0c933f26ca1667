// Where a compiled layer's intermediates live, for either backend.
#pragma once

#include <cstddef>

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
  // start to the other's end, one per forward in flight.
  size_t saved = 0;
  // What the forward, and the backward, use only while each runs: memory the
  // caller may reuse once the call's work is done.
  size_t workspace_before = 0, workspace_after = 0;
};

} // namespace moeforge
