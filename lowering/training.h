// Lowering for training: the layer's forward and backward as one kernel
// program, split into two entry points. The forward is every step any of the
// layer's outputs needs (routing included: the layer's output and, with
// auxiliary losses, each loss); the backward is the rest and reads
// what the forward left in memory: those tensors are the activations a
// training step keeps between its forward and its backward (`saved`).
//
// Under a schedule with recompute(true), the backward makes its own copy of
// each routed activation that is cheap to make again (element-wise steps,
// gathers, and GEMMs that read the layer's inputs), so the forward's copy need
// not be kept; outputs of GEMMs over other activations (the second expert
// GEMM) stay stored, recomputing them would cost a whole GEMM.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dsl/training.h"
#include "lowering/kernel_program.h"
#include "schedules/schedule.h"

namespace moeforge {

struct TrainingProgram {
  KernelProgram program;                  // the forward's steps first, then the backward's
  size_t forward_steps = 0;               // steps [0, forward_steps) are the forward
  std::vector<std::string> outputs;       // the forward outputs ("y", "lb_loss", ...), in the order given
  std::vector<std::string> seeds;         // seeds[k]: the upstream gradient Input of outputs[k] ("d_y", ...)
  std::string output, seed;               // outputs[0] and seeds[0]
  std::vector<std::string> gradients, of; // "d_x", ... and the Input or Param each belongs to
  // Tensors the forward writes and the backward reads, in program order.
  std::vector<std::string> saved;
  std::vector<std::string> recomputed; // forward tensors the backward makes again
  // Saved tensors a backward output takes the bytes of (Schedule::
  // gradients_over_saved), output -> saved tensor: on memory the caller
  // gives each step, a backward destroys them, so a forward serves one
  // backward there.
  std::map<std::string, std::string> written_over_saved;
  // Where written_over_saved is not empty, why a second backward of one
  // forward is refused and what to do instead (the words every runtime
  // refuses it with); empty otherwise.
  std::string one_backward_reason() const;

  // The index of forward output `name` in outputs; a UserError that names
  // the outputs otherwise (`what` says who asked, e.g. "output()").
  size_t output_index(const std::string &name, const std::string &what) const;
  bool is_seed(const std::string &name) const;
  // A UserError naming the first output whose upstream gradient was not
  // uploaded (uploaded[k] for seeds[k]): the backward would read garbage.
  void check_seeds_uploaded(const std::vector<bool> &uploaded) const;
  // What a backward needs before it runs: a forward since the last upload or
  // poison, and every seed (UserErrors that say which and what to call).
  void check_ready_for_backward(bool forward_ran, const std::vector<bool> &uploaded) const;
  // The gradient Func of Input or Param `name` ("x" -> "d_x"); a UserError
  // naming the Inputs and Params the outputs depend on otherwise.
  const std::string &gradient_of(const std::string &name) const;
};

// Lowers training_algebra(forward, outputs) under `schedule`.
TrainingProgram lower_training(const Pipeline &forward, const std::vector<Func> &outputs, const Schedule &schedule);
// One output: lower_training(forward, {output}, schedule).
TrainingProgram lower_training(const Pipeline &forward, const Func &output, const Schedule &schedule);

} // namespace moeforge
