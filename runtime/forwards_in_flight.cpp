#include "runtime/forwards_in_flight.h"

#include <algorithm>

#include "dsl/error.h"

namespace moeforge {

namespace {
template <typename Deque, typename Key> bool holds(const Deque &d, const Key &k) {
  return std::find(d.begin(), d.end(), k) != d.end();
}
} // namespace

void ForwardsInFlight::forward_wrote(const SavedParts &saved, int64_t tokens) {
  const Key mine{saved, tokens};
  forwards_.erase(std::remove(forwards_.begin(), forwards_.end(), mine), forwards_.end());
  spent_.erase(std::remove(spent_.begin(), spent_.end(), mine), spent_.end());
  forwards_.push_back(mine);
  if (forwards_.size() > kRecent)
    forwards_.pop_front();
}

void ForwardsInFlight::check_backward(const TrainingProgram &t, const SavedParts &saved, int64_t tokens) const {
  const Key theirs{saved, tokens};
  const bool wrote = holds(forwards_, theirs);
  user_check(wrote || !holds(spent_, theirs)) << t.one_backward_reason();
  user_check(wrote) << "backward: no forward at " << tokens << " tokens wrote its activations to the saved memory "
                    << "given; give each backward the saved memory of its own forward, at that forward's token count "
                    << "(set_tokens)";
}

void ForwardsInFlight::backward_ran(const TrainingProgram &t, const SavedParts &saved, int64_t tokens) {
  if (t.written_over_saved.empty()) // what the forward saved is still there for another backward
    return;
  const Key theirs{saved, tokens};
  forwards_.erase(std::remove(forwards_.begin(), forwards_.end(), theirs), forwards_.end());
  spent_.push_back(theirs);
  if (spent_.size() > kRecent)
    spent_.pop_front();
}

bool ForwardsInFlight::spent(const SavedParts &saved, int64_t tokens) const {
  return holds(spent_, Key{saved, tokens});
}

} // namespace moeforge
