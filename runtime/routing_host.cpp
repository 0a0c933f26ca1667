#include "runtime/routing_host.h"

#include "dsl/error.h"
#include "dsl/top_k_select.h"

#include <algorithm>
#include <climits>
#include <numeric>
#include <sstream>

namespace moeforge {

void RoutingShape::check() const {
  user_check(experts >= 1 && experts <= kMaxRoutingExperts)
      << "routing with E = " << experts << " experts: the routing of the compiled backends (CPU and CUDA) "
      << "supports 1 to " << kMaxRoutingExperts;
  user_check(k >= 1 && k <= experts) << "routing with k = " << k << " of E = " << experts
                                     << " experts: k must be between 1 and E";
  user_check(groups >= 1 && experts % groups == 0 && top_groups >= 1 && top_groups <= groups &&
             k <= top_groups * (experts / groups))
      << "routing with " << groups << " groups, " << top_groups << " kept, of E = " << experts
      << " experts and k = " << k << ": the groups must divide E and the kept ones hold at least k experts";
  user_check(block >= 1) << "routing with block size " << block << ": it must be positive (64, 128 or 256)";
  user_check(tokens >= 0) << "routing " << tokens << " tokens: the count cannot be negative";
  user_check(capacity >= -1) << "routing with capacity " << capacity << ": use -1 for dropless or a count >= 0";
  // Positions and pair numbers are int32 on the device.
  user_check(max_padded_rows() <= INT_MAX)
      << "routing " << to_string() << " needs " << max_padded_rows() << " padded rows, more than int32 indexes";
}

std::string RoutingShape::to_string() const {
  std::ostringstream s;
  s << "T=" << tokens << " E=" << experts << " k=" << k << " block=" << block;
  if (drops())
    s << " capacity=" << capacity;
  return s.str();
}

namespace {

// kept[r] per the shape's capacity rule; every pair when dropless.
std::vector<uint8_t> kept_pairs(const RoutingShape &shape, const std::vector<int32_t> &expert,
                                const std::vector<float> &score) {
  if (!shape.drops())
    return std::vector<uint8_t>(expert.size(), 1);
  user_check(shape.priority == KeepPriority::token_order || score.size() == expert.size())
      << "routing " << shape.to_string() << " keeps each expert's best scores, but " << score.size()
      << " scores were given for " << expert.size() << " pairs";
  return keep_within_capacity(expert.data(), score.data(), shape.tokens, shape.k, shape.experts, shape.capacity,
                              shape.priority);
}

} // namespace

RoutingTables route_on_host(const RoutingShape &shape, const std::vector<int32_t> &expert,
                            const std::vector<float> &score) {
  shape.check();
  const int64_t P = shape.pairs();
  const int E = shape.experts, bs = shape.block;
  user_check(static_cast<int64_t>(expert.size()) == P)
      << "route_on_host: " << expert.size() << " expert ids given for " << shape.to_string() << " (" << P << " pairs)";
  RoutingTables t;
  t.expert = expert;
  t.counts.assign(E, 0);
  for (int32_t e : expert)
    user_check(e >= 0 && e < E) << "route_on_host: expert id " << e << " is outside 0.." << E - 1;
  const std::vector<uint8_t> kept = kept_pairs(shape, expert, score);
  for (int64_t r = 0; r < P; ++r)
    t.counts[expert[r]] += kept[r];
  t.offsets.assign(E + 1, 0);
  t.offsets_unpadded.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) {
    t.offsets[e + 1] = t.offsets[e] + (t.counts[e] + bs - 1) / bs * bs;
    t.offsets_unpadded[e + 1] = t.offsets_unpadded[e] + t.counts[e];
  }
  // A stable counting sort: pairs are visited in order r, so each expert's
  // pairs land in order.
  std::vector<int32_t> next(t.offsets.begin(), t.offsets.end() - 1);
  t.pair_pos.assign(P, -1);
  t.sorted_pair.assign(shape.max_padded_rows(), -1);
  for (int64_t r = 0; r < P; ++r) {
    if (!kept[r]) {
      t.pair_pos[r] = static_cast<int32_t>(shape.drop_row());
      continue;
    }
    int32_t pos = next[expert[r]]++;
    t.pair_pos[r] = pos;
    t.sorted_pair[pos] = static_cast<int32_t>(r);
  }
  const int64_t max_tiles = shape.max_tiles();
  t.tile_expert.assign(max_tiles, -1);
  t.tile_row_start.assign(max_tiles, -1);
  t.tile_rows.assign(max_tiles, 0);
  std::vector<int32_t> tiles_of(E);
  for (int e = 0; e < E; ++e)
    tiles_of[e] = (t.offsets[e + 1] - t.offsets[e]) / bs;
  const std::vector<TileSlot> order = pair_aligned_tiles(tiles_of);
  for (size_t i = 0; i < order.size(); ++i) {
    const int e = order[i].expert;
    const int32_t start = t.offsets[e] + order[i].index * bs;
    t.tile_expert[i] = e;
    t.tile_row_start[i] = start;
    t.tile_rows[i] = std::min(bs, t.counts[e] - (start - t.offsets[e]));
  }
  t.num_tiles = static_cast<int32_t>(order.size());
  return t;
}

