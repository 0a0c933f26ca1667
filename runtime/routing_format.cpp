#include "runtime/routing_format.h"

#include "dsl/error.h"

namespace moeforge {

const char *routing_array_name(RoutingArray a) {
  switch (a) {
  case RoutingArray::expert:
    return "expert";
  case RoutingArray::counts:
    return "counts";
  case RoutingArray::offsets:
    return "offsets";
  case RoutingArray::offsets_unpadded:
    return "offsets_unpadded";
  case RoutingArray::pair_pos:
    return "pair_pos";
  case RoutingArray::sorted_pair:
    return "sorted_pair";
  case RoutingArray::tile_expert:
    return "tile_expert";
  case RoutingArray::tile_row_start:
    return "tile_row_start";
  case RoutingArray::tile_rows:
    return "tile_rows";
  case RoutingArray::num_tiles:
    return "num_tiles";
  case RoutingArray::padded_rows:
    return "padded_rows";
  case RoutingArray::window:
    return "window";
  }
  return "?";
}

SizeFactor routing_array_count(RoutingArray a, const RoutingShape &shape) {
  // A dropping route's rows follow its capacity: their counts at its T.
  const bool by_tokens = !shape.drops();
  switch (a) {
  case RoutingArray::expert:
  case RoutingArray::pair_pos:
    return SizeFactor::tokens(shape.k);
  case RoutingArray::counts:
    return SizeFactor::constant(shape.experts);
  case RoutingArray::offsets:
  case RoutingArray::offsets_unpadded:
    return SizeFactor::constant(shape.experts + 1);
  case RoutingArray::sorted_pair:
    return by_tokens ? SizeFactor::padded_rows(shape.k, shape.block, shape.experts)
                     : SizeFactor::constant(shape.max_padded_rows());
  case RoutingArray::tile_expert:
  case RoutingArray::tile_row_start:
  case RoutingArray::tile_rows:
    return by_tokens ? SizeFactor::tiles(shape.k, shape.block, shape.experts) : SizeFactor::constant(shape.max_tiles());
  case RoutingArray::num_tiles:
  case RoutingArray::padded_rows:
    return SizeFactor::constant(1);
  case RoutingArray::window: // a count, then the tiles
    return by_tokens ? SizeFactor{shape.k, shape.block - 1, shape.block, 1, shape.experts + int64_t{1}}
                     : SizeFactor::constant(shape.max_tiles() + 1);
  }
  return SizeFactor::constant(0);
}

int64_t routing_array_elements(RoutingArray a, const RoutingShape &shape) {
  return routing_array_count(a, shape).at(shape.tokens);
}

std::vector<int32_t> sorted_rows(const std::vector<int32_t> &expert, const std::vector<int32_t> &pair_pos,
                                 const std::vector<int32_t> &offsets, const std::vector<int32_t> &offsets_unpadded) {
  internal_check(expert.size() == pair_pos.size())
      << "sorted_rows: " << expert.size() << " experts for " << pair_pos.size() << " pairs";
  std::vector<int32_t> rows(pair_pos.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    const size_t e = static_cast<size_t>(expert[r]);
    internal_check(e + 1 < offsets.size() && e + 1 < offsets_unpadded.size()) << "sorted_rows: expert " << e;
    rows[r] = offsets_unpadded[e] + pair_pos[r] - offsets[e];
  }
  return rows;
}

size_t routing_table_offset(RoutingArray a, const RoutingShape &shape) {
  internal_check(a != RoutingArray::window) << "the routing tables' block holds no window";
  size_t at = 0;
  for (int i = 0; i < static_cast<int>(a); ++i)
    at += static_cast<size_t>(routing_array_elements(static_cast<RoutingArray>(i), shape)) * sizeof(int32_t);
  return at;
}

size_t routing_table_bytes(const RoutingShape &shape) {
  return routing_table_offset(RoutingArray::padded_rows, shape) + sizeof(int32_t);
}

std::optional<SizeTerms> routing_table_terms(const RoutingShape &s, int64_t align) {
  if (s.drops())
    return std::nullopt;
  SizeTerm t{{}, align};
  for (int i = 0; i <= static_cast<int>(RoutingArray::padded_rows); ++i)
    t.sum.push_back({static_cast<int64_t>(sizeof(int32_t)), {routing_array_count(static_cast<RoutingArray>(i), s)}});
  return SizeTerms{t};
}

} // namespace moeforge
