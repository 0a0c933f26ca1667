// Which forwards a training layer on caller memory may run a backward for.
// Each forward writes its activations into saved memory the caller gives it
// and keeps; its backward must be given that memory again, at that forward's
// token count. The layer cannot see the caller's memory, so it remembers the
// (saved parts' addresses, token count) of its recent forwards: a backward given
// memory no recent forward wrote is refused (it would read another step's
// activations, or none), and so is a second backward of one forward where
// the first wrote gradients over what the forward saved
// (TrainingProgram::written_over_saved). Both backends' training layers keep
// one, so both refuse with the same words.
#pragma once

#include <cstdint>
#include <deque>
#include <utility>

#include "lowering/training.h"
#include "runtime/layer_memory.h"

namespace moeforge {

class ForwardsInFlight {
public:
  // Remembered forwards (and spent ones): a model has at most a few hundred
  // layers' forwards in flight; an older one's backward is refused.
  static constexpr size_t kRecent = 256;

  // A forward wrote its activations to `saved` at `tokens` tokens: a
  // backward may read them (the memory written again is that forward's now).
  void forward_wrote(const SavedParts &saved, int64_t tokens);
  // A UserError unless a recent forward at `tokens` wrote `saved` and no
  // backward has spent it; `t` words the refusal of a second backward.
  void check_backward(const TrainingProgram &t, const SavedParts &saved, int64_t tokens) const;
  // The backward of that forward ran: where it wrote over the saved memory,
  // that forward serves no other.
  void backward_ran(const TrainingProgram &t, const SavedParts &saved, int64_t tokens);
  // Whether a backward wrote over the activations at `saved`.
  bool spent(const SavedParts &saved, int64_t tokens) const;

private:
  using Key = std::pair<SavedParts, int64_t>;
  std::deque<Key> forwards_; // newest last
  std::deque<Key> spent_;    // newest last
};

} // namespace moeforge