std::vector<TileSlot> pair_aligned_tiles(const std::vector<int32_t> &tiles_of) {
  std::vector<TileSlot> order;
  // Each expert's whole pairs, then the tails of odd experts two by two, the
  // pair after its second's pairs.
  int pending = -1; // an odd expert whose tail waits for a partner
  const int E = static_cast<int>(tiles_of.size());
  for (int e = 0; e < E; ++e) {
    const int32_t n = tiles_of[e];
    for (int32_t k = 0; k < n / 2 * 2; ++k)
      order.push_back({e, k});
    if (n % 2 == 0)
      continue;
    if (pending < 0) {
      pending = e;
      continue;
    }
    order.push_back({pending, tiles_of[pending] - 1});
    order.push_back({e, n - 1});
    pending = -1;
  }
  if (pending >= 0)
    order.push_back({pending, tiles_of[pending] - 1});
  return order;
}

int64_t dropped_pairs(const RoutingShape &shape, const RoutingTables &tables) {
  int64_t kept = 0;
  for (int32_t c : tables.counts)
    kept += c;
  return shape.pairs() - kept;
}

HostTopK top_k_on_host(const RoutingShape &shape, const std::vector<float> &probs) {
  shape.check();
  const int E = shape.experts, k = shape.k;
  user_check(static_cast<int64_t>(probs.size()) == shape.tokens * E)
      << "top_k_on_host: " << probs.size() << " probabilities given for " << shape.to_string();
  HostTopK out;
  std::vector<int32_t> order(E);
  for (int64_t t = 0; t < shape.tokens; ++t) {
    const float *row = &probs[t * E];
    // The reference's rule (dsl/top_k_select.h).
    select_top_k(row, E, k, shape.groups, shape.top_groups, order.data(), t);
    for (int s = 0; s < k; ++s) {
      out.expert.push_back(order[s]);
      out.gate.push_back(row[order[s]]);
    }
  }
  return out;
}

namespace {
// Collects violations, but keeps the list short: one broken invariant
// usually breaks it at many indices.
class Violations {
public:
  template <typename... Parts> void add(const Parts &...parts) {
    if (list_.size() < 20) {
      std::ostringstream s;
      (s << ... << parts);
      list_.push_back(s.str());
    }
  }
  std::vector<std::string> take() { return std::move(list_); }

private:
  std::vector<std::string> list_;
};

template <typename T> bool sized(Violations &v, const std::vector<T> &a, int64_t n, const char *name) {
  if (static_cast<int64_t>(a.size()) == n)
    return true;
  v.add(name, " has ", a.size(), " entries, expected ", n);
  return false;
}
} // namespace

