// Where each tensor of a kernel program lives when tensors share memory
// (Schedule::reuse_memory): one arena, each tensor at an offset, two tensors
// overlapping only if no step runs while both hold values someone reads.
//
// A tensor is live from the first step that touches it to the last; it is
// kept (live to the end of the program) when the caller reads it after a
// run (an output, a gradient) or when it crosses `boundary`: written before
// it and read at or after it (what a training step's forward keeps for its
// backward, which may run more than once on it). Target-independent, so
// the CPU tests check it; the CUDA runtime places its buffers by it.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "lowering/kernel_program.h"
#include "runtime/layer_memory.h"
#include "runtime/program_shapes.h"
#include "runtime/size_terms.h"

namespace moeforge {

struct MemoryPlan {
  std::map<std::string, size_t> offset;                  // bytes into the arena, for every planned tensor
  std::map<std::string, size_t> size;                    // bytes, rounded up to the alignment
  std::map<std::string, std::pair<size_t, size_t>> live; // first and last step, inclusive
  size_t arena_bytes = 0;
  size_t separate_bytes = 0; // what the same tensors take one buffer each
  size_t last_step = 0;
  // Outputs placed on the bytes of the input an element-wise step writes
  // them over (PointwiseStep::in_place): output -> input. Their lifetimes
  // meet at that step, and they share bytes all the same.
  std::map<std::string, std::string> written_over;
  // Whether `name` shares bytes with another tensor.
  bool shares(const std::string &name) const;
  // Whether its value is still there after a run: kept to the last step,
  // or on bytes of its own.
  bool outlives_run(const std::string &name) const;
};

// Plans every tensor that is not an input; `bytes` gives each one's size.
// Offsets are multiples of `alignment`.
MemoryPlan plan_memory(const KernelProgram &p, const std::function<size_t(const TensorDecl &)> &bytes, size_t boundary,
                       size_t alignment = 256);

// Where each intermediate lives when the caller gives a program its memory
// one step at a time (a layer inside a model): the program owns none, so a
// model's memory is what its layers keep between their forwards and
// backwards, not a buffer per layer for every intermediate it ever makes.
// Two regions, offsets into each:
//   saved      the tensors written before `boundary` and read at or after
//              it (a training forward's activations for its backward), one
//              after another; the caller keeps this region from the forward
//              to the end of its backward, one per forward in flight. A
//              backward output written over a saved tensor
//              (Schedule::gradients_over_saved) takes that tensor's bytes
//              here (saved.written_over).
//   workspace  every other intermediate, sharing bytes by lifetime (an
//              output an element-wise step writes over an input it reads
//              takes the input's bytes: PointwiseStep::in_place); live
//              within one entry point only, so the caller may hand the
//              steps before `boundary` and the steps from it different
//              memory, each just for the call.
// Inputs and the program's outputs (the layer's output, the gradients) are
// the caller's tensors and are not planned; some intermediates live in
// their memory (in_output).
//
// Where an intermediate lives in one of the caller's outputs: that
// output's bytes from `offset` on. Either an element-wise step's input that
// the step writes the output over, element by element (scratch false,
// offset 0: lowering/in_place.h, may_live_in_output), or scratch: a tensor
// whose whole lifetime ends before any step touches the output, in the
// entry point the output belongs to (a training backward's dH, before the
// weight gradients are written), which needs no workspace then.
struct InOutput {
  std::string output;
  size_t offset = 0;
  bool scratch = false;
  bool operator==(const InOutput &o) const { return output == o.output && offset == o.offset && scratch == o.scratch; }
};
struct StepMemoryPlan {
  MemoryPlan saved, workspace;
  // The bytes of the workspace the steps before `boundary`, and those from
  // it, touch (each <= workspace.arena_bytes).
  size_t workspace_before = 0, workspace_after = 0;
  // Intermediates that live in an output's memory, wherever the caller
  // binds it: intermediate -> where; in neither region.
  std::map<std::string, InOutput> in_output;
  // Whether the plan gives `name` its memory (a region, or an output's):
  // an intermediate, which the caller never binds.
  bool places(const std::string &name) const {
    return saved.offset.count(name) || workspace.offset.count(name) || in_output.count(name);
  }
};

// Whether plan_step_memory places scratch in the outputs (InOutput::
// scratch); `off` isolates another choice's effect on the workspace.
enum class OutputScratch { on, off };
StepMemoryPlan plan_step_memory(const KernelProgram &p, const std::function<size_t(const TensorDecl &)> &bytes,
                                size_t boundary, size_t alignment = 256, OutputScratch scratch = OutputScratch::on);

// A layer on caller memory at one token count, as both backends lay it out:
// the plan of its tensors; the saved ones in two parts (StepMemory::saved),
// the activations (rows of features) one after another in the first, the
// few values a row or pair (probabilities, a route's choices) and every
// route's tables in the last (a tensor written over a saved one takes its
// place); and what a step needs. A forward alone, which saves nothing, has
// the last part only. Offsets and part sizes are multiples of
// kRegionAlignment.
inline constexpr size_t kRegionAlignment = 256;
struct CallerMemoryLayout {
  StepMemoryPlan plan;
  std::map<std::string, std::pair<size_t, size_t>> saved_at; // saved tensor -> (part, byte offset in it)
  std::map<const RoutingNode *, size_t> table_offset;        // bytes into the last part
  StepMemory memory;
};
CallerMemoryLayout caller_memory_layout(const KernelProgram &p, const ProgramShapes &shapes, size_t boundary,
                                        const std::function<size_t(const RoutingShape &)> &table_bytes);

// A UserError from `call` (a layer's place()) unless `given` holds one
// address per saved part of `bytes` (StepMemory::saved), each aligned to
// `alignment` and none null where its part holds bytes.
void check_saved_parts(const std::string &call, const SavedParts &given, const std::vector<size_t> &bytes,
                       size_t alignment);

// caller_memory_layout's saved parts' bytes (StepMemory::saved) over any
// token count, one SizeTerms a part, as size_terms.h writes them
// (`table_terms`: the backend's tables of one route, each term aligned to a
// multiple of kRegionAlignment); none where a tensor's or a route's size is
// not of that form.
std::optional<std::vector<SizeTerms>>
caller_saved_terms(const KernelProgram &p, const ProgramShapes &shapes, size_t boundary,
                   const std::function<std::optional<SizeTerms>(const RoutingShape &)> &table_terms);

} // namespace moeforge
