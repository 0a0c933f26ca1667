#include "runtime/expert_exchange_host.h"

#include <algorithm>

#include "dsl/error.h"

namespace moeforge {

namespace {

// Values per row of a [rows, ...] tensor.
int64_t row_width(const HostTensor &t) {
  int64_t w = 1;
  for (size_t i = 1; i < t.shape.size(); ++i)
    w *= t.shape[i];
  return w;
}

} // namespace

HostExpertExchange::HostExpertExchange(int64_t experts, int ranks, std::vector<std::vector<int32_t>> experts_of)
    : experts_of_(std::move(experts_of)) {
  user_check(ranks >= 1 && experts % ranks == 0 && static_cast<int>(experts_of_.size()) == ranks)
      << "expert exchange: " << experts << " experts over " << ranks << " ranks (" << experts_of_.size()
      << " ranks' routings given): the ranks must divide the experts";
  local_ = experts / ranks;
  arrivals_.resize(ranks);
  for (int p = 0; p < ranks; ++p)
    for (int q = 0; q < ranks; ++q)
      for (int64_t j = 0; j < local_; ++j) {
        const int32_t expert = static_cast<int32_t>(p * local_ + j);
        const std::vector<int32_t> &e = experts_of_[q];
        for (size_t r = 0; r < e.size(); ++r)
          if (e[r] == expert)
            arrivals_[p].push_back({q, static_cast<int64_t>(r), static_cast<int32_t>(j)});
      }
}

HostTensor HostExpertExchange::selector(int p) const {
  HostTensor s({received(p), local_}, 0.0);
  for (int64_t n = 0; n < received(p); ++n)
    s.data[n * local_ + arrivals_[p][n].local_expert] = 1.0;
  return s;
}

std::vector<HostTensor> HostExpertExchange::dispatch(const std::vector<HostTensor> &rows) const {
  internal_check(static_cast<int>(rows.size()) == ranks()) << "one tensor of rows per rank";
  std::vector<HostTensor> out;
  for (int p = 0; p < ranks(); ++p) {
    std::vector<int64_t> shape = rows.front().shape;
    shape[0] = received(p);
    HostTensor t(shape, 0.0);
    const int64_t w = row_width(t);
    for (int64_t n = 0; n < received(p); ++n) {
      const Arrival &a = arrivals_[p][n];
      internal_check(rows[a.source].shape[0] == static_cast<int64_t>(experts_of_[a.source].size()))
          << "rank " << a.source << "'s rows are not one per pair";
      std::copy_n(rows[a.source].data.begin() + a.pair * w, w, t.data.begin() + n * w);
    }
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<HostTensor> HostExpertExchange::give_back(const std::vector<HostTensor> &rows) const {
  internal_check(static_cast<int>(rows.size()) == ranks()) << "one tensor of rows per rank";
  std::vector<HostTensor> out;
  for (int q = 0; q < ranks(); ++q) {
    std::vector<int64_t> shape = rows.front().shape;
    shape[0] = static_cast<int64_t>(experts_of_[q].size());
    out.emplace_back(shape, 0.0);
  }
  for (int p = 0; p < ranks(); ++p) {
    internal_check(rows[p].shape[0] == received(p)) << "rank " << p << "'s rows are not one per received row";
    const int64_t w = row_width(rows[p]);
    for (int64_t n = 0; n < received(p); ++n) {
      const Arrival &a = arrivals_[p][n];
      std::copy_n(rows[p].data.begin() + n * w, w, out[a.source].data.begin() + a.pair * w);
    }
  }
  return out;
}

} // namespace moeforge