std::vector<std::string> verify_routing_tables(const RoutingShape &shape, const RoutingTables &t,
                                               const std::vector<float> &score) {
  Violations v;
  const int64_t P = shape.pairs(), E = shape.experts, bs = shape.block;
  bool ok = sized(v, t.expert, P, "expert") & sized(v, t.counts, E, "counts") & sized(v, t.offsets, E + 1, "offsets") &
            sized(v, t.offsets_unpadded, E + 1, "offsets_unpadded") & sized(v, t.pair_pos, P, "pair_pos") &
            sized(v, t.sorted_pair, shape.max_padded_rows(), "sorted_pair") &
            sized(v, t.tile_expert, shape.max_tiles(), "tile_expert") &
            sized(v, t.tile_row_start, shape.max_tiles(), "tile_row_start") &
            sized(v, t.tile_rows, shape.max_tiles(), "tile_rows");
  if (!ok)
    return v.take();
  for (int64_t r = 0; r < P; ++r)
    if (t.expert[r] < 0 || t.expert[r] >= E) {
      v.add("expert[", r, "] = ", t.expert[r], " is not an expert");
      return v.take();
    }

  // counts and offsets from their definitions.
  const std::vector<uint8_t> kept = kept_pairs(shape, t.expert, score);
  std::vector<int64_t> count(E, 0);
  for (int64_t r = 0; r < P; ++r)
    count[t.expert[r]] += kept[r];
  if (t.offsets[0] != 0 || t.offsets_unpadded[0] != 0)
    v.add("offsets[0] and offsets_unpadded[0] must be 0");
  for (int64_t e = 0; e < E; ++e) {
    if (t.counts[e] != count[e])
      v.add("counts[", e, "] = ", t.counts[e], ", but ", count[e], " pairs go to expert ", e);
    if (t.offsets[e + 1] - t.offsets[e] != (count[e] + bs - 1) / bs * bs)
      v.add("expert ", e, "'s padded segment [", t.offsets[e], ", ", t.offsets[e + 1], ") is not roundup(", count[e],
            ", ", bs, ") rows");
    if (t.offsets_unpadded[e + 1] - t.offsets_unpadded[e] != count[e])
      v.add("offsets_unpadded of expert ", e, " do not span its ", count[e], " pairs");
  }

  // pair_pos: inside its expert's segment, in order of r (stable), and
  // sorted_pair its inverse with -1 everywhere else.
  std::vector<int64_t> seen(E, 0);
  std::vector<char> hit(t.sorted_pair.size(), 0);
  for (int64_t r = 0; r < P; ++r) {
    int32_t e = t.expert[r];
    if (!kept[r]) {
      if (t.pair_pos[r] != shape.drop_row())
        v.add("pair_pos[", r, "] = ", t.pair_pos[r], ", expected the drop row ", shape.drop_row(),
              " (pair dropped at capacity ", shape.capacity, ")");
      continue;
    }
    int64_t want = t.offsets[e] + seen[e]++;
    int32_t pos = t.pair_pos[r];
    if (pos != want) {
      v.add("pair_pos[", r, "] = ", pos, ", expected ", want, " (expert ", e, ", stable order)");
      continue;
    }
    hit[pos] = 1;
    if (t.sorted_pair[pos] != r)
      v.add("sorted_pair[", pos, "] = ", t.sorted_pair[pos], ", but pair_pos[", r, "] = ", pos);
  }
  for (size_t p = 0; p < hit.size(); ++p)
    if (!hit[p] && t.sorted_pair[p] != -1)
      v.add("sorted_pair[", p, "] = ", t.sorted_pair[p], " at a padding row, expected -1");

  // Tiles: the first num_tiles cover [0, offsets[E]) in the pair-aligned
  // order (the oracle's), each row once, each within one expert; the rest
  // are empty.
  int64_t tiles = t.num_tiles;
  if (tiles != t.offsets[E] / bs || t.offsets[E] % bs != 0)
    v.add("num_tiles = ", tiles, " for ", t.offsets[E], " padded rows of block ", bs);
  tiles = std::clamp<int64_t>(tiles, 0, shape.max_tiles());
  const RoutingTables order = route_on_host(shape, t.expert, score);
  for (int64_t i = 0; i < tiles; ++i) {
    int32_t e = t.tile_expert[i], start = t.tile_row_start[i], rows = t.tile_rows[i];
    if (i < order.num_tiles && start != order.tile_row_start[i])
      v.add("tile ", i, " starts at row ", start, ", expected ", order.tile_row_start[i],
            " (tiles cover rows once, pair-aligned)");
    if (e < 0 || e >= E) {
      v.add("tile ", i, " has expert ", e);
      continue;
    }
    if (start < t.offsets[e] || start + bs > t.offsets[e + 1])
      v.add("tile ", i, " rows [", start, ", ", start + bs, ") leave expert ", e, "'s segment [", t.offsets[e], ", ",
            t.offsets[e + 1], ")");
    int64_t valid = std::min<int64_t>(bs, t.offsets[e] + count[e] - start);
    if (rows != valid || rows < 1)
      v.add("tile_rows[", i, "] = ", rows, ", expected ", valid);
  }
  for (int64_t i = tiles; i < shape.max_tiles(); ++i)
    if (t.tile_expert[i] != -1 || t.tile_row_start[i] != -1 || t.tile_rows[i] != 0)
      v.add("tile ", i, " is past num_tiles = ", tiles, " but not marked empty (-1, -1, 0)");
  return v.take();
}

} // namespace moeforge
