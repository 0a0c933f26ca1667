// The routing format the grouped expert GEMMs read: its shape and its
// arrays, which both backends' kernels take and both runtimes fill.
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
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dsl/capacity.h"
#include "runtime/size_terms.h"

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

// The format's arrays (all int32), as kernels take them: one argument each.
enum class RoutingArray {
  expert,  // [P] the expert of each pair (the top-k's output)
  counts,  // [E]
  offsets, // [E + 1]
  // [E + 1] the same without padding: where an expert's rows start in a
  // tensor stored in the expert-sorted order (RowLayout::sorted)
  offsets_unpadded,
  pair_pos,       // [P]
  sorted_pair,    // [max_padded_rows]
  tile_expert,    // [max_tiles]
  tile_row_start, // [max_tiles]
  tile_rows,      // [max_tiles]
  num_tiles,      // [1] tiles in use
  padded_rows,    // [1] rows in use: offsets[E]
  // [max_tiles + 1] a windowed GEMM's tiles (CUDA only: an expert-parallel
  // rank's forward over the experts whose rows have arrived): a count, then
  // that many tile ids of the pair-aligned order.
  window,
};

// Its name in generated code ("sorted_pair": kernels' rt_<route>_sorted_pair).
const char *routing_array_name(RoutingArray a);
// Its int32 elements for `shape`: over the token count (size_terms.h), with
// a dropping route's capacity-bound counts as constants at its T; and at T.
SizeFactor routing_array_count(RoutingArray a, const RoutingShape &shape);
int64_t routing_array_elements(RoutingArray a, const RoutingShape &shape);

// The tables as one block of memory (where a runtime keeps them with a
// training forward's saved activations, so each forward in flight keeps its
// own): every array but `window`, in the enum's order, one after another.
// Byte offset of array `a` (not `window`) and the block's bytes.
size_t routing_table_offset(RoutingArray a, const RoutingShape &shape);
size_t routing_table_bytes(const RoutingShape &shape);
// routing_table_bytes over any token count (its k, E and block), aligned to
// `align` as one term (size_terms.h); none for a dropping route.
std::optional<SizeTerms> routing_table_terms(const RoutingShape &shape, int64_t align);

// The row pair r is stored at in a tensor stored sorted (RowLayout::sorted:
// grouped by expert without padding), offsets_unpadded[e] + pair_pos[r] -
// offsets[e] with e = expert[r], from the tables' arrays.
std::vector<int32_t> sorted_rows(const std::vector<int32_t> &expert, const std::vector<int32_t> &pair_pos,
                                 const std::vector<int32_t> &offsets, const std::vector<int32_t> &offsets_unpadded);

// Array `a` of a set of routing tables: the host's RoutingTables
// (routing_host.h) or a device RoutingPlan, which share the member names;
// null for those the tables do not hold as an array (num_tiles,
// padded_rows and window are each runtime's own).
template <typename Tables> auto *routing_array(Tables &t, RoutingArray a) {
  using Member = decltype(&t.expert);
  switch (a) {
  case RoutingArray::expert:
    return &t.expert;
  case RoutingArray::counts:
    return &t.counts;
  case RoutingArray::offsets:
    return &t.offsets;
  case RoutingArray::offsets_unpadded:
    return &t.offsets_unpadded;
  case RoutingArray::pair_pos:
    return &t.pair_pos;
  case RoutingArray::sorted_pair:
    return &t.sorted_pair;
  case RoutingArray::tile_expert:
    return &t.tile_expert;
  case RoutingArray::tile_row_start:
    return &t.tile_row_start;
  case RoutingArray::tile_rows:
    return &t.tile_rows;
  case RoutingArray::num_tiles:
  case RoutingArray::padded_rows:
  case RoutingArray::window:
    break;
  }
  return static_cast<Member>(nullptr);
}

} // namespace moeforge
