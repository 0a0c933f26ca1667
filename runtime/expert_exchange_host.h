// Expert parallelism's row exchange on the host: where each routed row goes
// and comes back, for ranks emulated in one process (a loopback exchange).
// The CPU backend's expert-parallel runs and the tests' oracles use it; the
// device exchange (backends/cuda/parallel/expert_exchange.h) moves rows in the same
// order.
//
// Rank q owns experts q E/R .. (q+1) E/R - 1. A rank receives, source rank by
// source rank, each source's rows for its experts in expert order, and
// within an expert in pair order.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/tensor.h"

namespace moeforge {

class HostExpertExchange {
public:
  // experts_of[q]: rank q's routed experts, pair order (r = t * k + slot).
  HostExpertExchange(int64_t experts, int ranks, std::vector<std::vector<int32_t>> experts_of);

  int ranks() const { return static_cast<int>(experts_of_.size()); }
  int64_t local_experts() const { return local_; }
  // Rows rank p receives.
  int64_t received(int p) const { return static_cast<int64_t>(arrivals_[p].size()); }
  // [received(p), E / R]: 1 at each received row's local expert (the expert
  // side's selector), 0 elsewhere.
  HostTensor selector(int p) const;
  // rows[q]: rank q's rows in pair order ([T_q * k, width...]); returns each
  // rank's received rows.
  std::vector<HostTensor> dispatch(const std::vector<HostTensor> &rows) const;
  // The reverse: rows[p] in rank p's received order, back to each source
  // rank in pair order.
  std::vector<HostTensor> give_back(const std::vector<HostTensor> &rows) const;

private:
  struct Arrival {
    int source;
    int64_t pair;
    int32_t local_expert;
  };
  int64_t local_;
  std::vector<std::vector<int32_t>> experts_of_;
  std::vector<std::vector<Arrival>> arrivals_; // per receiving rank, in received order
};

} // namespace moeforge
