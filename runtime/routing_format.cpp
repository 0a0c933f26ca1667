#include "runtime/routing_format.h"

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

} // namespace moeforge
