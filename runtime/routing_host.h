// The routing format's host oracle (the format itself: routing_format.h):
// its tables computed on the CPU, host top-k, and a checker of every
// property the format promises.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/routing_format.h"

namespace moeforge {

struct RoutingTables {
  std::vector<int32_t> expert; // [P], the input
  std::vector<int32_t> counts, offsets, offsets_unpadded;
  std::vector<int32_t> pair_pos, sorted_pair;
  std::vector<int32_t> tile_expert, tile_row_start, tile_rows;
  int32_t num_tiles = 0;
};

// Tile i of the pair-aligned order (routing_format.h): tile `index` of `expert`'s
// segment (its rows index * bs ...).
struct TileSlot {
  int32_t expert, index;
};
// The pair-aligned order of tiles_of[e] tiles of each expert e: what the
// routing writes to tile_expert and tile_row_start, from the counts alone
// (an expert-parallel rank knows its experts' counts before their rows).
std::vector<TileSlot> pair_aligned_tiles(const std::vector<int32_t> &tiles_of);

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
