// The routing format the grouped expert GEMMs read, and its host oracle.
//
// After top-k, a step has P = T*k (token, expert) pairs, numbered
// r = t*k + s (slot s = 0 holds the largest probability). The blocked
// format sorts the pairs by expert, stably (pairs of one expert keep the
// order of r), and pads each expert's segment to a multiple of the block
// size bs, so that every tile of bs rows belongs to one expert:
//
//   counts[e]            pairs routed to expert e                    [E]
//   offsets[e]           padded start of e's segment; offsets[E] =   [E+1]
//                        sum of roundup(counts[e], bs)
//   offsets_unpadded[e]  the same without padding                    [E+1]
//   pair_pos[r]          padded row of pair r:                       [P]
//                        offsets[expert[r]] + #{r' < r : expert[r'] = expert[r]}
//   sorted_pair[p]       the pair at padded row p, or -1 at padding  [max_padded_rows]
//   tile_expert[i]       expert of tile i                            [max_tiles]
//   tile_row_start[i]    padded row of the tile's first row
//   tile_rows[i]         valid rows in the tile, 1..bs
//   num_tiles            tiles in use = offsets[E] / bs
//
// Tiles come pair-aligned, so that tiles 2m and 2m + 1 (what a two-block
// cluster takes) are one expert's wherever they can be: walking the experts
// in order, an expert's first 2 floor(n / 2) tiles (n = its segment / bs)
// follow in row order; an odd expert's last tile (its tail) waits for the
// next odd expert's, and the two follow that expert's pairs; a tail left
// without a partner comes last. E.g. n = (3, 2, 1): tiles e0 e0 e1 e1 e0' e2.
//
// With a fixed expert capacity (capacity >= 0; dsl/capacity.h), each
// expert keeps at most `capacity` of its pairs and the others are dropped:
// they are left out of counts, offsets and sorted_pair (so no tile computes
// them), and pair_pos[r] of a dropped pair is the drop row,
// max_padded_rows - 1, which no kept pair takes and no tile covers
// (offsets[E] <= kept + E (bs - 1) < kept_bound + E bs <= max_padded_rows):
// element-wise steps may read and write a dropped pair's padded row without
// a branch, and only the sums over a token's pairs test for it. The padded
// rows are then bounded by the kept pairs, not by P (max_tiles below), so
// a step that walks the pairs in row slots walks max(P, max_padded_rows).
//
// Grids are sized by max_tiles = ceil(P / bs) + E, an upper bound known on
// the host, so no step ever copies num_tiles back. Tiles at and past
// num_tiles hold tile_expert = -1, tile_row_start = -1, tile_rows = 0, and
// consumers skip them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "dsl/capacity.h"

namespace moeforge {

struct RoutingShape {
  int64_t tokens = 0;             // T
  int experts = 0;                // E, 1..kMaxRoutingExperts
  int k = 0;                      // experts per token, 1..E
  int block = 128;                // bs: rows per tile (64, 128 or 256 for the GEMMs)
  int groups = 1, top_groups = 1; // group-limited selection (TopKOptions); host routing only
  int64_t capacity = -1;          // pairs an expert keeps; -1: dropless
  KeepPriority priority = KeepPriority::token_order;

  int64_t pairs() const { return tokens * k; }
  bool drops() const { return capacity >= 0; }
  // pair_pos of a dropped pair (see above).
  int64_t drop_row() const { return max_padded_rows() - 1; }
  // The most pairs that get a padded row: every pair, or with a capacity
  // at most `capacity` an expert (expert choice offers T * E pairs and
  // keeps cf * T of them).
  int64_t kept_bound() const { return drops() ? std::min(pairs(), capacity * experts) : pairs(); }
  int64_t max_tiles() const { return (kept_bound() + block - 1) / block + experts; }
  int64_t max_padded_rows() const { return max_tiles() * block; }
  // Throws UserError naming the bad field and its allowed range.
  void check() const;
  std::string to_string() const; // "T=100 E=8 k=2 block=64"
};

// Top-k over experts is done by one warp holding E / 32 values per lane.
inline constexpr int kMaxRoutingExperts = 256;

struct RoutingTables {
  std::vector<int32_t> expert; // [P], the input
  std::vector<int32_t> counts, offsets, offsets_unpadded;
  std::vector<int32_t> pair_pos, sorted_pair;
  std::vector<int32_t> tile_expert, tile_row_start, tile_rows;
  int32_t num_tiles = 0;
};

// Tile i of the pair-aligned order (above): tile `index` of `expert`'s
// segment (its rows index * bs ...).
struct TileSlot {
  int32_t expert, index;
};
// The pair-aligned order of tiles_of[e] tiles of each expert e: what the
// routing writes to tile_expert and tile_row_start, from the counts alone
// (an expert-parallel rank knows its experts' counts before their rows).
std::vector<TileSlot> pair_aligned_tiles(const std::vector<int32_t> &tiles_of);

// The per-pair or per-tile array named `name` (as generated kernels name
// their routing arguments) in a set of routing tables: the host's
// RoutingTables or a device RoutingPlan, which share the member names; null
// for another name (the scalars num_tiles and padded_rows are the caller's).
template <typename Tables> auto *routing_array(Tables &t, const std::string &name) {
  using Member = decltype(&t.expert);
  return name == "expert"           ? &t.expert
         : name == "pair_pos"       ? &t.pair_pos
         : name == "sorted_pair"    ? &t.sorted_pair
         : name == "tile_expert"    ? &t.tile_expert
         : name == "tile_row_start" ? &t.tile_row_start
         : name == "tile_rows"      ? &t.tile_rows
         : name == "offsets"        ? &t.offsets
         : name == "counts"         ? &t.counts
                                    : static_cast<Member>(nullptr);
}

// The oracle: the tables for the expert ids of every pair (values 0..E-1).
// With a capacity, `score` (the pairs' chosen scores, pair order) ranks
// them for KeepPriority::score.
RoutingTables route_on_host(const RoutingShape &shape, const std::vector<int32_t> &expert,
                            const std::vector<float> &score = {});
// Pairs the tables leave out (0 when dropless).
int64_t dropped_pairs(const RoutingShape &shape, const RoutingTables &tables);

struct HostTopK {
  std::vector<int32_t> expert; // [T*k]
  std::vector<float> gate;     // [T*k], the chosen probabilities
};

// Top-k of each row of probs [T, E]: largest first, ties to the lower expert
// index. The same rule as the Eigen reference (backends/reference/
// evaluate.cpp, eval_routing), so every backend routes identically.
HostTopK top_k_on_host(const RoutingShape &shape, const std::vector<float> &probs);

// Every property the format promises, checked from the definitions above
// rather than by recomputing: the permutation, stability, padding, tile
// coverage. Returns the violations found (empty when the tables are right),
// each naming the array and index.
// With a capacity, `score` as for route_on_host.
std::vector<std::string> verify_routing_tables(const RoutingShape &shape, const RoutingTables &tables,
                                               const std::vector<float> &score = {});

} // namespace moeforge
