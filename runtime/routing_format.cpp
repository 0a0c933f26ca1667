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

int64_t routing_array_elements(RoutingArray a, const RoutingShape &shape) {
  switch (a) {
  case RoutingArray::expert:
  case RoutingArray::pair_pos:
    return shape.pairs();
  case RoutingArray::counts:
    return shape.experts;
  case RoutingArray::offsets:
    return shape.experts + 1;
  case RoutingArray::sorted_pair:
    return shape.max_padded_rows();
  case RoutingArray::tile_expert:
  case RoutingArray::tile_row_start:
  case RoutingArray::tile_rows:
    return shape.max_tiles();
  case RoutingArray::num_tiles:
  case RoutingArray::padded_rows:
    return 1;
  case RoutingArray::window:
    return shape.max_tiles() + 1;
  }
  return 0;
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
  for (int i = 0; i <= static_cast<int>(RoutingArray::padded_rows); ++i) {
    SizeFactor f;
    switch (static_cast<RoutingArray>(i)) {
    case RoutingArray::expert:
    case RoutingArray::pair_pos:
      f = SizeFactor::tokens(s.k);
      break;
    case RoutingArray::sorted_pair:
      f = SizeFactor::padded_rows(s.k, s.block, s.experts);
      break;
    case RoutingArray::tile_expert:
    case RoutingArray::tile_row_start:
    case RoutingArray::tile_rows:
      f = SizeFactor::tiles(s.k, s.block, s.experts);
      break;
    default: // no token count in it
      f = SizeFactor::constant(routing_array_elements(static_cast<RoutingArray>(i), s));
    }
    t.sum.push_back({static_cast<int64_t>(sizeof(int32_t)), {f}});
  }
  return SizeTerms{t};
}

} // namespace moeforge
